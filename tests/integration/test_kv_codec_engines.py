"""Coded chunk stores (``ChunkStore(kv_codec=...)``) under the real engines:
a fraction of the raw store's bytes, blending from them, ratio 1.0 still full
prefill, and calibrations kept per codec."""

from __future__ import annotations

import pytest

from blend_integrations import BlendConfig, BlendPrompt, ChunkStore, load_engine
from blend_integrations.calibration import Calibrations, packaged_calibrations, record_name
from blend_integrations.store.codec import CodedKV
from tests.fixtures.exactness import exact_at_ratio_one

QUESTION = "Question: which city is named in the documents? Answer:"


def stored_bytes(engine, docs, codec) -> int:
    """Bytes the store's disk tier keeps for ``docs``' chunks in ``codec``."""
    disk = ChunkStore(engine.store.path, memory_limit_bytes=0, remote="", kv_codec=codec)
    keys = [engine.chunk_key(engine.tokenizer.encode(d, add_special_tokens=False)) for d in docs]
    located = [disk.locate(k) for k in keys]
    assert all(where.tier == "disk" for where in located)
    return sum(where.nbytes for where in located)


@pytest.fixture(scope="module")
def raw_engine(model_dirs, tmp_path_factory):
    return load_engine(model_dirs("llama"), store=ChunkStore(tmp_path_factory.mktemp("raw")), device="cpu")


# How far a codec's stored-and-decoded KV may be from the raw KV (relative, over a chunk's K and V):
# measured at most 0.026 (fp8) and 0.0058 (int8) over 260 sets of documents on the llama test
# model; a decoder whose scales are 10% off gives 0.1.
KV_ERROR_BOUND = {"fp8": 0.04, "int8": 0.015}
# The share of what reusing KV itself moves the first token's log-probabilities from full
# prefill that the codec may add, per mode. Measured over 260 sets of documents: "reuse" (every
# reused token as decoded) at most 0.12 (fp8) and 0.03 (int8), and a decoder whose scales are 10%
# off gives 0.25 or more, zeros or doubled scales 1.6 or more. "blend" at most 0.45: the codec's
# error can move a token's deviation past another's, and blending then recomputes another token.
LOGPROB_SHARE_BOUND = {"reuse": 0.2, "blend": 0.6}
TOP_LOGPROBS = 20


def logprob_gap(a, b) -> float:
    """The largest difference between two one-token generations' log-probabilities
    of the tokens both list (``logprobs=TOP_LOGPROBS``)."""
    [la], [lb] = a.logprobs, b.logprobs
    shared = la.keys() & lb.keys()
    assert len(shared) >= TOP_LOGPROBS // 2  # near-identical distributions share most of their top tokens
    return max(abs(la[t] - lb[t]) for t in shared)


@pytest.mark.parametrize("codec", ["fp8", "int8"])
def test_transformers_engine_blends_from_a_coded_store(model_dirs, tmp_path, raw_engine, docs, codec):
    engine = load_engine(model_dirs("llama"), store=ChunkStore(tmp_path, kv_codec=codec), device="cpu")
    assert engine.kv_codec == codec
    assert engine.warm(docs) == len(docs) and raw_engine.warm(docs) == len(docs)
    assert stored_bytes(engine, docs, codec) <= 0.3 * stored_bytes(raw_engine, docs, None)

    # what the store decodes (as the walk does, layer by layer) is the raw KV within the codec's error
    for doc in docs:
        ids = engine.tokenizer.encode(doc, add_special_tokens=False)
        coded_entry = engine.store.get(engine.chunk_key(ids))
        assert coded_entry is not None and isinstance(coded_entry.kv, CodedKV) and coded_entry.codec == codec
        raw_kv = raw_engine.store.get(raw_engine.chunk_key(ids)).values().float()
        error = float((coded_entry.values().float() - raw_kv).norm() / raw_kv.norm())
        assert error < KV_ERROR_BOUND[codec], f"{codec} decodes with relative error {error:.4f}"

    prompt = BlendPrompt("Read.", docs[::-1], QUESTION)
    exact_at_ratio_one(engine, prompt, len(docs))  # nothing read is used at ratio 1.0
    full = raw_engine.generate(prompt, max_tokens=1, mode="full", logprobs=TOP_LOGPROBS)
    for mode in ("reuse", "blend"):
        options = {"mode": mode, "max_tokens": 1, "logprobs": TOP_LOGPROBS}
        if mode == "blend":
            options["recompute_ratio"] = 0.15
        coded, raw = engine.generate(prompt, **options), raw_engine.generate(prompt, **options)
        assert coded.usage.chunks_hit == raw.usage.chunks_hit == len(docs)
        assert coded.usage.recomputed_tokens == raw.usage.recomputed_tokens
        assert (raw.usage.recomputed_tokens > 0) == (mode == "blend")
        # Log-probabilities the codec moves far less than reusing KV moves them: a decoding error
        # as large as reuse's own would pass an absolute tolerance. (Not the chosen token: on this
        # random model the top two can be near-tied, and fp8 flipped them in 3 of 260 sets.)
        moved, coded_error = logprob_gap(raw, full), logprob_gap(coded, raw)
        assert moved > 0.01  # reuse's own move is measurable on this model
        assert coded_error < LOGPROB_SHARE_BOUND[mode] * moved, (mode, coded_error, moved)

    # another process with the raw codec finds none of them: its own chunks only
    other = load_engine(model_dirs("llama"), store=ChunkStore(tmp_path), device="cpu")
    assert other.generate(prompt, max_tokens=1).usage.chunks_hit == 0


def test_the_config_s_codec_must_be_the_store_s(model_dirs, tmp_path):
    with pytest.raises(ValueError, match=r"BlendConfig\(kv_codec='fp8'\), but the store given keeps chunks as None"):
        load_engine(model_dirs("llama"), store=ChunkStore(tmp_path), config=BlendConfig(kv_codec="fp8"), device="cpu")


def test_vllm_engine_blends_from_a_coded_store(model_dirs, tmp_path, docs):
    store = ChunkStore(tmp_path, remote="", kv_codec="int8")
    engine = load_engine(
        model_dirs("llama"),
        backend="vllm",
        store=store,
        config=BlendConfig(kv_codec="int8"),
        max_model_len=2048,
        kv_cache_gib=1,
    )
    try:
        assert engine.warm(docs) == len(docs)  # computed and stored by vLLM's worker, in int8
        prompt = BlendPrompt("Read.", docs[::-1], QUESTION)
        exact_at_ratio_one(engine, prompt, len(docs))
        g = engine.generate(prompt, max_tokens=4, recompute_ratio=0.15)
        assert g.usage.chunks_hit == len(docs) and g.usage.recomputed_tokens > 0
    finally:
        engine.close()
    # the worker's entries are int8 ones: the transformers engine on an int8 store reads them all
    reader = load_engine(model_dirs("llama"), store=ChunkStore(tmp_path, kv_codec="int8"), device="cpu")
    assert reader.generate(prompt, max_tokens=1).usage.chunks_hit == len(docs)
    raw = ChunkStore(tmp_path, remote="", memory_limit_bytes=0)
    assert all(
        raw.locate(reader.chunk_key(reader.tokenizer.encode(d, add_special_tokens=False))).tier is None for d in docs
    )


def test_calibrations_are_kept_per_codec(tmp_path, monkeypatch):
    """A calibration holds under the codec it was measured under: the one
    this package ships (measured raw) is not used for an int8 store unless it
    names int8 among the codecs shown to choose the same, or it chose full
    prefill (run as full prefill, it reads no stored KV)."""
    import json

    from blend_integrations.calibration import packaged as packaged_module

    shipped = packaged_calibrations()
    (fingerprint, dtype, engine), packaged = next(
        (k, p) for k, p in shipped.items() if not p.record.holds_under("int8")
    )
    assert packaged.record.ratio < 1.0 or packaged.record.guard is not None  # it blends
    raw = Calibrations(ChunkStore(tmp_path), fingerprint, dtype, engine=engine)
    coded = Calibrations(ChunkStore(tmp_path, kv_codec="int8"), fingerprint, dtype, engine=engine)
    assert raw.source() == "packaged"
    assert coded.name == record_name(fingerprint, dtype, "int8") != raw.name
    assert packaged.record.kv_codec is None and coded.source() == "fallback"
    # one that chose full prefill is used under every codec
    (fingerprint2, dtype2, engine2), full = next(
        (k, p) for k, p in shipped.items() if p.record.ratio >= 1.0 and p.record.guard is None
    )
    assert not full.record.codecs_checked
    in_full = Calibrations(ChunkStore(tmp_path / "full", kv_codec="fp8"), fingerprint2, dtype2, engine=engine2)
    assert in_full.source() == "packaged"
    # a blending one whose int8 store was shown to choose the same is used there, and under no other codec
    shipped_file = json.loads(packaged.path.read_bytes())
    shipped_file["record"]["codecs_checked"] = ["int8"]
    (tmp_path / "shipped").mkdir()
    (tmp_path / "shipped" / packaged.path.name).write_text(json.dumps(shipped_file))
    monkeypatch.setattr(packaged_module, "PACKAGED_DIR", tmp_path / "shipped")
    packaged_calibrations.cache_clear()
    try:
        checked = Calibrations(ChunkStore(tmp_path / "checked", kv_codec="int8"), fingerprint, dtype, engine=engine)
        assert checked.source() == "packaged"
        other = Calibrations(ChunkStore(tmp_path / "other", kv_codec="fp8"), fingerprint, dtype, engine=engine)
        assert other.source() == "fallback"
    finally:
        monkeypatch.undo()
        packaged_calibrations.cache_clear()

    import dataclasses

    mine = dataclasses.replace(packaged.record, kv_codec="int8", ratio=0.5)
    coded.store.put_record(coded.name, mine.to_bytes())
    coded.use_store(coded.store)
    assert (coded.source(), coded.record().ratio) == ("calibrated", 0.5)
    # a record filed under the int8 name but measured raw is refused
    coded.store.put_record(coded.name, packaged.record.to_bytes())
    coded.use_store(coded.store)
    assert coded.source() == "fallback"  # and the shipped raw one does not hold under int8 either
