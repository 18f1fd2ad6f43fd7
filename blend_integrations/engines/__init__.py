"""Engines layer: the transformers reference engine and the embedded vLLM engine."""

from __future__ import annotations

import os

from ..config import BlendConfig
from ..store import ChunkStore
from .base import Engine, Generation, GenerationStream, Usage

BACKENDS = ("transformers", "vllm", "server")


def load_engine(
    model: str | os.PathLike,
    backend: str = "transformers",
    store: ChunkStore | None = None,
    config: BlendConfig | None = None,
    dtype="auto",
    device="auto",
    **engine_kwargs,
) -> Engine:
    """Load ``model`` (a local path or a hub id, one code path) on a backend:
    "transformers" (in-process reference), "vllm" (embedded vLLM) or "server"
    (``model`` is the URL of a ``python -m blend_integrations.serve`` server).

    store: the chunk-KV store; None opens the default persistent store
    (``$BLEND_STORE_PATH`` or ``~/.cache/blend_integrations/chunks``).
    engine_kwargs: backend options; for "vllm" ``max_model_len``,
    ``kv_cache_gib`` (CPU KV cache size), ``max_num_seqs`` and any ``vllm.LLM``
    argument. A script that uses the vLLM backend needs an
    ``if __name__ == "__main__":`` guard (vLLM starts processes).
    """
    if backend == "transformers":
        from .transformers_engine import TransformersEngine

        return TransformersEngine(model, store=store, config=config, dtype=dtype, device=device, **engine_kwargs)
    if backend == "vllm":
        from .vllm_engine import VLLMEngine

        return VLLMEngine(model, store=store, config=config, dtype=dtype, device=device, **engine_kwargs)
    if backend == "server":
        from .server_engine import ServerEngine

        if store is not None:
            raise ValueError("a server engine uses the server's chunk store; start the server with --store instead")
        return ServerEngine(str(model), config=config, **engine_kwargs)
    raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")


__all__ = ["BACKENDS", "Engine", "Generation", "GenerationStream", "Usage", "load_engine"]
