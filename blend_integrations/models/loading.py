"""Models layer: where a model's checkpoint is, and the dtype and device it
runs in. One resolution for every engine, the server and the chunk keys."""

from __future__ import annotations

import os

import torch

from .gguf import converted_dir, gguf_file

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def resolve_device(device: str | torch.device) -> torch.device:
    """ "auto": CUDA where torch sees a GPU, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or a torch device, got {device!r}") from exc


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """ "auto": bfloat16 on CUDA, float32 on the CPU (CPU bf16 matmuls are slow)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """The name chunk keys and vLLM use: "float32", not "torch.float32"."""
    return str(dtype).removeprefix("torch.")
