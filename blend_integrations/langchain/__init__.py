"""Integrations layer for LangChain: ``BlendLLM`` and ``ChatBlend``, drop-in
models that keep retrieved documents as chunks.

Chunk boundaries reach the engine without re-tokenizing joined text:

- content blocks: a message whose content is a list of text blocks, where a
  block ``{"type": "text", "text": doc, "chunk": True}`` is a retrieved
  document (``chunk_block(doc)`` makes one);
- ``BLEND_SEPARATOR`` in text (a text prompt, or a message's text): the text
  between two separators is a chunk, tokenized alone. Use it as
  ``document_separator`` or in an LCEL ``format_docs`` (``format_docs`` here
  puts it around every document);
- ``create_blend_rag_chain(retriever, llm)``: retrieved ``Document``s go to the
  model as chunk blocks directly.

``BlendCacheWarmer`` computes chunk KV at ingestion, so first queries hit.
``ChatBlend.bind_tools`` works for chat templates that render tools (the
formats are in ``blend_integrations.tool_calls``).
"""

from ..chat import BLEND_SEPARATOR
from .chat import BlendLLM, ChatBlend, chunk_block, format_docs, messages_to_prompt
from .rag import BlendCacheWarmer, create_blend_rag_chain

__all__ = [
    "BLEND_SEPARATOR",
    "BlendCacheWarmer",
    "BlendLLM",
    "ChatBlend",
    "chunk_block",
    "create_blend_rag_chain",
    "format_docs",
    "messages_to_prompt",
]
