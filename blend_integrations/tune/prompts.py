"""Tuning layer: blend prompts from a user's documents, as the engines build them.

The documents (text files, or folders of ``.txt``, ``.md`` and ``.rst``
files) are cut into chunks at paragraph and sentence ends, each about
``chunk_tokens`` tokens. A prompt is ``rag_prompt``'s layout, the one the
LangChain chain and the LlamaIndex synthesizer send: the model's chat
template, a system turn, the chunks (each tokenized alone, with the engine's
separator), and a question.

The questions are the user's, or made from the chunks by a recipe. Both
recipes pick one of the prompt's chunks and a sentence of at least eight
words in it:

- ``sentence``: ask how the sentence that begins with its first six words
  goes on (the reply quotes the rest);
- ``cloze``: blank out the sentence's longest word (of five letters or
  more, not its first) and ask which word is missing, so that the reply is a
  short answer found in one chunk, as a question about a fact is.

The ``squad`` recipe reads no documents of the user's: its prompts are SQuAD
v1.1 train's human-written questions, each with the paragraphs BM25 finds for
it, asked as ``benchmarks squad`` asks them (``quality.squad``). It reads none
of the paragraphs of the design sample that calibration's probes and the
benchmarks' train questions are drawn from, and its held-out prompts come from
articles its training prompts never read.

Tuning needs no right answers: the untuned model's own reply, read with full
attention, is what the tuned model learns to give when it reads the chunks alone.

Documents are split into training and held-out ones before any prompt is
made, so the held-out KL is measured on text the tuning never saw.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..chat import RAG_QUESTION, rag_prompt
from ..prompt import TokenizedPrompt
from ..quality.squad import (
    CHAT_SYSTEM,
    COMPLETION_QUESTION,
    COMPLETION_SYSTEM,
    Question,
    design_contexts,
    load_squad,
    retrieval_examples,
)

SUFFIXES = (".txt", ".md", ".rst")
MIN_CHUNK_TOKENS = 16  # shorter pieces are dropped: a chunk this short has nothing to read alone
QUESTION_WORDS = 6
RECIPES = ("sentence", "cloze", "squad")  # how questions are made (module docstring)
DOCUMENT_RECIPES = ("sentence", "cloze")  # the recipes that make questions from the user's documents
CLOZE_WORDS = 16  # the most words of the sentence a cloze question quotes
PUNCTUATION = ".,;:!?\"'()[]`"  # stripped from a word before it is measured or blanked


class DocumentsError(ValueError):
    """Documents that cannot make tuning prompts; the message says what is missing."""


def read_documents(paths: Sequence[str | os.PathLike]) -> list[str]:
    """The text of each file in ``paths`` (folders: their ``.txt``, ``.md``
    and ``.rst`` files, sorted, recursively)."""
    if not paths:
        raise DocumentsError("no documents: pass at least one text file or folder (--documents PATH ...)")
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file())
        elif path.is_file():
            files.append(path)
        else:
            raise DocumentsError(f"no documents: {str(path)!r} is neither a file nor a folder")
    texts = []
    for file in files:
        try:
            texts.append(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise DocumentsError(f"cannot read {str(file)!r} as UTF-8 text: {exc}") from exc
    if not any(t.strip() for t in texts):
        raise DocumentsError(f"no documents: found no text in {', '.join(map(str, paths))}")
    return texts


def split_chunks(texts: Sequence[str], tokenizer, chunk_tokens: int) -> list[str]:
    """Pieces of about ``chunk_tokens`` tokens, cut at paragraph ends, and at
    sentence ends inside a longer paragraph; pieces under
    ``MIN_CHUNK_TOKENS`` are dropped."""

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    chunks: list[str] = []
    for text in texts:
        sentences = []
        for paragraph in re.split(r"\n\s*\n", text):
            paragraph = " ".join(paragraph.split())
            if paragraph:
                sentences += [(s, count(s)) for s in re.split(r"(?<=[.!?])\s+", paragraph)]
                sentences.append(("\n\n", 0))  # a paragraph end: a preferred place to cut
        piece: list[str] = []
        size = 0
        for sentence, n in sentences:
            if piece and size + n > chunk_tokens:
                chunks.append(" ".join(piece).replace(" \n\n ", "\n\n").strip())
                piece, size = [], 0
            if sentence != "\n\n" or piece:
                piece.append(sentence)
                size += n
        if piece:
            chunks.append(" ".join(piece).replace(" \n\n ", "\n\n").strip())
    return [c for c in chunks if count(c) >= MIN_CHUNK_TOKENS]


def recipe_question(chunk: str, rng: random.Random, recipe: str = "sentence") -> str | None:
    """The ``recipe``'s question about ``chunk`` (see the module's docstring),
    or None when it has no sentence of eight words or more (for ``cloze``:
    none with a word to blank)."""
    sentences = [s.split() for s in re.split(r"(?<=[.!?])\s+", " ".join(chunk.split()))]
    long = [s for s in sentences if len(s) >= 8]
    if recipe == "sentence":
        if not long:
            return None
        words = rng.choice(long)[:QUESTION_WORDS]
        return f'How does the sentence that begins "{" ".join(words)}" go on?'
    if recipe != "cloze":
        raise ValueError(f"a question about a chunk is made by {' or '.join(DOCUMENT_RECIPES)}, not {recipe!r}")
    blanks = []  # (sentence, its words without punctuation, index of its longest word)
    for words in long:
        words = words[:CLOZE_WORDS]
        bare = [w.strip(PUNCTUATION) for w in words]
        letters = [len(b) if b.isalpha() else 0 for b in bare]
        best = max(range(1, len(words)), key=lambda i: letters[i])
        if letters[best] >= 5:
            blanks.append((words, bare, best))
    if not blanks:
        return None
    words, bare, i = rng.choice(blanks)
    quoted = " ".join(words[:i] + [words[i].replace(bare[i], "___")] + words[i + 1 :])
    return f'Which word is missing from "{quoted}"? Answer with that word.'


@dataclass(frozen=True)
class PromptSet:
    train: list[TokenizedPrompt]
    held_out: list[TokenizedPrompt]


def make_prompts(
    texts: Sequence[str],
    tokenizer,
    separator: str,
    *,
    chunk_tokens: int,
    chunks_per_prompt: int,
    max_prompt_tokens: int,
    count: int,
    held_out: int,
    seed: int,
    questions: Sequence[str] = (),
    recipe: str = "sentence",
) -> PromptSet:
    """``count`` training and ``held_out`` held-out prompts, each of up to
    ``chunks_per_prompt`` chunks and at most ``max_prompt_tokens`` tokens;
    their questions are ``questions``' or the ``recipe``'s."""
    rng = random.Random(seed)
    chunks = split_chunks(texts, tokenizer, chunk_tokens)
    need = 2 * chunks_per_prompt
    if len(chunks) < need:
        raise DocumentsError(
            f"documents too short: they make {len(chunks)} chunk(s) of {MIN_CHUNK_TOKENS} to {chunk_tokens} tokens, "
            f"and tuning needs at least {need} ({chunks_per_prompt} per prompt, for training and held-out prompts)"
        )
    rng.shuffle(chunks)
    # held-out chunks come from their own share of the text: a fifth, at least a prompt's worth
    cut = max(chunks_per_prompt, len(chunks) // 5)
    held, train = chunks[:cut], chunks[cut:]
    return PromptSet(
        _prompts(train, count, rng, tokenizer, separator, chunks_per_prompt, max_prompt_tokens, questions, recipe),
        _prompts(held, held_out, rng, tokenizer, separator, chunks_per_prompt, max_prompt_tokens, questions, recipe),
    )


def _prompts(
    chunks, count, rng, tokenizer, separator, per_prompt, max_tokens, questions, recipe
) -> list[TokenizedPrompt]:
    out: list[TokenizedPrompt] = []
    tries = 0
    while len(out) < count:
        tries += 1
        if tries > 20 * count + 100:
            raise DocumentsError(
                f"could make only {len(out)} of {count} prompts of at most {max_tokens} tokens: "
                "use shorter chunks (--chunk-tokens), fewer chunks per prompt, or a longer --seq-len"
            )
        picked = rng.sample(chunks, min(per_prompt, len(chunks)))
        question = rng.choice(questions) if questions else recipe_question(rng.choice(picked), rng, recipe)
        if question is None:
            continue
        tp = rag_prompt(picked, question, tokenizer, separator)
        if len(tp) <= max_tokens:
            out.append(tp)
    return out


def squad_prompts(
    tokenizer,
    separator: str,
    *,
    chunks_per_prompt: int,
    max_prompt_tokens: int,
    count: int,
    held_out: int,
    seed: int,
    questions: Sequence[Question] | None = None,
) -> PromptSet:
    """``count`` training and ``held_out`` held-out prompts of SQuAD train's questions (``questions``:
    another list of SQuAD questions), each with the top ``chunks_per_prompt // 2`` to
    ``chunks_per_prompt`` paragraphs BM25 gives it, in BM25's order, asked as ``benchmarks squad`` asks
    them. Paragraphs in the design sample's prompts (``design_contexts``) are left out; a fifth of the
    articles, drawn by ``seed``, give the held-out prompts and no training one."""
    train, held = squad_split(load_squad("train") if questions is None else questions, seed)
    args = (tokenizer, separator, chunks_per_prompt, max_prompt_tokens)
    return PromptSet(_squad(train, count, seed, *args), _squad(held, held_out, seed + 1, *args))


def squad_split(questions: Sequence[Question], seed: int) -> tuple[list[Question], list[Question]]:
    """The questions tuning may ask, as (training, held-out): those whose paragraph is in none of the
    design sample's prompts (``design_contexts``), a fifth of their articles (drawn by ``seed``) held out."""
    reserved = design_contexts(questions)
    usable = [q for q in questions if q.paragraph.context not in reserved]
    articles = sorted({q.paragraph.article for q in usable})
    random.Random(seed).shuffle(articles)
    held_articles = set(articles[: max(1, len(articles) // 5)])
    return (
        [q for q in usable if q.paragraph.article not in held_articles],
        [q for q in usable if q.paragraph.article in held_articles],
    )


def _squad(questions, count, seed, tokenizer, separator, per_prompt, max_tokens) -> list[TokenizedPrompt]:
    chat = bool(getattr(tokenizer, "chat_template", None))
    system = CHAT_SYSTEM if chat else COMPLETION_SYSTEM
    template = RAG_QUESTION if chat else COMPLETION_QUESTION
    # more examples than needed: a prompt over max_tokens is skipped
    examples, _ = retrieval_examples(questions, 2 * count + 10, seed=seed, n_docs=(max(1, per_prompt // 2), per_prompt))
    out = []
    for example in examples:
        tp = rag_prompt(
            example.documents, example.question, tokenizer, separator, system=system, question_template=template
        )
        if len(tp) <= max_tokens:
            out.append(tp)
        if len(out) == count:
            return out
    raise DocumentsError(
        f"could make only {len(out)} of {count} SQuAD prompts of at most {max_tokens} tokens: "
        "use fewer chunks per prompt or a longer --seq-len"
    )
