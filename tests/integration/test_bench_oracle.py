"""The oracle benchmark (benchmarks/oracle.py) on the bundled reader: its
reference walk, its patch and its recompute given a token set are full
prefill where they must be, and the benchmark writes its tables."""

from __future__ import annotations

import json
import re

import pytest
import torch

from benchmarks import oracle, oracle_report, probes
from benchmarks.quality import BASE, DEVELOPMENT_SEED, TASKS
from blend_integrations import BlendConfig, ChunkStore, load_engine
from blend_integrations.quality import reader_model_dir


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    engine = load_engine(
        str(reader_model_dir()), store=ChunkStore(tmp_path_factory.mktemp("store")), config=BlendConfig(**BASE)
    )
    example = TASKS["reader"].examples(1, DEVELOPMENT_SEED)[0]
    engine.warm(example.documents)
    return engine, TASKS["reader"].prompt(example, engine.tokenizer)


def test_the_oracle_at_every_token_is_full_prefill(reader):
    """Patching every chunk token with full prefill's KV, or recomputing all of
    them with a given ranking, gives full prefill's tokens; patching none of
    them leaves the reused KV, whose deviation the reference measures."""
    engine, tp = reader
    walk = oracle.Oracle(engine, tokens=4)
    with torch.inference_mode():
        ref = walk.reference(tp)
        assert ref.tokens == engine.generate(tp, mode="full", max_tokens=4).token_ids[:4]
        layers = engine.num_layers
        every = torch.ones(layers, len(tp), dtype=torch.bool)
        assert walk.patched(tp, ref, every) == ref.tokens
        ranking = torch.zeros(len(tp))
        ranking[ref.chunk_rows] = 1.0
        assert walk.recomputed(tp, ref, ranking, 1.0, check_layer=1) == ref.tokens
    dv, dk, rows = oracle.deviations(ref)
    assert rows.numel() == sum(b - a for a, b in tp.chunk_spans)
    assert dv.shape == dk.shape == (layers, rows.numel())
    # the first layer's values and keys (before RoPE) depend on no context; later layers' do
    assert float(dv[0].max()) < 1e-6 and float(dk[0].max()) < 1e-6
    assert float(dv[layers - 1].mean()) > 1e-3


def test_the_benchmark_writes_and_renders_its_tables(tmp_path, capsys):
    oracle.main(
        ["--model", "reader", "--questions", "2", "--ratios", "0.15", "--settings", "deviation", "query-layer0"]
        + ["--out", str(tmp_path)]
    )
    # a subset of the settings has a page named after them: the whole run's page stays
    report = json.loads((tmp_path / "oracle-reader-transformers-deviation-query-layer0.json").read_text())
    assert report["full"]["exact_at_ratio_one"] == [True, True]
    modes = report["modes"]
    assert set(modes) == {
        "reuse",
        "deviation@0.15",
        "query-layer0@0.15",
        "(b) recompute, oracle set@0.15",
        "(c) oracle patch, one set@0.15",
        "(c) oracle patch, set per layer@0.15",
    }
    assert all(0.0 <= m["agree"] <= 1.0 for m in modes.values())
    assert 0.0 <= modes["deviation@0.15"]["recall"] <= 1.0 and modes["query-layer0@0.15"]["speedup"] > 0
    assert report["config"]["settings"]["query-layer0"]["check_layers"] == [0]
    assert report["config"]["pass_ms"] > 0 and report["config"]["mean_prefix_tokens"] > 0
    c = report["config"]
    assert abs(c["pass_tokens"] - (c["mean_prompt_tokens"] - c["mean_reused_tokens"])) <= 1  # a reuse pass's size
    assert report["config"]["scoring_ms"] >= 0
    page = (tmp_path / "oracle-reader-transformers-deviation-query-layer0.md").read_text()
    assert "| (a) blend, query-layer0 |" in page and "Deviation by layer" in page
    # made with the prediction in use: its fit is a test of it, and it says how many settings fit
    assert report["config"]["prediction"] == oracle_report.PREDICTION
    assert "so this fit is a test of it" in page and re.search(r"(\d) of 2 within 1.15x either way", page)
    oracle.main(["--render", str(tmp_path / "oracle-reader-transformers-deviation-query-layer0.json")])
    assert (tmp_path / "oracle-reader-transformers-deviation-query-layer0.md").read_text() == page


def test_the_probes_benchmark_lists_every_prompt_a_setting_missed(tmp_path):
    """``python -m benchmarks probes`` on the reader: every setting at every
    ratio on every probe, full prefill's tokens and their top-two margins, and
    a page whose counts and listed misses are the JSON's."""
    probes.main(
        ["--model", "reader", "--backend", "transformers", "--prompts", "3", "--ratios", "0.05", "0.3"]
        + ["--settings", "deviation", "query-tail", "--out", str(tmp_path)]
    )
    report = json.loads((tmp_path / "probes-reader-transformers.json").read_text())
    rows = report["per_prompt"]
    assert [r["prompt"] for r in rows] == [0, 1, 2]
    modes = ["deviation@0.05", "deviation@0.3", "query-tail@0.05", "query-tail@0.3"]
    assert all(list(r["agrees"]) == modes for r in rows)
    assert all(len(r["margins"]) == len(r["full"]) > 0 and min(r["margins"]) >= 0 for r in rows)
    page = (tmp_path / "probes-reader-transformers.md").read_text()
    for mode in modes:
        assert f"| {mode} | {sum(r['agrees'][mode] for r in rows)} of 3 |" in page
    missed = [r["prompt"] for r in rows if not all(r["agrees"].values())]
    listed = [line.split("|")[1].strip() for line in page.splitlines() if line.count("|") == 7]
    assert listed[0] == "prompt" and [int(p) for p in listed[2:]] == missed  # after the header and its rule
    # a run under a setting's old name renders with its new one, and says so
    old = {**report, "per_prompt": [{**r, "agrees": {"prophet@0.3": False}} for r in rows]}
    text = probes.markdown(old)
    assert "| query-layer0@0.3 | 0 of 3 |" in text and "old name, `prophet`, now `query-layer0`" in text
    assert "prophet@" not in text


def test_the_predicted_time_counts_every_token_layer_and_the_reuse_pass():
    """``oracle_report.predicted_ms`` on round numbers: 4 layers, 100 tokens of which 80 reused in
    4 chunks, 5 before the first; full 500 ms, reuse 100 ms, so a token-layer costs 400 / 320 =
    1.25 ms; a pass of the 20 fresh tokens timed at 130 ms, less its 80 token-layers: 30 ms."""
    config = {"layers": 4, "mean_prompt_tokens": 100, "mean_reused_tokens": 80}
    config |= {"mean_chunks": 4, "mean_prefix_tokens": 5, "pass_ms": 130.0, "pass_tokens": 20}
    speed = oracle_report.measured_speed(config, 500.0, 100.0)
    assert (speed.token_layer_s, speed.pass_s, speed.scoring_s) == pytest.approx((1.25, 30.0, 0.0))
    base = {"check_layers": [1], "sink_tokens": 0, "selection": "deviation"}
    at = lambda ratio, **changes: oracle_report.predicted_ms(config, 500.0, 100.0, base | changes, ratio)  # noqa: E731
    assert at(1.0, check_layers=[0]) == pytest.approx(500.0)  # every token-layer: full prefill
    assert at(0.25) == pytest.approx(100.0 + 1.25 * (80 + 3 * 20))  # layer 0 whole, then a quarter
    # sink tokens: 4 per chunk computed at every layer, the quarter taken of the other 64
    assert at(0.25, sink_tokens=4) == pytest.approx(100.0 + 1.25 * (80 + 3 * (16 + 16)))
    # by the query: its reuse pass (20 fresh tokens at 4 layers, and a pass's fixed cost), then a
    # blend walk that skips the 5 tokens before the first chunk
    assert at(0.25, selection="query") == pytest.approx(100.0 + 30.0 + 1.25 * (4 * 20 + 95 + 3 * 35 - 4 * 20))
    # with the query's scoring measured (revision 5), that reuse pass costs it too; a deviation
    # selection has no reuse pass and pays nothing more
    config["scoring_ms"] = 45.0
    assert at(0.25, selection="query") == pytest.approx(100.0 + 30.0 + 45.0 + 1.25 * (95 + 3 * 35))
    assert at(0.25) == pytest.approx(100.0 + 1.25 * (80 + 3 * 20))
    # a run before revision 5 timed one token's pass; a pass faster than its token-layers costs nothing fixed
    del config["pass_tokens"]
    assert oracle_report.measured_speed(config, 500.0, 100.0).pass_s == pytest.approx(130.0 - 4 * 1.25)
    assert oracle_report.measured_speed(config | {"pass_ms": 2.0}, 500.0, 100.0).pass_s == 0.0
