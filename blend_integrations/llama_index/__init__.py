"""Integrations layer for LlamaIndex: ``BlendLLM``, a synthesizer that keeps
every retrieved node its own chunk, a query engine built on it, and an
ingestion step that warms chunk KV.

LlamaIndex's stock response modes repack node texts into new strings, which
loses chunk identity; ``BlendSynthesizer`` (and ``as_blend_query_engine``)
hand each node's text to the engine as one chunk instead. ``BlendLLM`` also
works as a plain LLM for the stock modes. ``BlendCacheWarmer`` (formerly
``BlendKVWarmup``, still there, deprecated) warms chunk KV at ingestion.
"""

from .llm import BlendLLM
from .rag import BlendCacheWarmer, BlendKVWarmup, BlendSynthesizer, as_blend_query_engine

__all__ = ["BlendCacheWarmer", "BlendKVWarmup", "BlendLLM", "BlendSynthesizer", "as_blend_query_engine"]
