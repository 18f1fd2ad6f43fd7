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
        # keyed by model, dtype and engine: a record of this model reaches no other engine or model, and
        # serves another floating-point dtype of its own
        fingerprint = good["record"]["fingerprint"]
        store = ChunkStore(tmp_path / "store", remote="")
        assert Calibrations(store, fingerprint, "float32", engine="transformers").packaged() is not None
        assert Calibrations(store, fingerprint, "float32", engine="vllm").packaged() is None
        assert Calibrations(store, fingerprint, "bfloat16", engine="transformers").packaged().record.dtype == "float32"
        other = Calibrations(store, "0" * 64, "float32", engine="transformers")
        assert other.packaged() is None and other.source() == "fallback" and other.choice().ratio == 0.15
        store.close()
    finally:
        packaged_calibrations.cache_clear()


def test_a_calibration_serves_its_model_in_another_dtype_unless_one_measured_in_that_dtype_exists(tmp_path, caplog):
    """The reader's packaged calibration was measured in float32; the order "auto" reads in: the
    store's record, then the packaged one, in the engine's own dtype, then the same in another."""
    fingerprint = model_fingerprint(reader_model_dir())
    packaged = packaged_calibrations()[(fingerprint, "float32", "transformers")]
    store = ChunkStore(tmp_path / "store", remote="")

    def calibrations(dtype: str) -> Calibrations:  # a new one reads the store now, not within RELOAD_S
        return Calibrations(store, fingerprint, dtype, engine="transformers")

    with caplog.at_level(logging.INFO, logger=cal.__name__):
        bf16 = calibrations("bfloat16")
        assert bf16.source() == "packaged" and bf16.record() is packaged.record and bf16.packaged() is packaged
        assert bf16.choice().dtype == "float32" and bf16.choice().ratio == packaged.record.choice().ratio
    assert (
        "no calibration was measured in bfloat16 for this model on the transformers engine; "
        f'"auto" runs the packaged {packaged.path.name}, measured in float32' in caplog.text
    )
    assert "(transformers engine, float32, " in packaged.meaning()  # the meaning names the dtype too

    # the user's own, measured in float32, serves bfloat16 before the packaged one does
    own = dataclasses.replace(packaged.record, ratio=0.5, guard=None, guard_settings=None, model="mine")
    store.put_record(record_name(fingerprint, "float32"), own.to_bytes())
    assert (calibrations("bfloat16").record(), calibrations("bfloat16").choice().dtype) == (own, "float32")
    # the packaged one measured in float32 serves float32 before the user's own measured in bfloat16
    own_bf16 = dataclasses.replace(own, dtype="bfloat16", ratio=0.3)
    store.delete_record(record_name(fingerprint, "float32"))
    store.put_record(record_name(fingerprint, "bfloat16"), own_bf16.to_bytes())
    assert calibrations("float32").source() == "packaged"
    # and one measured in bfloat16 is what bfloat16 runs
    assert (calibrations("bfloat16").record(), calibrations("bfloat16").choice().dtype) == (own_bf16, "bfloat16")
    # a dtype that is not a floating-point one of the same model is never served
    assert calibrations("int8").source() == "fallback"
    store.close()


def test_the_fallback_names_why_no_packaged_calibration_applies(tmp_path, caplog):
    fingerprint = model_fingerprint(reader_model_dir())
    blending = next(
        p.record.fingerprint for p in packaged_calibrations().values() if p.path.name == "smollm2-vllm.json"
    )
    cases = {
        "an unknown checkpoint": (
            Calibrations(ChunkStore(tmp_path / "a", remote=""), "0" * 64, "float32", engine="transformers"),
            "none ships for this checkpoint (fingerprint 000000000000...; the package ships them for ",
        ),
        "another engine": (
            Calibrations(ChunkStore(tmp_path / "b", remote=""), fingerprint, "float32", engine="server"),
            "the package ships one for this checkpoint on the transformers and vllm engine, not on server",
        ),
        "another codec": (  # a blending calibration, a guard from 0.9 (one of full prefill holds under any codec)
            Calibrations(ChunkStore(tmp_path / "c", remote="", kv_codec="fp8"), blending, "float32", engine="vllm"),
            "the packaged smollm2-vllm.json was not shown to hold on this store's fp8 chunks",
        ),
        "a dtype no calibration serves": (
            Calibrations(ChunkStore(tmp_path / "d", remote=""), fingerprint, "int8", engine="transformers"),
            "the packaged reader-transformers.json was measured in float32, which does not serve int8",
        ),
    }
    for case, (calibrations, why) in cases.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=cal.__name__):
            assert calibrations.choice().source == "fallback", case
        assert why in caplog.text, (case, caplog.text)
        assert "blending at the fallback ratio 0.15" in caplog.text and "engine.calibrate(documents)" in caplog.text
        calibrations.store.close()


def test_auto_names_the_dtype_of_the_calibration_it_runs(tmp_path):
    """The reader in bfloat16 runs its float32 packaged calibration; the usage says so."""
    for dtype in ("float32", "bfloat16"):
        engine = load_engine(
            str(reader_model_dir()), store=ChunkStore(tmp_path / dtype, remote=""), device="cpu", dtype=dtype
        )
        gen = engine.generate(reader_prompt(engine), max_tokens=2)
        assert engine.calibration_source() == "packaged" and gen.usage.ratio_source in ("packaged", "guard")
        assert gen.usage.calibration_dtype == "float32" and gen.stats()["calibration_dtype"] == "float32"
        full = engine.generate(reader_prompt(engine), max_tokens=2, mode="full")
        assert full.usage.calibration_dtype is None
        engine.store.close()
