"""Prompt layer: blend prompts, a prefix, retrieved chunks, a suffix, assembled at token level.

Every chunk is tokenized alone (no BOS/EOS) so its token ids, and therefore its
cached KV, are the same wherever it lands. Boundaries travel as token spans;
text is never re-tokenized after joining, because BPE merges across a
separator would change the tokens.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

TextOrIds = str | Sequence[int]


class PromptError(ValueError):
    """A prompt that cannot be run: empty chunk list, empty chunk, too long."""


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_ids(x: Any) -> bool:
    return not isinstance(x, str) and isinstance(x, Sequence) and all(_is_int(t) for t in x)


@dataclass(frozen=True)
class BlendPrompt:
    """``prefix + sep + chunk_1 + sep + ... + chunk_k + sep + suffix``.

    Each part is text or a list of token ids. A text prefix gets the model's
    BOS token if its tokenizer adds one; token ids are used as given.
    """

    prefix: TextOrIds
    chunks: Sequence[TextOrIds]
    suffix: TextOrIds = ""

    def __post_init__(self) -> None:
        if isinstance(self.chunks, (str, bytes)) or not isinstance(self.chunks, Sequence):
            raise PromptError(
                "BlendPrompt.chunks must be a list of texts or token-id lists, one per retrieved document"
            )
        object.__setattr__(self, "chunks", tuple(self.chunks))
        if not self.chunks:
            raise PromptError(
                "BlendPrompt needs at least one chunk; pass a plain string or token ids to generate() "
                "for a prompt without retrieved documents"
            )
        for name, part in (("prefix", self.prefix), ("suffix", self.suffix)):
            if not isinstance(part, str) and not _is_ids(part):
                raise PromptError(
                    f"BlendPrompt.{name} must be a string or a list of token ids, got {type(part).__name__}"
                )
        for i, chunk in enumerate(self.chunks):
            if not isinstance(chunk, str) and not _is_ids(chunk):
                raise PromptError(f"chunk {i} must be a string or a list of token ids, got {type(chunk).__name__}")

    @classmethod
    def from_text(cls, text: str, separator: str) -> BlendPrompt:
        """Split a rendered prompt on ``separator``: the first piece is the
        prefix, the last the suffix, the pieces between are chunks. The
        fallback for callers that can hand over nothing but text."""
        if not separator:
            raise PromptError("from_text needs a non-empty separator")
        pieces = text.split(separator)
        if len(pieces) < 3:
            raise PromptError(
                f"the text holds {len(pieces) - 1} separator(s); at least two are needed to mark one chunk "
                "(prefix, separator, chunk, separator, suffix)"
            )
        return cls(pieces[0], pieces[1:-1], pieces[-1])


def check_chunk_spans(
    spans: Any, num_tokens: int, *, name: str = "chunk_spans", limit_name: str | None = None
) -> list[tuple[int, int]]:
    """``spans`` as a list of ``(start, end)`` if they are chunk spans of a
    sequence of ``num_tokens`` tokens: pairs of integers, ``0 <= start < end``,
    sorted and not overlapping, the last end ``<= num_tokens``. Otherwise a
    ``PromptError`` naming the span (``name[i]``) and the rule it breaks.
    ``limit_name``: what ``num_tokens`` is, for the message."""
    if isinstance(spans, (str, bytes)) or not isinstance(spans, Sequence):
        raise PromptError(f"{name} must be a list of [start, end] pairs, got {type(spans).__name__}")
    checked: list[tuple[int, int]] = []
    for i, span in enumerate(spans):
        where = f"{name}[{i}]"
        if isinstance(span, (str, bytes)) or not isinstance(span, Sequence) or len(span) != 2:
            raise PromptError(f"{where} must be a [start, end] pair of integers, got {span!r:.60}")
        start, end = span
        if not _is_int(start) or not _is_int(end):
            raise PromptError(f"{where} must hold integers (not floats, bools or strings), got {span!r:.60}")
        if start < 0:
            raise PromptError(f"{where} starts at {start}: a span cannot start before token 0")
        if end <= start:
            raise PromptError(f"{where} is [{start}, {end}]: a span's end must be after its start (end is exclusive)")
        if checked and start < checked[-1][1]:
            raise PromptError(
                f"{where} starts at {start}, before the end {checked[-1][1]} of the span before it: "
                "spans must be sorted and must not overlap"
            )
        if end > num_tokens:
            raise PromptError(f"{where} ends at {end}, past {limit_name or f'the prompt end ({num_tokens} tokens)'}")
        checked.append((start, end))
    return checked


def check_question_end(end: Any, spans: Sequence[tuple[int, int]], num_tokens: int, name: str) -> None:
    """``end`` is None or a token index between the last chunk's end and ``num_tokens``; else a
    ``PromptError`` naming ``name`` and the rule."""
    if end is None:
        return
    after = spans[-1][1] if spans else 0
    if not _is_int(end) or not after <= end <= num_tokens:
        raise PromptError(
            f"{name} must be a token index from the last chunk's end ({after}) to {num_tokens}, got {end!r:.40}"
        )


@dataclass(frozen=True)
class TokenizedPrompt:
    """The final token sequence and where each chunk lies in it; the spans are
    checked (``check_chunk_spans``), so a prompt built by hand is too."""

    token_ids: list[int]
    chunk_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) per chunk
    # Where the question's own tokens end, after the last chunk: what follows is a chat template's
    # (its end of turn, the assistant's header), which the "query-tail" selection does not score.
    # None: the question runs to the prompt's end (a prompt without a template).
    question_end: int | None = None

    def __post_init__(self) -> None:
        if not _is_ids(self.token_ids):
            raise PromptError(
                f"TokenizedPrompt.token_ids must be a list of integer token ids, got {self.token_ids!r:.60}"
            )
        object.__setattr__(self, "token_ids", list(self.token_ids))
        object.__setattr__(
            self,
            "chunk_spans",
            check_chunk_spans(self.chunk_spans, len(self.token_ids), name="TokenizedPrompt.chunk_spans"),
        )
        check_question_end(self.question_end, self.chunk_spans, len(self.token_ids), "TokenizedPrompt.question_end")

    def chunk_ids(self, i: int) -> list[int]:
        start, end = self.chunk_spans[i]
        return self.token_ids[start:end]

    def __len__(self) -> int:
        return len(self.token_ids)


def separator_forms(tokenizer, separator: str) -> list[list[int]]:
    """The token ids ``separator`` takes in a prompt tokenized whole: alone, and where a byte-level
    BPE splits it otherwise between words (SmolLM2 tokenizes "\\n\\n" alone as one token, and as
    two "\\n" tokens before a word). Each form decodes to the separator exactly."""
    encode = functools.partial(tokenizer.encode, add_special_tokens=False)
    forms = [encode(separator)] if separator else []
    for left, right in (("word", "Word"), ("word.", "Word"), ("word:", "word")):
        head, tail, whole = encode(left), encode(right), encode(left + separator + right)
        middle = whole[len(head) : len(whole) - len(tail)]
        if whole[: len(head)] != head or whole[len(whole) - len(tail) :] != tail or middle in forms or not middle:
            continue  # the words merged with the separator, or nothing new
        if tokenizer.decode(middle) == separator:
            forms.append(middle)
    return forms


def spans_from_separator(token_ids: Sequence[int], separator_forms: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Chunk spans of an already tokenized prompt ``prefix sep c1 sep ... ck sep
    suffix``: the pieces between the first and the last separator, which may
    take any of ``separator_forms`` (``separator_forms()``). The fallback for
    callers that send only text (the server side gets the tokens of the joined
    text); empty pieces are skipped. Chunks found this way were tokenized in
    context, so a BPE merge across a separator can give ids that differ from
    the chunk tokenized alone: a cache miss, never a wrong hit."""
    forms = sorted((list(f) for f in separator_forms if f), key=len, reverse=True)  # the longest first
    ids = list(token_ids)
    cuts: list[tuple[int, int]] = []  # each separator's (start, end)
    i = 0
    while i < len(ids):
        form = next((f for f in forms if ids[i : i + len(f)] == f), None)
        if form is None:
            i += 1
        else:
            cuts.append((i, i + len(form)))
            i += len(form)
    return [(a[1], b[0]) for a, b in itertools.pairwise(cuts) if b[0] > a[1]]


def bos_id_added(tokenizer) -> int | None:
    """The BOS id the tokenizer puts in front of text, or None if it adds none."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return None
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bos if ids and ids[0] == bos else None


@dataclass(frozen=True)
class Part:
    """A piece of a prompt: fresh text/ids, or a chunk (tokenized alone, reusable)."""

    content: TextOrIds
    chunk: bool = False
    question_end: int | None = None  # text: the character the question ends at (``TokenizedPrompt.question_end``)


def _tokenize_to(text: str, chars: int, tokenizer) -> tuple[list[int], int | None]:
    """``text``'s tokens, and how many of them start before its character ``chars`` (a token that
    straddles it counts); None where the tokenizer cannot say (no offsets, and the text before
    does not tokenize as a prefix of the whole)."""
    try:
        found = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(found["input_ids"]), sum(1 for start, _ in found["offset_mapping"] if start < chars)
    except (NotImplementedError, TypeError, KeyError, ValueError):  # a slow tokenizer has no offsets
        whole, before = (tokenizer.encode(t, add_special_tokens=False) for t in (text, text[:chars]))
        return whole, len(before) if whole[: len(before)] == before else None


def tokenize_parts(parts: Sequence[Part], tokenizer) -> TokenizedPrompt:
    """Tokenize each part alone and concatenate; chunk parts become spans.
    The model's BOS goes first if its tokenizer adds one and the first part
    is text that does not already start with it (a rendered chat template does)."""
    bos = bos_id_added(tokenizer)
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    question_end = None
    for i, part in enumerate(parts):
        content = part.content
        before = None  # the question's end in this piece, where it ends here
        if not isinstance(content, str):
            piece = list(content)
        elif part.question_end is not None and not part.chunk:
            piece, before = _tokenize_to(content, part.question_end, tokenizer)
        else:
            piece = tokenizer.encode(content, add_special_tokens=False)
        added = 0
        if i == 0 and isinstance(content, str) and bos is not None and (not piece or piece[0] != bos):
            piece, added = [bos] + piece, 1
        if part.chunk:
            if not piece:
                raise PromptError(f"chunk {len(spans)} is empty (it has no tokens); drop it or give it text")
            spans.append((len(ids), len(ids) + len(piece)))
        elif part.question_end is not None and isinstance(content, str):
            question_end = None if before is None else len(ids) + added + before
        ids += piece
    if not ids:
        raise PromptError("the prompt is empty")
    if question_end is not None and spans and question_end < spans[-1][1]:
        question_end = None  # the question comes before a chunk: no tail of its own after them
    return TokenizedPrompt(ids, spans, question_end)


def prompt_parts(prompt: BlendPrompt, separator: str) -> list[Part]:
    """``prefix sep c1 sep ... ck sep suffix`` as parts."""
    parts = [Part(prompt.prefix)]
    for chunk in prompt.chunks:
        parts += [Part(separator), Part(chunk, chunk=True)]
    return parts + [Part(separator), Part(prompt.suffix)]


# What an engine takes as a prompt: chunks to assemble, an assembled prompt, or plain text or ids.
PromptInput = BlendPrompt | TokenizedPrompt | str | Sequence[int]


def tokenize_prompt(prompt: PromptInput, tokenizer, separator: str) -> TokenizedPrompt:
    """Assemble the token sequence. A plain string or id list has no chunks;
    a TokenizedPrompt is taken as it is."""
    if isinstance(prompt, TokenizedPrompt):
        return prompt
    if isinstance(prompt, BlendPrompt):
        return tokenize_parts(prompt_parts(prompt, separator), tokenizer)
    if not isinstance(prompt, str) and not _is_ids(prompt):
        raise PromptError(
            f"prompt must be a BlendPrompt, a TokenizedPrompt, a string or a list of token ids, got {type(prompt).__name__}"
        )
    return tokenize_parts([Part(prompt)], tokenizer)
