"""Models layer: a LoRA adapter merged into its base model, once.

A tuned model travels as its adapter (``adapter/`` of a tuning's output,
``python -m blend_integrations.tune``: peft's format, with ``tuning.json``).
``merged_checkpoint`` merges it into the base checkpoint the first time it is
asked for, in the base's own dtype, into the user cache (as a GGUF file is
converted once), and returns that directory after: a checkpoint like any
other for either engine. ``pack_adapter`` writes an adapter in bfloat16
(half the bytes), as a package would ship one.

The merge gives the same bytes on every machine, so the merged checkpoint's
fingerprint, and the chunks and packaged calibrations keyed by it, hold
everywhere: each adapted layer is merged in float64, where the products of
bfloat16 factors and their sums over the rank are exact whatever order a
CPU's kernels add them in, and the merged checkpoint keeps the base's own
``config.json``.
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
WEIGHTS = "adapter_model.safetensors"


def adapter_digest(adapter_dir: str | os.PathLike) -> str:
    """SHA-256 over the adapter's files (names and bytes), sorted by name."""
    h = hashlib.sha256()
    for path in sorted(Path(adapter_dir).iterdir()):
        if path.is_file():
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _check_adapter(adapter_dir: Path) -> None:
    if not (adapter_dir / "adapter_config.json").is_file() or not (adapter_dir / WEIGHTS).is_file():
        raise FileNotFoundError(f"{str(adapter_dir)!r} holds no LoRA adapter (adapter_config.json and {WEIGHTS})")


def merge_adapter(base_dir: str | os.PathLike, adapter_dir: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write ``out``: ``base_dir`` with the adapter merged in, in the base's
    dtype, with the base's config, tokenizer and chat template and the
    adapter's ``tuning.json``."""
    import torch
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTunerLayer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_dir, adapter_dir, out = Path(base_dir), Path(adapter_dir), Path(out)
    _check_adapter(adapter_dir)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype="auto")
    dtype = base.dtype
    model = PeftModel.from_pretrained(base, str(adapter_dir))
    for module in model.modules():  # one layer at a time in float64 (see the module's docstring)
        if isinstance(module, BaseTunerLayer):
            module.to(torch.float64)  # type: ignore[attr-defined]  # a tuner layer is a torch module too
            module.merge()
            module.to(dtype)  # type: ignore[attr-defined]
    merged = model.unload()
    merged.save_pretrained(str(out))
    shutil.copy(base_dir / "config.json", out / "config.json")
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
    _check_adapter(Path(adapter_dir))
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
        for f in work.iterdir():  # readable by every user of a shared cache, as the model cache is
            f.chmod(0o644)
        work.chmod(0o755)
        try:
            work.rename(done)
        except OSError:  # another process merged it first
            if not (done / DONE).is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return done


def pack_adapter(adapter_dir: str | os.PathLike, out: str | os.PathLike, *, base_model: str | None = None) -> Path:
    """Write ``out``: the adapter with its weights in bfloat16 and its
    config and ``tuning.json``, both naming ``base_model`` as the base where
    given (a name, not a path on the machine that tuned it)."""
    import torch
    from safetensors.torch import load_file, save_file

    adapter_dir, out = Path(adapter_dir), Path(out)
    _check_adapter(adapter_dir)
    if out.exists():
        raise FileExistsError(f"{str(out)!r} exists: pack the adapter into a new folder")
    tensors = load_file(str(adapter_dir / WEIGHTS))
    out.mkdir(parents=True)
    save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()}, str(out / WEIGHTS))
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    if base_model is not None:
        config["base_model_name_or_path"] = base_model
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if (adapter_dir / RECORD).is_file():
        record = json.loads((adapter_dir / RECORD).read_text())
        if base_model is not None:
            record["base_model"] = base_model
        (out / RECORD).write_text(json.dumps(record, indent=1) + "\n")
    return out
