"""The calibrations the package ships (blend_integrations/data/calibrations/): one per shipped
model and engine, keyed by the checkpoint this machine makes, used by ``recompute_ratio="auto"``
until the user calibrates, and refused when damaged; on the real bundled reader and real stores."""

from __future__ import annotations

import dataclasses
import json
import logging
import time

import pytest

from blend_integrations import BlendPrompt, ChunkStore, load_engine
from blend_integrations import calibration as cal
from blend_integrations.calibration import (
    PACKAGED_DIR,
    RELOAD_S,
    Calibrations,
    PackagedCalibration,
    packaged_calibrations,
    record_name,
)
from blend_integrations.integration import warm
from blend_integrations.quality import reader_model_dir
from blend_integrations.store.keys import model_fingerprint
from training.data import make_examples

SHIPPED_MODELS = ("reader", "smollm2", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
SHIPPED = {f"{m}-{e}.json" for m in SHIPPED_MODELS for e in ("transformers", "vllm")}


@pytest.fixture
def reader(tmp_path):
    """The bundled reader on the transformers engine, on a store of this test alone."""
    engine = load_engine(str(reader_model_dir()), store=ChunkStore(tmp_path / "store", remote=""), device="cpu")
    yield engine
    engine.store.close()


def reader_prompt(engine, seed: int = 7) -> BlendPrompt:
    example = make_examples(1, seed=seed)[0]
    return BlendPrompt("", example.documents, f"\n{example.question}")


def test_a_calibration_ships_for_every_shipped_model_on_each_engine_and_fits_this_machine_s_checkpoints(
    smollm2_gguf, gemma3_gguf, qwen05_gguf
):
    from blend_integrations.models.packaged import MODELS

    files = {p.name: PackagedCalibration.from_bytes(p.read_bytes(), p) for p in PACKAGED_DIR.glob("*.json")}
    assert set(files) == SHIPPED
    # the packaged models' checkpoints (the 1.5B model is the demo's: `make install` fetched it)
    checkpoints = {"reader": reader_model_dir(), **{m: MODELS[m].checkpoint() for m in SHIPPED_MODELS[1:]}}
    for name, packaged in files.items():
        model, engine = name.removesuffix(".json").rsplit("-", 1)
        record = packaged.record
        # keyed by the checkpoint a fresh install makes here, or "auto" would never find it
        assert record.fingerprint == model_fingerprint(checkpoints[model]), name
        # measured in the dtype "auto" gives the checkpoint on a CPU with bfloat16 instructions
        dtype = MODELS[model].dtype if model in MODELS else "float32"
        assert (record.engine, record.dtype, record.target, record.tokens) == (engine, dtype, 0.95, 4), name
        assert packaged.held_out["questions"] >= 60 and "x sooner" in packaged.meaning()
    assert len(packaged_calibrations()) == len(SHIPPED)


def test_auto_uses_the_packaged_calibration_until_the_user_calibrates(reader):
    packaged = reader.calibrations.packaged()
    assert packaged is not None and packaged.path.name == "reader-transformers.json"
    assert reader.calibration_source() == "packaged" and reader.calibration() == packaged.record
    assert reader.calibration_meaning() == packaged.meaning()
    choice = packaged.record.choice()
    gen = reader.generate(reader_prompt(reader), max_tokens=2)
    assert gen.usage.ratio_source == ("packaged" if choice.guard is None else gen.usage.ratio_source)
    if gen.usage.ratio_source == "packaged":
        assert gen.usage.recompute_ratio == choice.ratio

    # the user's own calibration, written by any process on the store, replaces it
    own = dataclasses.replace(packaged.record, ratio=0.5, guard=None, guard_settings=None, model="mine")
    reader.store.put_record(record_name(reader.fingerprint, reader.dtype_name), own.to_bytes())
    time.sleep(RELOAD_S + 0.1)
    assert reader.calibration_source() == "calibrated" and reader.calibration() == own
    gen = reader.generate(reader_prompt(reader), max_tokens=2)
    assert (gen.usage.ratio_source, gen.usage.recompute_ratio) == ("calibrated", 0.5)


def test_the_warmer_calibrates_where_only_a_packaged_calibration_exists(reader):
    documents = sorted({d for e in make_examples(8, seed=11) for d in e.documents})
    options = {"num_prompts": 4, "ratios": (0.5,), "variants": [], "min_speedup": 0.01}
    warm(reader, documents, False, calibrate=True, **options)
    record = reader.calibration()
    assert reader.calibration_source() == "calibrated" and record.n == 4 and record.model != "the bundled reader"
    warm(reader, documents, False, calibrate=True, **options)  # the user's own is there now: not again
    assert reader.calibration() == record


def test_damaged_foreign_and_unknown_packaged_files_are_refused(tmp_path, monkeypatch, caplog):
    good = json.loads((PACKAGED_DIR / "reader-transformers.json").read_text())

    def changed(path: str, value) -> dict:
        data = json.loads(json.dumps(good))
        *parents, last = path.split(".")
        holder = data
        for key in parents:
            holder = holder[key]
        holder[last] = value
        return data

    files = {
        "reader-transformers.json": good,
        "not-json.json": "{",
        "other-kind.json": changed("kind", "blend-calibration"),
        "newer.json": changed("version", 99),
        "bad-ratio.json": changed("record.ratio", 3.0),
        "bad-held-out.json": changed("held_out.fallback.agreement", "most"),
        "no-held-out.json": changed("held_out", None),
    }
    for name, data in files.items():
        (tmp_path / name).write_text(data if isinstance(data, str) else json.dumps(data))
    monkeypatch.setattr(cal.packaged, "PACKAGED_DIR", tmp_path)
    packaged_calibrations.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cal.__name__):
            found = packaged_calibrations()
        assert [p.path.name for p in found.values()] == ["reader-transformers.json"]
        for name in set(files) - {"reader-transformers.json"}:
            assert f"the packaged calibration {name} is refused" in caplog.text, name
        # keyed by model, dtype and engine: a record of this model reaches no other engine, dtype or model
        fingerprint = good["record"]["fingerprint"]
        store = ChunkStore(tmp_path / "store", remote="")
        assert Calibrations(store, fingerprint, "float32", engine="transformers").packaged() is not None
        assert Calibrations(store, fingerprint, "float32", engine="vllm").packaged() is None
        assert Calibrations(store, fingerprint, "bfloat16", engine="transformers").packaged() is None
        other = Calibrations(store, "0" * 64, "float32", engine="transformers")
        assert other.packaged() is None and other.source() == "fallback" and other.choice().ratio == 0.15
        store.close()
    finally:
        packaged_calibrations.cache_clear()
