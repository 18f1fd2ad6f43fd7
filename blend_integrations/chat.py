"""Prompt layer: chat prompts with chunks, conversations rendered through the model's own chat
template while every chunk stays a separate, alone-tokenized part. The LangChain
and LlamaIndex adapters turn their message types into the turns used here."""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence

from .prompt import Part, TokenizedPrompt, tokenize_parts

# Marks chunk boundaries in text. Pieces between two separators are chunks;
# the separator itself is replaced by the engine's separator tokens.
BLEND_SEPARATOR = "\n<blend-chunk/>\n"

# The RAG layout (``rag_prompt``): its default instruction, and the line that
# asks the question after the documents. The reader model was trained with both.
RAG_SYSTEM_PROMPT = "Answer the question using only the documents. Reply with the answer only."
RAG_QUESTION = "Question: {question}"


def split_text(text: str) -> list[Part]:
    """Text with BLEND_SEPARATOR: the pieces between separators are chunks."""
    pieces = text.split(BLEND_SEPARATOR)
    if len(pieces) < 3:
        return [Part(text.replace(BLEND_SEPARATOR, ""))]
    return [Part(pieces[0])] + [Part(p, chunk=True) for p in pieces[1:-1] if p.strip()] + [Part(pieces[-1])]


def separated(texts: Sequence[str]) -> str:
    """Texts as chunks in one string: BLEND_SEPARATOR around every one."""
    return BLEND_SEPARATOR + BLEND_SEPARATOR.join(texts) + BLEND_SEPARATOR if texts else ""


def render_chat(
    turns: Sequence[dict], tokenizer, separator: str, *, tools: list[dict] | None = None, reply_prefix: str = ""
) -> TokenizedPrompt:
    """Render ``turns`` (template message dicts whose ``content`` is a list of
    ``Part``) through the tokenizer's chat template. Chunks stand in the
    template as unique placeholders, the rendered text is split around them,
    and each piece is tokenized alone; the parts of one turn are joined with
    ``separator``. ``tools``: OpenAI-style tool schemas for the template;
    ``reply_prefix``: text the assistant's reply starts with."""
    nonce = secrets.token_hex(4)
    chunks: list[str] = []
    conversation = []
    # where the question ends: after the text that closes the conversation's last turn, a user's
    end_marker = f"<<blend-{nonce}-question-end>>"
    for n, turn in enumerate(turns):
        texts = []
        for part in turn["content"]:
            if part.chunk:
                texts.append(f"<<blend-{nonce}-{len(chunks)}>>")
                chunks.append(part.content)
            elif part.content:
                texts.append(part.content)
        asks = n == len(turns) - 1 and turn.get("role") == "user" and turn["content"] and not turn["content"][-1].chunk
        if asks and texts:
            texts[-1] += end_marker
        conversation.append({**turn, "content": separator.join(texts)})
    rendered = tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False, add_generation_prompt=True)
    pieces = re.split(rf"<<blend-{nonce}-(\d+)>>", rendered + reply_prefix)
    parts = [_text_part(pieces[0], end_marker)]
    for i in range(1, len(pieces), 2):
        parts += [Part(chunks[int(pieces[i])], chunk=True), _text_part(pieces[i + 1], end_marker)]
    return tokenize_parts([p for p in parts if p.chunk or p.content], tokenizer)


def _text_part(text: str, end_marker: str) -> Part:
    """A rendered piece between chunks, with where the question ends in it when it does."""
    at = text.find(end_marker)
    if at < 0:
        return Part(text)
    return Part(text.replace(end_marker, ""), question_end=at)


def text_prompt(text: str, tokenizer) -> TokenizedPrompt | str:
    """A completion prompt: BLEND_SEPARATOR pieces become chunks; plain text stays text."""
    parts = split_text(text)
    return tokenize_parts(parts, tokenizer) if len(parts) > 1 else text


def rag_prompt(
    documents: Sequence[str],
    question: str,
    tokenizer,
    separator: str,
    *,
    system: str | None = RAG_SYSTEM_PROMPT,
    question_template: str = RAG_QUESTION,
) -> TokenizedPrompt:
    """A retrieval question through the model's chat template: a system turn,
    then a user turn with every document a chunk and the question
    (``question_template``, ``"Question: {question}"``) last. The layout the
    reader model was trained on, and the one the LangChain chain and the
    LlamaIndex synthesizer build. A tokenizer without a chat template gets the
    same pieces as plain text: the system prompt and a blank line, the
    documents, the question."""
    parts = [Part(d, chunk=True) for d in documents] + [Part(question_template.format(question=question))]
    if not getattr(tokenizer, "chat_template", None):
        return tokenize_parts(([Part(system + "\n\n")] if system else []) + parts, tokenizer)
    turns = [{"role": "system", "content": [Part(system)]}] if system else []
    turns.append({"role": "user", "content": parts})
    return render_chat(turns, tokenizer, separator)
