"""Models layer: GGUF checkpoints (llama.cpp's format) as model inputs.

A ``.gguf`` file (or a directory holding one) is dequantized once into a
safetensors checkpoint (float32 unless asked otherwise) with its tokenizer and chat template, in the
user cache under the file's SHA-256. Every engine, the server and the chunk
keys then read that one directory, so they all see the same weights. Needs
the ``gguf`` extra (the ``gguf`` and ``accelerate`` packages, which
transformers' GGUF loader uses).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from ..wheels import sha256_file
from .hf import check_supported

MAGIC = b"GGUF"
CACHE = Path.home() / ".cache" / "blend_integrations" / "gguf"
DONE = "blend-gguf.json"  # written last: a directory without it is an unfinished conversion


class GGUFError(ValueError):
    """A GGUF file that cannot be read or converted."""


def gguf_file(path: str | os.PathLike) -> Path | None:
    """The GGUF file that ``path`` names: the file itself, or the one ``.gguf``
    file of a directory without a ``config.json``; None for anything else."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            raise GGUFError(
                f"{str(path)!r} holds {len(found)} GGUF files ({', '.join(p.name for p in found)}); "
                "pass the path of the one to load"
            )
        return found[0] if found else None
    return None


def _check_header(path: Path) -> None:
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8 or head[:4] != MAGIC:
        raise GGUFError(f"{str(path)!r} is not a GGUF file: it does not start with {MAGIC!r} (got {head[:4]!r})")


# The dtypes a conversion may write: float32 holds the dequantized weights exactly; bfloat16, the
# upstream dtype of most larger models, rounds them and halves a 1.5B model's 6.2 GB. Both engines
# load either on a CPU.
CONVERSION_DTYPES = ("float32", "bfloat16")


def converted_dir(path: str | os.PathLike, *, cache: str | os.PathLike | None = None, dtype: str = "float32") -> Path:
    """The safetensors checkpoint of the GGUF file at ``path`` in ``dtype``,
    converting it the first time; later calls (any process) reuse the conversion. Raises
    ``GGUFError`` for a file that is not a readable GGUF, and
    ``UnsupportedModelError`` for an architecture without a blend adapter,
    before any dequantizing."""
    if dtype not in CONVERSION_DTYPES:
        raise ValueError(f"a GGUF conversion writes one of {', '.join(CONVERSION_DTYPES)}, not {dtype!r:.40}")
    source = gguf_file(path)
    if source is None:
        raise GGUFError(f"{str(path)!r} is not a .gguf file nor a directory holding one")
    _check_header(source)
    digest = sha256_file(source)
    out = Path(cache or CACHE) / (digest[:32] if dtype == "float32" else f"{digest[:32]}-{dtype}")
    if (out / DONE).is_file():
        return out
    try:
        import accelerate  # noqa: F401
        import gguf  # noqa: F401 - transformers' loader needs it; say which extra to install
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ImportError(
            f"loading a GGUF checkpoint needs the gguf extra: pip install 'blend_integrations[gguf]' ({exc})"
        ) from exc
    folder, name = str(source.parent), source.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except Exception as exc:  # truncated or damaged metadata, an unknown architecture
        raise GGUFError(f"{str(source)!r} is not a readable GGUF checkpoint: {type(exc).__name__}: {exc}") from exc
    check_supported(config)
    import torch

    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        try:
            # the config read above: transformers parses the whole file's metadata on every read
            # (some 16 s for a 151k-token vocabulary), so one read fewer is a quarter of the time
            model = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=name, config=config, dtype=getattr(torch, dtype)
            )
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        except Exception as exc:  # truncated or damaged tensor data
            raise GGUFError(f"{str(source)!r} is not a readable GGUF checkpoint: {type(exc).__name__}: {exc}") from exc
        # transformers' GGUF tokenizer drops the file's "add BOS" flag (Gemma's needs its BOS).
        if _metadata_flag(source, "tokenizer.ggml.add_bos_token") and tokenizer.bos_token_id is not None:
            tokenizer.add_bos_token = True
        # A GGUF load leaves a quantizer that refuses to save; the weights are plain tensors now.
        model.hf_quantizer = None
        for holder in (model.config, getattr(model.config, "text_config", None)):
            if holder is not None and hasattr(holder, "quantization_config"):
                delattr(holder, "quantization_config")
        model.save_pretrained(work)
        tokenizer.save_pretrained(work)
        (work / DONE).write_text(
            json.dumps({"gguf": name, "sha256": digest, "bytes": source.stat().st_size, "dtype": dtype}) + "\n"
        )
        for f in work.iterdir():  # readable by every user of a shared cache, as the model cache is
            f.chmod(0o644)
        work.chmod(0o755)
        try:
            work.rename(out)
        except OSError:  # another process finished first: use its conversion
            if not (out / DONE).is_file():
                shutil.rmtree(out, ignore_errors=True)
                work.rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


# GGUF metadata value types -> size in bytes (8: string, 9: array)
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _metadata_flag(path: Path, key: str) -> bool:
    """A boolean from the GGUF file's metadata header (False where it is
    absent), read by skipping over the other entries: gguf's own reader maps
    every tensor first, which takes ~25 s on a 250 MB file."""
    import struct

    def skip(f, kind: int) -> None:
        if kind == 8:
            f.seek(struct.unpack("<Q", f.read(8))[0], 1)
        elif kind == 9:
            inner, count = struct.unpack("<IQ", f.read(12))
            if inner in _SIZES:
                f.seek(_SIZES[inner] * count, 1)
            else:
                for _ in range(count):
                    skip(f, inner)
        elif kind in _SIZES:
            f.seek(_SIZES[kind], 1)
        else:
            raise GGUFError(f"{str(path)!r} has metadata of unknown type {kind}")

    try:
        with open(path, "rb") as f:
            _, _, _, entries = struct.unpack("<4sIQQ", f.read(24))
            for _ in range(entries):
                (length,) = struct.unpack("<Q", f.read(8))
                if length > 1 << 16:  # a damaged length must not make us read the whole file as a key
                    raise GGUFError(f"{str(path)!r} has a metadata key of {length} bytes: its header is damaged")
                name = f.read(length).decode("utf-8", "replace")
                (kind,) = struct.unpack("<I", f.read(4))
                if name == key:
                    return kind == 7 and f.read(1) != b"\x00"
                skip(f, kind)
    except struct.error as exc:
        raise GGUFError(f"{str(path)!r} has a truncated metadata header") from exc
    return False
