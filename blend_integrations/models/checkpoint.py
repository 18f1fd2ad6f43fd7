"""Where a model's checkpoint is: one resolution for every engine, the server and the chunk keys."""

from __future__ import annotations

import os

from .gguf import converted_dir, gguf_file


def resolve_model_dir(model: str | os.PathLike) -> str:
    """A local checkpoint directory for ``model``: a checkpoint directory as
    it is; a ``.gguf`` file (or a directory holding one) dequantized once into
    the user cache (``models/gguf.py``); otherwise a hub id, from the local hub
    cache or downloaded if allowed. One loading path for all of them."""
    if gguf_file(model) is not None:
        return str(converted_dir(model))
    if os.path.isdir(model):
        return str(model)
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id=str(model))
    except Exception as exc:  # hub unreachable, unknown repo, offline and not cached
        raise FileNotFoundError(
            f"model {model!r} is neither a local directory nor a hub id that can be resolved: {exc}"
        ) from exc
