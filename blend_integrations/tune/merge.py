"""Tuning layer: a LoRA adapter merged into its base model, once.

A tuned model travels as its adapter (``adapter/`` of a tuning's output: a
few MB, peft's format, with ``tuning.json``). ``merged_checkpoint`` merges it
into the base checkpoint the first time it is asked for, in the base's own
dtype, into the user cache (as a GGUF file is converted once), and returns
that directory after: a checkpoint like any other for either engine.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from ..store import model_fingerprint

RECORD = "tuning.json"
DONE = "merged.json"  # written last: a folder without it is an unfinished merge


def adapter_digest(adapter_dir: str | os.PathLike) -> str:
    """SHA-256 over the adapter's files (names and bytes), sorted by name."""
    h = hashlib.sha256()
    for path in sorted(Path(adapter_dir).iterdir()):
        if path.is_file():
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def merge_adapter(base_dir: str | os.PathLike, adapter_dir: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write ``out``: ``base_dir`` with the adapter merged in, in the base's
    dtype, with the base's tokenizer and chat template and the adapter's
    ``tuning.json``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter_dir, out = Path(adapter_dir), Path(out)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{str(adapter_dir)!r} holds no LoRA adapter (adapter_config.json)")
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype="auto")
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(base_dir)).save_pretrained(str(out))
    if (adapter_dir / RECORD).is_file():
        shutil.copy(adapter_dir / RECORD, out / RECORD)
    return out


def merged_checkpoint(
    base_dir: str | os.PathLike, adapter_dir: str | os.PathLike, cache: str | os.PathLike | None = None
) -> Path:
    """The merged checkpoint of ``base_dir`` and the adapter, made the first
    time (into a folder of the cache named for both) and reused after; a
    merge that stopped half-way is never used."""
    key = hashlib.sha256(f"{model_fingerprint(base_dir)}:{adapter_digest(adapter_dir)}".encode()).hexdigest()[:32]
    target = Path(cache) if cache is not None else Path.home() / ".cache" / "blend_integrations" / "tuned"
    done = target / key
    if (done / DONE).is_file():
        return done
    target.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=target))
    try:
        merge_adapter(base_dir, adapter_dir, work)
        (work / DONE).write_text(json.dumps({"base": str(base_dir), "adapter": str(adapter_dir)}) + "\n")
        try:
            work.rename(done)
        except OSError:  # another process merged it first
            if not (done / DONE).is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return done
