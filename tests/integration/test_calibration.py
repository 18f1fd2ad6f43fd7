"""Calibration (blend_integrations/calibration.py): measured, stored, used by every engine on the
store, reported on every response, and the per-request guard; on the real engines and stores."""

from __future__ import annotations

import dataclasses
import gzip
import itertools
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from blend_integrations import BlendConfig, BlendPrompt, ChunkStore, load_engine
from blend_integrations.calibrate import read_questions
from blend_integrations.calibration import (
    RELOAD_S,
    CalibrationError,
    CalibrationRecord,
    Guard,
    default_variants,
    exclusive,
    record_name,
    report,
    wilson_lower,
)
from blend_integrations.calibration.choice import GUARD_THRESHOLDS, Costs, guard_thresholds
from blend_integrations.calibration.probes import question_probes
from blend_integrations.config import FALLBACK_RATIO
from blend_integrations.prompt import TokenizedPrompt
from tests.fixtures.documents import DOCS
from tests.fixtures.local_models import sample_text

QUESTION = "Question: which city is named in the documents? Answer:"
SMALL = {"num_prompts": 6, "ratios": (0.1, 0.5), "progress": False}


def documents(seed: int, n: int = 6) -> list[str]:
    return [" ".join(sample_text(4, seed=seed + i)) for i in range(n)]


@pytest.fixture
def private(model_dirs, tmp_path):
    """A transformers engine on a store of this test alone (a calibration must not reach other tests)."""
    engine = load_engine(model_dirs("llama"), store=ChunkStore(tmp_path / "store", remote=""), device="cpu")
    yield engine
    engine.store.close()


def record_for(engine, **changes) -> CalibrationRecord:
    """A record as calibrate writes it, for ``engine``'s model."""
    fields = dict(
        model=engine.model_name,
        fingerprint=engine.fingerprint,
        dtype=engine.dtype_name,
        settings=engine.config.settings(),
        ratio=0.4,
        guard=None,
        meets_target=True,
        target=0.95,
        confidence=0.8,
        tokens=4,
        n=48,
        curve=[],
        date="2026-11-25",
        package_version="test",
        engine=engine.backend,
    )
    if changes.get("guard") is not None:
        changes.setdefault("guard_settings", changes.get("settings", fields["settings"]))
    return CalibrationRecord(**(fields | changes))


def store_record(engine, record: CalibrationRecord) -> None:
    engine.store.put_record(record_name(engine.fingerprint, engine.dtype_name), record.to_bytes())


def test_calibrate_measures_stores_and_every_engine_on_the_store_uses_it(private, model_dirs, tmp_path, capsys):
    before = private.generate(BlendPrompt("Docs:", documents(10, 3), QUESTION), max_tokens=2)
    assert (before.usage.ratio_source, before.usage.recompute_ratio) == ("fallback", FALLBACK_RATIO)

    record = private.calibrate(documents(20), plot=tmp_path / "curve.png", **SMALL)
    assert record.n == 6 and record.fingerprint == private.fingerprint and record.dtype == "float32"
    rows = [c for c in record.curve if c["policy"] == "ratio"]
    # 6 prompts cannot show 0.95 at 80% confidence: only the cheapest ratio ran (on every prompt: it
    # orders them), and it says so
    assert [(c["ratio"], c["n"]) for c in rows] == [(0.1, 6)] and not record.meets_target
    assert all(0 <= c["lower_bound"] <= c["agreement"] <= 1 and c["ttft_speedup"] > 0 for c in rows)
    assert (tmp_path / "curve.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "| default | 0.10 |" in out and "target 0.95" in out
    stored = private.store.get_record(record_name(private.fingerprint, "float32"))
    assert CalibrationRecord.from_bytes(stored, fingerprint=private.fingerprint, dtype="float32") == record

    # Another process opens an engine on the same store: its usage says the ratio is the calibrated one.
    script = (
        "import json, sys; from blend_integrations import BlendPrompt, ChunkStore, load_engine;"
        "from tests.fixtures.local_models import sample_text;"
        f"e = load_engine({model_dirs('llama')!r}, store=ChunkStore({str(private.store.path)!r}, remote=''), device='cpu');"
        "docs = [' '.join(sample_text(4, seed=30 + i)) for i in range(3)];"
        f"g = e.generate(BlendPrompt('Docs:', docs, {QUESTION!r}), max_tokens=2);"
        "print(json.dumps([g.usage.ratio_source, g.usage.recompute_ratio]))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    source, ratio = json.loads(done.stdout.strip().splitlines()[-1])
    choice = record.choice()
    assert source in ("calibrated", "guard")
    assert ratio == choice.ratio if source == "calibrated" else ratio > choice.ratio


def test_an_explicit_ratio_wins_over_the_calibration(private):
    store_record(private, record_for(private, ratio=0.4))
    private.calibrations.use_store(private.store)  # read it now, not within RELOAD_S
    prompt = BlendPrompt("Docs:", documents(40, 3), QUESTION)
    private.warm(documents(40, 3))
    auto = private.generate(prompt, max_tokens=2)
    asked = private.generate(prompt, max_tokens=2, recompute_ratio=0.2)
    assert (auto.usage.ratio_source, auto.usage.recompute_ratio) == ("calibrated", 0.4)
    assert auto.usage.recomputed_tokens == round(0.4 * auto.usage.cached_tokens)
    assert (asked.usage.ratio_source, asked.usage.recompute_ratio) == ("request", 0.2)
    assert 0 <= auto.usage.ranking_captured <= 1
    configured = load_engine(
        private.model_name, store=private.store, device="cpu", config=BlendConfig(recompute_ratio=0.3)
    )
    by_config = configured.generate(prompt, max_tokens=2)
    forced_auto = configured.generate(prompt, max_tokens=2, recompute_ratio="auto")
    assert (by_config.usage.ratio_source, by_config.usage.recompute_ratio) == ("config", 0.3)
    assert (forced_auto.usage.ratio_source, forced_auto.usage.recompute_ratio) == ("calibrated", 0.4)
    full = private.generate(prompt, max_tokens=2, mode="full")
    assert full.usage.recompute_ratio is None and full.usage.ratio_source is None
    assert {"recompute_ratio", "ratio_source", "ranking_captured"} <= set(auto.stats())


def test_the_guard_raises_the_ratio_exactly_as_calibration_predicts(private):
    docs = documents(50, 4)
    private.warm(docs)
    prompt = BlendPrompt("Docs:", docs[::-1], QUESTION)
    ladder = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.7, 0.9)
    runs = {r: private.generate(prompt, max_tokens=4, recompute_ratio=r) for r in ladder}
    captured = {r: g.usage.ranking_captured for r, g in runs.items()}
    assert all(0 < captured[a] <= captured[b] <= 1 for a, b in itertools.pairwise(ladder))  # grows with r
    full = private.generate(prompt, max_tokens=4, mode="full")

    def auto_with(guard: Guard):
        store_record(private, record_for(private, ratio=0.9, guard=guard))
        private.calibrations.use_store(private.store)
        return private.generate(prompt, max_tokens=4)

    middle = captured[0.2] + 1e-6  # 0.2's share falls just short: the next ratio's holds it
    raised = auto_with(Guard(0.05, middle, ladder))
    assert (raised.usage.ratio_source, raised.usage.recompute_ratio) == ("guard", 0.3)
    assert raised.usage.recomputed_tokens == runs[0.3].usage.recomputed_tokens
    assert raised.token_ids == runs[0.3].token_ids and raised.usage.ranking_captured == captured[0.3]
    kept = auto_with(Guard(0.05, captured[0.05], ladder))  # the base already holds it
    assert (kept.usage.ratio_source, kept.usage.recompute_ratio) == ("calibrated", 0.05)
    everything = auto_with(Guard(0.05, 1.0, ladder))  # no share below 1.0 holds all of it: full prefill's equal
    assert (everything.usage.ratio_source, everything.usage.recompute_ratio) == ("guard", 1.0)
    assert everything.token_ids == full.token_ids
    assert everything.usage.recomputed_tokens == everything.usage.cached_tokens


def test_a_calibrated_policy_brings_its_settings_and_a_request_s_own_win(private):
    docs = documents(45, 3)
    private.warm(docs)
    prompt = BlendPrompt("Docs:", docs, QUESTION)
    settings = {**private.config.settings(), "check_layers": [1, 2], "sink_tokens": 2}
    store_record(private, record_for(private, ratio=0.4, settings=settings))
    private.calibrations.use_store(private.store)
    auto = private.generate(prompt, max_tokens=4)
    asked = private.generate(prompt, max_tokens=4, recompute_ratio=0.4, check_layers=(1, 2), sink_tokens=2)
    plain = private.generate(prompt, max_tokens=4, recompute_ratio=0.4)
    assert (auto.usage.ratio_source, auto.usage.recompute_ratio) == ("calibrated", 0.4)
    assert auto.token_ids == asked.token_ids and auto.usage == dataclasses.replace(
        asked.usage, ratio_source="calibrated", calibration_dtype=private.dtype_name
    )
    # two sink tokens of each of the 3 chunks are computed fresh, not counted as cached
    assert auto.usage.cached_tokens == plain.usage.cached_tokens - 2 * 3
    own = private.generate(prompt, max_tokens=4, sink_tokens=0)  # the request's own setting wins over the record's
    assert own.usage.cached_tokens == plain.usage.cached_tokens and own.usage.ratio_source == "calibrated"
    with pytest.raises(ValueError, match=r"check_layers \[1, 99\] must be below the model's \d+ layers"):
        private.generate(prompt, check_layers=[1, 99])
    with pytest.raises(ValueError, match="sink_tokens must be a non-negative integer, got -1"):
        private.generate(prompt, sink_tokens=-1)
    with pytest.raises(ValueError, match='deviation must be "k" or "v"'):
        private.generate(prompt, deviation="x")


def test_a_stopped_calibration_resumes_from_its_journal(private, monkeypatch, tmp_path):
    """Run again with its journal, a calibration measures only what it had not measured (a reply cut by a
    kill, or damaged, is measured again) and chooses what it chose; a journal of another CPU is not used."""
    variants = [{"check_layers": [0]}]
    options = dict(num_prompts=6, ratios=(0.1, 0.5), variants=variants, target=0.5, confidence=0.5, min_speedup=0.01)
    options |= {"progress": False, "save": False, "journal": tmp_path / "journal.jsonl"}
    runs = []
    generate = private.generate
    monkeypatch.setattr(private, "generate", lambda *a, **k: runs.append(k["mode"]) or generate(*a, **k))
    first = private.calibrate(documents(140), **options)
    measured = len(runs)
    journal = options["journal"]
    lines = journal.read_text().splitlines()
    assert len(lines) == 1 + measured and measured > 6  # its header, then each reply as it was measured
    assert all(len(json.loads(line)["logprobs"]) == 1 for line in lines[1:])  # the first token's: what the KL reads
    shares = [json.loads(line)["shares"] for line in lines[1:]]
    assert any(shares) and all(s is None or len(s) == 2 for s in shares)  # at the ladder's two rungs: what guards read
    damaged = json.loads(lines[1]) | {"ttft_s": -1.0}
    journal.write_text("\n".join([lines[0], json.dumps(damaged), *lines[2:-1], lines[-1][:40]]))  # no last newline
    runs.clear()
    again = private.calibrate(documents(140), **options)
    assert len(runs) == 2
    chosen = lambda r: (r.ratio, r.settings, r.guard, r.meets_target, [c["agreement"] for c in r.curve])  # noqa: E731
    assert chosen(again) == chosen(first)
    runs.clear()
    resumed = private.calibrate(documents(140), **options)
    assert runs == []  # the two measured again were appended whole, each on a line of its own
    # its time is what measuring took, in every piece: each reply's measuring is journaled
    kept = journal.read_text().splitlines()[2:]  # the damaged line and the cut one were measured again
    walls = [json.loads(line)["wall_s"] for line in kept if line.endswith("}")]
    assert len(walls) == measured and all(w > 0 for w in walls) and resumed.seconds >= sum(walls) - 0.1
    header, *replies = journal.read_text().splitlines()
    other = json.loads(header)
    other["identity"]["cpu"] = "another CPU x2"
    journal.write_text("\n".join([json.dumps(other), *replies]) + "\n")
    private.calibrate(documents(140), **options)
    assert len(runs) == measured and len(journal.read_text().splitlines()) == 1 + measured


def test_a_guard_is_tried_at_every_share_or_at_most_twelve_spread_over_them():
    assert guard_thresholds([0.2, 0.5, 0.5, 0.9]) == [0.5, 0.9]  # at the lowest no probe is raised
    many = guard_thresholds([i / 100 for i in range(97)])
    assert len(many) == GUARD_THRESHOLDS == 12 and many[0] == 0.01 and many[-1] == 0.96
    assert many == sorted(many) and all(b - a > 0.07 for a, b in itertools.pairwise(many))


def test_what_a_policy_costs():
    # two probes of 100 tokens, 80 of them in chunks after a 10-token system prompt, 4 layers
    probes = [TokenizedPrompt(list(range(100)), [(10, 50), (50, 90)])] * 2
    costs = Costs.of(probes, 4)
    base = BlendConfig().settings()  # check layer 1, by deviation
    # layer 0: 100 tokens; layers 1-3: 20 fresh + 0.15 of 80 reused
    assert costs(base, (0.15, 0.15)) == pytest.approx((100 + 3 * (20 + 12)) / 400)
    assert costs(base, (0.15, 1.0)) == pytest.approx((100 + 3 * 32 + 400) / 800)  # the guard's 1.0: full prefill
    query = {**base, "selection": "query", "check_layers": [0]}
    # the reuse pass (20 fresh at 4 layers), then the blend walk past the 10-token prefix
    assert costs(query, (0.15, 0.15)) == pytest.approx((80 + 4 * (10 + 12)) / 400)
    # a pass's fixed cost, fitted to measured times: 1 ms per token-layer and 50 ms a pass
    runs = [(0, None, 1.0, 0.05 + 0.4), (1, base, 0.15, 0.05 + 0.196), (0, query, 0.15, 0.1 + 0.168)]
    fitted = costs.fitted(runs)
    assert fitted.speed.pass_s / fitted.speed.token_layer_s == pytest.approx(50)
    assert fitted(query, (0.15, 0.15)) == pytest.approx((168 + 100) / 450)
    # and the query's scoring, 30 ms more, once full prefill's sizes and the two kinds of walk separate it
    runs = [(0, None, 1.0, 0.05 + 0.4), (0, None, 1.0, 0.05 + 0.4), (1, base, 0.15, 0.05 + 0.196)]
    runs += [(0, query, 0.15, 0.1 + 0.03 + 0.168), (0, {**query, "check_layers": [1]}, 0.15, 0.1 + 0.03 + 0.236)]
    runs += [(0, base, 0.5, 0.05 + 0.28)]
    fitted = costs.fitted(runs).speed
    assert dataclasses.astuple(fitted) == pytest.approx((1e-3, 0.05, 0.03))
    assert default_variants(BlendConfig(), 4) == [
        {"check_layers": [1, 2]},
        {"selection": "query", "check_layers": [0]},  # ProphetKV's: no layer computed for every token
        {"selection": "query-tail", "check_layers": [0]},
        {"selection": "mixed"},
        {"deviation": "k"},
        {"sink_tokens": 2},
    ]
    # from the query selection at layer 0, a deviation selection needs a layer past it, as mixed does
    assert default_variants(BlendConfig(check_layers=(0,), selection="query"), 4) == [
        {"selection": "deviation", "check_layers": [1]},
        {"selection": "query-tail"},
        {"selection": "mixed", "check_layers": [1]},
        {"deviation": "k"},
        {"sink_tokens": 2},
    ]
    # no room for a second check layer; the other selections and deviation
    assert default_variants(BlendConfig(check_layers=(3,), selection="query", deviation="k", sink_tokens=1), 4) == [
        {"selection": "deviation"},
        {"selection": "query-tail", "check_layers": [0]},
        {"selection": "mixed"},
        {"deviation": "v"},
    ]
    assert {"selection": "mixed"} not in default_variants(BlendConfig(selection="mixed"), 4)


def test_a_chosen_guard_is_reported_with_its_own_settings(private):
    """The guard and the single ratio may each have settings of their own: the report names both."""
    tail = {**private.config.settings(), "selection": "query-tail", "check_layers": [0]}
    query = {**tail, "selection": "query"}
    record = record_for(private, ratio=0.2, settings=tail, guard=Guard(0.1, 0.7), guard_settings=query)
    chosen = report(record).splitlines()[-1]
    assert "Chosen: the guard (base ratio 0.1, threshold 0.7, check_layers=[0], selection=query settings)" in chosen
    assert "cheapest single ratio that meets it is 0.2" in chosen


def test_calibration_stops_early_yet_chooses_what_measuring_everything_chooses(private, monkeypatch, capsys):
    n, ratios = 6, (0.1, 0.3, 0.5)
    variants = [{"check_layers": [0]}, {"sink_tokens": 2}, {"check_layers": [1, 2]}]
    options = dict(num_prompts=n, ratios=ratios, target=0.5, confidence=0.5, min_speedup=0.01, variants=variants)
    runs = []
    generate = private.generate
    monkeypatch.setattr(private, "generate", lambda *a, **k: runs.append(k["mode"]) or generate(*a, **k))
    lazy = private.calibrate(documents(140), progress=False, save=False, **options)
    lazy_runs = len(runs)
    runs.clear()
    every = private.calibrate(documents(140), progress=False, save=False, exhaustive=True, **options)
    assert len(runs) == n * (1 + len(ratios) * (1 + len(variants))) > lazy_runs
    chosen = lambda r: (r.ratio, r.settings, r.guard, r.guard_settings, r.meets_target)  # noqa: E731
    assert chosen(lazy) == chosen(every) and lazy.meets_target
    key = lambda c: (c["policy"], c["variant"], c["ratio"], c.get("threshold"))  # noqa: E731
    whole = {key(c): c for c in every.curve}
    assert all(c["n"] == n for c in every.curve)
    # a guard under the engine's own settings and under others, each from its own probes' shares
    assert len({c["variant"] for c in every.curve if c["policy"] == "guard"}) > 1
    allowed = max(f for f in range(n + 1) if wilson_lower(n - f, n, 0.5) >= 0.5)
    for c in lazy.curve:
        if c["n"] == n:  # measured on every probe: what measuring everything found
            assert c["agreement"] == whole[key(c)]["agreement"], c
        else:  # stopped at the disagreement that ruled the target out, on the hardest probes first
            assert round((1 - c["agreement"]) * c["n"]) == allowed + 1, c
    # nothing costlier than the chosen single ratio was run, except rows whose replies were already there
    ran = [c for c in lazy.curve if c["policy"] == "ratio"]
    assert [c["cost"] for c in ran] == sorted(c["cost"] for c in ran)
    assert "| cost |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda e: record_for(e, fingerprint="0" * 64).to_bytes(), "another model or dtype"),
        (lambda e: record_for(e, dtype="bfloat16").to_bytes(), "another model or dtype"),
        (lambda e: b"\x00not json", "not JSON"),
        (lambda e: json.dumps({"kind": "something else"}).encode(), "not a blend calibration record"),
        (lambda e: record_for(e, ratio=1.7).to_bytes(), "damaged"),
        (lambda e: record_for(e, settings={**e.config.settings(), "check_layers": [99]}).to_bytes(), "below the model"),
        (lambda e: record_for(e, settings={"selection": "query"}).to_bytes(), "settings must name check_layers"),
        (lambda e: record_for(e, settings={**e.config.settings(), "sink_tokens": -2}).to_bytes(), "sink_tokens must"),
        (lambda e: record_for(e, guard=Guard(0.1, 0.5), guard_settings=None).to_bytes(), "settings must name"),
    ],
)
def test_a_foreign_or_damaged_record_is_refused_and_the_fallback_used(private, caplog, damage, why):
    private.store.put_record(record_name(private.fingerprint, "float32"), damage(private))
    private.calibrations.use_store(private.store)
    private.warm(documents(60, 3))
    with caplog.at_level(logging.WARNING, logger="blend_integrations.calibration"):
        gen = private.generate(BlendPrompt("Docs:", documents(60, 3), QUESTION), max_tokens=2)
    assert (gen.usage.ratio_source, gen.usage.recompute_ratio) == ("fallback", FALLBACK_RATIO)
    assert why in caplog.text and "fallback ratio" in caplog.text


def test_a_record_read_back_on_another_machine_through_redis(private, model_dirs, tmp_path, redis_url):
    shared = ChunkStore(tmp_path / "a", remote=redis_url)
    private.store = shared
    store_record(private, record_for(private, ratio=0.6))
    elsewhere = load_engine(model_dirs("llama"), store=ChunkStore(tmp_path / "b", remote=redis_url), device="cpu")
    gen = elsewhere.generate(BlendPrompt("Docs:", documents(70, 2), QUESTION), max_tokens=2)
    assert (gen.usage.ratio_source, gen.usage.recompute_ratio) == ("calibrated", 0.6)


@pytest.mark.parametrize("target", [0, -0.1, 1.5, float("nan"), "0.9", True])
def test_a_target_outside_0_1_is_refused(private, target):
    with pytest.raises(CalibrationError, match=r"target must be a number in \(0, 1\]"):
        private.calibrate(documents(80), target=target, **SMALL)


def test_without_documents_calibration_probes_with_the_model_s_chunks_in_the_store(private, model_dirs, tmp_path):
    docs = documents(60)
    with pytest.raises(CalibrationError, match="none were given: pass the documents .* or warm the store"):
        private.calibrate(**SMALL)  # an empty store
    other = load_engine(model_dirs("llama_seed1"), store=private.store, device="cpu")
    other.warm(docs)  # another model's chunks in the same store are not this one's
    with pytest.raises(CalibrationError, match="none were given"):
        private.calibrate(**SMALL)
    private.warm(docs)
    assert sorted(private.stored_documents()) == sorted(docs)  # decoded from the stored token ids
    from_store = private.calibrate(save=False, **SMALL)
    given = private.calibrate(private.stored_documents(), save=False, **SMALL)
    assert from_store.n == 6 and [c["agreement"] for c in from_store.curve] == [c["agreement"] for c in given.curve]
    assert private.store.get_record(record_name(private.fingerprint, "float32")) is None  # save=False


def test_calibration_needs_documents_long_enough_to_blend(private):
    with pytest.raises(CalibrationError, match="at least 2 documents of 8 tokens or more"):
        private.calibrate(["Short.", "Tiny one.", documents(81, 1)[0]], **SMALL)
    with pytest.raises(CalibrationError, match="a list of texts"):
        private.calibrate(documents(82, 1)[0], **SMALL)
    with pytest.raises(CalibrationError, match="at least 2 prompts with retrieved documents"):
        private.calibrate(prompts=["plain text, no chunks", "another"], **SMALL)
    assert private.store.get_record(record_name(private.fingerprint, "float32")) is None


def test_two_calibrations_of_one_store_at_once_are_refused(private):
    lock = exclusive(private.store, record_name(private.fingerprint, "float32"))
    with lock, pytest.raises(CalibrationError, match="another process is calibrating this model"):
        private.calibrate(documents(90), **SMALL)
    assert private.calibrate(documents(90), **SMALL).n == 6  # free again


def test_calibration_with_the_users_own_prompts_and_the_no_target_verdict(private, capsys):
    docs = documents(95, 4)
    prompts = [BlendPrompt("Docs:", docs[i:] + docs[:i], QUESTION) for i in range(4)]
    record = private.calibrate(prompts=prompts, target=1.0, confidence=0.99, ratios=(0.05,), progress=False)
    # no number of prompts can show 1.0 agreement at a 99% lower bound: full prefill, and why
    assert record.n == 4 and not record.meets_target and record.ratio == 1.0 and record.guard is None
    assert "4 prompts cannot show agreement 1.0 at 99% confidence even if every one agrees (no number" in (
        capsys.readouterr().out
    )
    assert private.calibrate(prompts=prompts, target=0.9, confidence=0.8, ratios=(0.05,), progress=False).why == (
        "4 prompts cannot show agreement 0.9 at 80% confidence even if every one agrees (that takes 7 or more): "
        "full prefill"
    )
    gen = private.generate(prompts[0], max_tokens=2)
    full = private.generate(prompts[0], max_tokens=2, mode="full")
    assert (gen.usage.ratio_source, gen.usage.recompute_ratio) == ("calibrated", 1.0)
    # recomputing every token is full prefill: computed as such, without the blend pass
    assert gen.usage.cached_tokens == gen.usage.recomputed_tokens == 0 and gen.token_ids == full.token_ids


def test_a_policy_not_measured_sooner_than_full_prefill_is_not_chosen(private, capsys):
    docs = documents(130, 4)
    # an easy target that low ratios meet; nothing is 1000x sooner than full prefill
    record = private.calibrate(docs, target=0.05, confidence=0.5, min_speedup=1000.0, **SMALL)
    assert record.meets_target and record.ratio == 1.0 and record.guard is None
    assert "under min_speedup 1000.0: full prefill" in record.why and "Chosen: full prefill" in capsys.readouterr().out
    quick = private.calibrate(docs, target=0.05, confidence=0.5, min_speedup=0.01, **SMALL)
    assert quick.ratio == 0.1 or quick.guard is not None  # the cheapest now
    with pytest.raises(CalibrationError, match="min_speedup must be a positive number"):
        private.calibrate(docs, min_speedup=0, **SMALL)


def test_wilson_lower_bound():
    assert wilson_lower(0, 10, 0.8) == pytest.approx(0.0, abs=1e-12) and wilson_lower(0, 0, 0.8) == 0.0
    assert 0.9 < wilson_lower(48, 48, 0.8) < 1.0
    assert wilson_lower(45, 48, 0.8) < 45 / 48 < wilson_lower(45, 48, 0.5) + 1e-9
    assert wilson_lower(45, 48, 0.95) < wilson_lower(45, 48, 0.8)


def test_the_cli_calibrates_a_store_from_a_folder_of_documents(model_dirs, tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i, text in enumerate(documents(100)):
        (folder / f"doc{i}.txt").write_text(text)
    store = tmp_path / "store"
    cmd = [sys.executable, "-m", "blend_integrations.calibrate", model_dirs("llama"), "--store", str(store)]
    done = subprocess.run(
        cmd + ["--documents", str(folder), "--prompts", "4", "--ratios", "0.1", "0.5", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| default | 0.10 |" in done.stdout and f"stored in {store}" in done.stdout
    assert "calibrating" in done.stderr  # the progress bar
    assert len(list((store / "records").iterdir())) == 1
    bad = subprocess.run(cmd + ["--documents", str(tmp_path / "missing")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no such file or folder" in bad.stderr
    target = subprocess.run(
        cmd + ["--documents", str(folder), "--target", "1.5"], capture_output=True, text=True, timeout=120
    )
    assert target.returncode == 2 and "--target must be in (0, 1]" in target.stderr
    empty = tmp_path / "questions.txt"
    empty.write_text("\n")
    questions = subprocess.run(
        cmd + ["--documents", str(folder), "--questions", str(empty)], capture_output=True, text=True, timeout=120
    )
    assert questions.returncode == 2 and "--questions: " in questions.stderr and "no question in it" in questions.stderr


def test_a_policy_meets_the_target_only_where_it_meets_it_on_every_task(private):
    """Probes of several kinds of question: each row's lower bound is its worst task's (each task's own
    Wilson bound), so a task too small to show the target rules every policy out, pooled or not."""
    docs = documents(150, 10)
    a = [BlendPrompt("Docs:", docs[i : i + 4], QUESTION) for i in range(7)]
    b = [BlendPrompt("Docs:", docs[i:] + docs[:i], "Question: what year is named? Answer:") for i in range(2)]
    options = dict(ratios=(0.1, 0.5), variants=[], min_speedup=0.01, progress=False, save=False)
    record = private.calibrate(prompts={"a": a, "b": b}, target=0.5, confidence=0.5, exhaustive=True, **options)
    assert record.tasks == {"a": 7, "b": 2} and record.n == 9
    for c in record.curve:
        tasks = c["tasks"]
        for name, size in record.tasks.items():
            agree = round(tasks[name]["agreement"] * size)
            assert tasks[name]["n"] == size and tasks[name]["lower_bound"] == round(wilson_lower(agree, size, 0.5), 4)
        assert c["lower_bound"] == min(t["lower_bound"] for t in tasks.values())
    assert "Probes of a (7), b (2): a policy's lower bound is its worst task's." in report(record)
    assert "| settings | ratio | cost | agreement | a | b | lower bound |" in report(record)
    # 2 prompts cannot show 0.9 at 80% (it takes 7): no policy meets it, though the 9 pooled could
    small = private.calibrate(prompts={"a": a, "b": b}, target=0.9, confidence=0.8, **options)
    assert small.ratio == 1.0 and small.why.startswith("2 prompts of b cannot show agreement 0.9 at 80% confidence")
    pooled = private.calibrate(prompts=a + b, target=0.9, confidence=0.8, **options)
    assert pooled.tasks == {"prompts": 9} and "cannot show" not in pooled.why


def test_calibration_asks_the_users_own_questions_over_the_documents_retrieved_for_them(private, tmp_path):
    docs = DOCS + documents(160, 4)
    questions = ["Who founded Harbor Press?", "When did the city library move into the customs house?"]
    probes = question_probes(private, docs, questions, 4, seed=0, per_prompt=2)
    texts = [private.tokenizer.decode(p.token_ids) for p in probes]
    assert sorted(q for t in texts for q in questions if q in t) == sorted(questions * 2)  # each asked twice
    for question, answer_doc in zip(questions, (DOCS[0], DOCS[2])):
        for probe, text in zip(probes, texts):
            if question in text:  # over the 2 documents BM25 ranks first for it, the best first
                start, end = probe.chunk_spans[0]
                assert len(probe.chunk_spans) == 2
                assert private.tokenizer.decode(probe.token_ids[start:end]).strip() == answer_doc
    options = dict(num_prompts=4, ratios=(0.5,), variants=[], min_speedup=0.01, progress=False, save=False)
    record = private.calibrate(docs, questions=questions, **options)
    assert record.tasks == {"questions": 4} and record.n == 4
    for bad in ("Who founded Harbor Press?", ["ok?", ""], []):
        with pytest.raises(CalibrationError, match="questions"):
            private.calibrate(docs, questions=bad, **options)
    # the command line's file of questions: one per line, or .jsonl
    lines = tmp_path / "questions.txt"
    lines.write_text("Who founded Harbor Press?\n\n  When did the library move?  \n")
    assert read_questions(str(lines)) == ["Who founded Harbor Press?", "When did the library move?"]
    jsonl = tmp_path / "questions.jsonl"
    jsonl.write_text('"Who founded Harbor Press?"\n{"question": "When?"}\n{"text": "no question"}\n')
    with pytest.raises(ValueError, match='questions.jsonl:3: expected a string or an object with a "question"'):
        read_questions(str(jsonl))
    with pytest.raises(ValueError, match="no such file"):
        read_questions(str(tmp_path / "missing.txt"))


def test_the_warmer_calibrates_at_ingestion_once(private):
    from langchain_core.documents import Document

    from blend_integrations.langchain import BlendCacheWarmer

    warmer = BlendCacheWarmer(private, calibrate=True, calibrate_options={"num_prompts": 4, "ratios": (0.5,)})
    warmer.transform_documents([Document(page_content=d) for d in documents(110)])
    first = private.calibrations.record()
    assert first is not None and first.n == 4
    warmer.transform_documents([Document(page_content=d) for d in documents(120)])  # calibrated already: kept
    assert private.calibrations.record() == first


def test_the_vllm_engine_plans_with_the_stored_calibration(vllm_engine, engine, docs):
    """The vLLM connector's scheduler reads the record from the store (another process) within RELOAD_S."""
    name = record_name(vllm_engine.fingerprint, vllm_engine.dtype_name)
    other = record_name(vllm_engine.fingerprint, "bfloat16")
    settings = {**engine.config.settings(), "check_layers": [1, 2], "sink_tokens": 2}
    record = record_for(engine, ratio=0.5, settings=settings)
    vllm_engine.store.put_record(name, record.to_bytes())
    try:
        time.sleep(RELOAD_S + 0.2)
        vllm_engine.warm(docs)
        gen = vllm_engine.generate(BlendPrompt("Docs:", docs, QUESTION), max_tokens=2)
        # the calibrated ratio, with the settings it was calibrated under
        assert (gen.usage.ratio_source, gen.usage.recompute_ratio) == ("calibrated", 0.5)
        assert gen.usage.calibration_dtype == vllm_engine.dtype_name == "float32"
        assert gen.usage.recomputed_tokens == round(0.5 * gen.usage.cached_tokens)
        same = engine.generate(
            BlendPrompt("Docs:", docs, QUESTION), max_tokens=2, recompute_ratio=0.5, check_layers=[1, 2], sink_tokens=2
        )
        assert (gen.usage.cached_tokens, gen.usage.recomputed_tokens) == (
            same.usage.cached_tokens,
            same.usage.recomputed_tokens,
        )
        # the settings travel in kv_transfer_params, checked: a request's own win
        own = vllm_engine.generate(BlendPrompt("Docs:", docs, QUESTION), max_tokens=2, sink_tokens=0)
        assert own.usage.cached_tokens == gen.usage.cached_tokens + 2 * len(docs)
        # a calibration that recomputes everything: vLLM's own prefill, no blend pass
        vllm_engine.store.put_record(name, dataclasses.replace(record, ratio=1.0, guard=None).to_bytes())
        time.sleep(RELOAD_S + 0.2)
        whole = vllm_engine.generate(BlendPrompt("Docs:", docs, QUESTION), max_tokens=2)
        full = vllm_engine.generate(BlendPrompt("Docs:", docs, QUESTION), max_tokens=2, mode="full")
        assert (whole.usage.ratio_source, whole.usage.recompute_ratio) == ("calibrated", 1.0)
        assert whole.usage.cached_tokens == 0 and whole.token_ids == full.token_ids and whole.fallback is None
        assert whole.usage.calibration_dtype == "float32"
        # none measured in this dtype: one measured in another serves it, and the usage names that dtype
        vllm_engine.store.delete_record(name)
        vllm_engine.store.put_record(other, dataclasses.replace(record, dtype="bfloat16").to_bytes())
        time.sleep(RELOAD_S + 0.2)
        crossed = vllm_engine.generate(BlendPrompt("Docs:", docs, QUESTION), max_tokens=2)
        assert (crossed.usage.ratio_source, crossed.usage.recompute_ratio) == ("calibrated", 0.5)
        assert crossed.usage.calibration_dtype == "bfloat16" and crossed.stats()["calibration_dtype"] == "bfloat16"
    finally:
        vllm_engine.store.delete_record(name)
        vllm_engine.store.delete_record(other)
        time.sleep(RELOAD_S + 0.2)  # the next tests see the fallback again
    after = vllm_engine.generate(BlendPrompt("Docs:", docs, QUESTION), max_tokens=2)
    assert (after.usage.ratio_source, after.usage.recompute_ratio) == ("fallback", FALLBACK_RATIO)


def test_the_vllm_engine_runs_the_guard_as_the_transformers_engine_does(vllm_engine, engine, docs):
    """The guard raises the ratio in vLLM's worker; the worker's report of it
    reaches the request's answer, also when the request ends in the step its
    blend pass ran in (max_tokens=1: ``engines/vllm_answers.py``)."""
    name = record_name(vllm_engine.fingerprint, vllm_engine.dtype_name)
    engine.warm(docs)
    prompt = BlendPrompt("Docs:", docs[::-1], QUESTION)
    runs = {r: engine.generate(prompt, max_tokens=1, recompute_ratio=r) for r in (0.2, 0.3)}
    low, high = (runs[r].usage.ranking_captured for r in (0.2, 0.3))
    assert high - low > 0.01  # room for the two engines' rounding between the rungs
    guard = Guard(0.05, (low + high) / 2, (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.7, 0.9))
    vllm_engine.store.put_record(name, record_for(engine, ratio=0.9, guard=guard).to_bytes())
    try:
        time.sleep(RELOAD_S + 0.2)
        raised = vllm_engine.stats()["guard_raised"]
        for max_tokens in (1, 3):
            gen = vllm_engine.generate(prompt, max_tokens=max_tokens)
            assert (gen.usage.ratio_source, gen.usage.recompute_ratio) == ("guard", 0.3), max_tokens
            assert gen.usage.recomputed_tokens == runs[0.3].usage.recomputed_tokens == len(gen.recomputed_positions)
            assert gen.usage.ranking_captured == pytest.approx(high, abs=0.005)
            assert gen.ranking_share is not None and gen.ranking_share(0.2) < guard.threshold
        assert vllm_engine.stats()["guard_raised"] == raised + 2
    finally:
        vllm_engine.store.delete_record(name)
        time.sleep(RELOAD_S + 0.2)  # the next tests see the fallback again


def test_a_stopped_calibration_benchmark_keeps_its_journal_for_a_commit(tmp_path):
    """``--checkpoint``: the journal of a run stopped midway, and its held-out answers once it has
    some, compressed under records/, whole."""
    from benchmarks.calibration import main

    work = tmp_path / ".calibration-reader-vllm.partial"
    work.mkdir()
    (work / "journal.jsonl").write_text('{"journal": "blend-calibration"}\n{"key": "a"}\n')
    main(["--model", "reader", "--backend", "vllm", "--out", str(tmp_path), "--checkpoint"])
    kept = tmp_path / "records" / "calibration-reader-vllm.journal.jsonl.gz"
    answers = tmp_path / "records" / "calibration-reader-vllm.held-out.json.gz"
    assert gzip.decompress(kept.read_bytes()) == (work / "journal.jsonl").read_bytes() and not answers.exists()
    (work / "held-out.partial.json").write_text('{"key": "b", "rows": {}}')
    main(["--model", "reader", "--backend", "vllm", "--out", str(tmp_path), "--checkpoint"])
    assert gzip.decompress(answers.read_bytes()) == (work / "held-out.partial.json").read_bytes()
    (work / "journal.jsonl").unlink()
    with pytest.raises(SystemExit, match="no journal to keep"):
        main(["--model", "reader", "--backend", "vllm", "--out", str(tmp_path), "--checkpoint"])


def test_the_calibration_benchmark_judges_on_held_out_questions(model_dirs, tmp_path):
    """A small run of `python -m benchmarks calibration`: its pages are written from what it measured."""
    from tests.fixtures.commands import ROOT

    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "benchmarks", "calibration", "--model", model_dirs("llama"), "--out", str(out)]
    # another checkout's checkpoint (--checkpoint), of another machine: taken up, started afresh, removed at the end
    foreign = out / "records" / f"calibration-{Path(model_dirs('llama')).name}-transformers.journal.jsonl.gz"
    foreign.parent.mkdir(parents=True)
    header = {"journal": "blend-calibration", "version": 1, "identity": {"cpu": "another CPU"}}
    foreign.write_bytes(gzip.compress((json.dumps(header) + "\n").encode()))
    # and its held-out answers, under another key (another record, machine or questions): not used
    answers = foreign.with_name(foreign.name.replace("journal.jsonl.gz", "held-out.json.gz"))
    rows = {mode: [{"agree": True}] for mode in ("full", "default (calibrated)")}
    answers.write_bytes(gzip.compress(json.dumps({"key": "another", "rows": {"generated": rows}}).encode()))
    done = subprocess.run(
        cmd + ["--prompts", "4", "--questions", "3", "--doc-tokens", "20", "40", "--squad-docs", "2", "3"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert not list(out.glob(".calibration-*")) and list(out.glob("records/*"))  # what it resumes from: removed
    assert not foreign.exists() and not answers.exists() and "calibrating (" in done.stderr
    (report_path,) = out.glob("calibration-*.json")
    report = json.loads(report_path.read_text())
    held = report["held_out"]
    assert set(held) == {
        "full",
        "default (calibrated)",
        f"calibrated single ratio ({report['calibration']['ratio']})",
        f"fallback ({FALLBACK_RATIO})",
    }
    config = report["config"]
    assert held["full"]["agreement"] == 1.0 and config["held_out_questions"] == 6
    # probes of two kinds of question, and two held out: SQuAD's train and dev, never the same documents
    assert config["calibration_tasks"] == {"generated": 4, "squad-train": 4} and config["calibration_prompts"] == 8
    assert config["held_out_tasks"] == {"generated": 3, "squad-dev": 3} and config["probes"] == "questions"
    for table in report["held_out_tasks"].values():
        assert set(table) == set(held) and table["full"]["blended"] == 3
        row = table[f"fallback ({FALLBACK_RATIO})"]
        assert row["blended"] + row["not_blended"] == 3 and 0 <= row["agreement_lower"] <= row["agreement"]
    summary = (out / "calibration.md").read_text()
    assert (
        f"[{model_dirs('llama').rsplit('/', 1)[-1]}](calibration-" in summary
        and "| transformers | questions |" in summary
    )
    # the record is kept, and --record judges it on the held-out questions again without calibrating
    (kept,) = (out / "records").glob("calibration-*.json")
    # the record's time: a resumed run's counts what its journal's replies took, not their replay
    assert config["calibration_seconds"] == round(json.loads(kept.read_text())["seconds"], 1) > 0
    again = subprocess.run(
        cmd
        + ["--prompts", "4", "--questions", "3", "--doc-tokens", "20", "40", "--squad-docs", "2", "3"]
        + ["--record", str(kept)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert "calibrating (" not in again.stderr  # no probe was run
    rejudged = json.loads(report_path.read_text())
    assert rejudged["calibration"] == report["calibration"] and rejudged["held_out"]["full"]["agreement"] == 1.0
    # a record of other probes, or not a record, is refused by name
    import argparse

    from benchmarks.calibration import read_record

    engine = load_engine(model_dirs("llama"), store=ChunkStore(tmp_path / "store", remote=""), device="cpu")
    asked = argparse.Namespace(tasks=["generated", "squad"], prompts=5, target=0.95)
    with pytest.raises(SystemExit, match="was measured on .* not on the"):
        read_record(kept, engine, asked)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit, match="bad.json: the record is not a blend calibration record"):
        read_record(tmp_path / "bad.json", engine, asked)


def test_a_policy_ships_only_where_its_held_out_lower_bound_meets_the_target(tmp_path):
    """``benchmarks calibration --package``: the record, with what held-out questions measured of it,
    pooled and by task; a policy whose held-out agreement's lower bound falls short of the target on
    any task is not shipped: the file ships full prefill, and says why."""
    import argparse

    from benchmarks.calibration import write_packaged
    from blend_integrations.calibration import PACKAGED_DIR, PackagedCalibration

    # the policy the 1.5B model's calibration chose on the transformers engine (query selection at 0.15),
    # before the shipping rule replaced it in the packaged file
    path = PACKAGED_DIR / "qwen2.5-coder-1.5b-transformers.json"
    shipped = PackagedCalibration.from_bytes(path.read_bytes(), path)
    record = dataclasses.replace(shipped.record, ratio=0.15, meets_target=True)

    def rows(agree: int, n: int = 60) -> dict:
        row = {"blended": n, "not_blended": 0, "agreement": agree / n, "right": 0.9, "mean_ratio": 0.15}
        row |= {"agreement_lower": wilson_lower(agree, n, record.confidence), "guard_fired": 0.0}
        row |= {"ttft_s": 1.0, "ttft_speedup": 2.0}
        return {"full": row, "default (calibrated)": row, f"fallback ({FALLBACK_RATIO})": row}

    args = argparse.Namespace(model="qwen2.5-coder-1.5b", backend="transformers")
    held = {"generated": rows(60), "squad-dev": rows(60)}
    path = write_packaged(record, rows(120, 120), held, args, folder=tmp_path)
    kept = PackagedCalibration.from_bytes(path.read_bytes(), path)
    assert (kept.record.ratio, kept.record.meets_target) == (record.ratio, True)
    assert kept.held_out["questions"] == 120 and set(kept.held_out["tasks"]) == {"generated", "squad-dev"}
    # 57 of 60 on SQuAD: 95% agree, at least 92% at 80%, short of 0.95
    held["squad-dev"] = rows(57)
    refused = PackagedCalibration.from_bytes(
        write_packaged(record, rows(117, 120), held, args, folder=tmp_path).read_bytes(), path
    )
    assert (refused.record.ratio, refused.record.guard, refused.record.meets_target) == (1.0, None, False)
    assert refused.record.why.startswith(
        "held out, the chosen policy falls short of the target 0.95 at its lower bound"
    )
    assert "squad-dev: 0.950 agree (at least 0.921)" in refused.record.why and "generated" not in refused.record.why
    assert refused.record.choice().ratio == 1.0  # "auto" runs full prefill
