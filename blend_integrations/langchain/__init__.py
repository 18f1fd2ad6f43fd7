"""LangChain: ``BlendLLM`` and ``ChatBlend``, drop-in models that keep retrieved documents as chunks.

Chunk boundaries reach the engine without re-tokenizing joined text:

- content blocks: a message whose content is a list of text blocks, where a
  block ``{"type": "text", "text": doc, "chunk": True}`` is a retrieved
  document (``chunk_block(doc)`` makes one);
- ``BLEND_SEPARATOR`` in text (a text prompt, or a message's text): the text
  between two separators is a chunk, tokenized alone. Use it as
  ``document_separator`` or in an LCEL ``format_docs`` (``format_docs`` here
  puts it around every document).
"""

from .chat import BLEND_SEPARATOR, BlendLLM, ChatBlend, chunk_block, format_docs, messages_to_prompt

__all__ = ["BLEND_SEPARATOR", "BlendLLM", "ChatBlend", "chunk_block", "format_docs", "messages_to_prompt"]
