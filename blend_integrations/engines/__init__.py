"""Engines: the transformers reference engine and (later) vLLM."""

from __future__ import annotations

import os

from ..config import BlendConfig
from ..store import ChunkStore
from .base import Engine, Generation, GenerationStream, Usage

BACKENDS = ("transformers", "vllm")


def load_engine(
    model: str | os.PathLike,
    backend: str = "transformers",
    store: ChunkStore | None = None,
    config: BlendConfig | None = None,
    dtype="auto",
    device="auto",
    **engine_kwargs,
) -> Engine:
    """Load ``model`` (a local path or a hub id, one code path) on a backend.

    store: the chunk-KV store; None opens the default persistent store
    (``$BLEND_STORE_PATH`` or ``~/.cache/blend_integrations/chunks``).
    """
    if backend == "transformers":
        from .transformers_engine import TransformersEngine

        return TransformersEngine(model, store=store, config=config, dtype=dtype, device=device, **engine_kwargs)
    if backend == "vllm":
        raise NotImplementedError("the vLLM backend is not available yet; use backend='transformers'")
    raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")


__all__ = ["BACKENDS", "Engine", "Generation", "GenerationStream", "Usage", "load_engine"]
