"""The store benchmark's quick path: every tier and case runs, and the report holds together."""

from __future__ import annotations

import json
import os

from tests.fixtures.commands import ROOT, run_python


def test_store_bench_quick(tmp_path):
    env = dict(os.environ, HOME=str(tmp_path), HF_HUB_OFFLINE="1")  # the small model is built under HOME
    args = ["--quick", "--json", "--device", "cpu", "--out", str(tmp_path / "results")]
    out = run_python("-m", "benchmarks", "store", *args, env=env, timeout=1200)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(report["bandwidth"]) == {"memory", "disk (whole)", "disk (layers)", "redis (whole)", "redis (layers)"}
    for row in report["bandwidth"].values():
        assert row["mb_per_s"] > 0 and row["store_estimate_mb_per_s"] > 0 and row["chunk_mb"] > 0
    cases = report["ttft"]
    tiers = ("memory", "disk", "redis")
    assert set(cases) == {"full"} | {f"blend@0.15, {t}" for t in tiers} | {f"controller, {t}" for t in tiers} | {
        f"blend@0.15, {t}, pipelined" for t in tiers[1:]
    } | {"blend@0.15, disk, pipelined, 1 thread"}
    assert cases["full"]["cached_tokens"] == 0 and cases["full"]["speedup"] == 1.0
    blends = [c for name, c in cases.items() if name.startswith("blend")]
    assert len({(c["cached_tokens"], c["recomputed_tokens"]) for c in blends}) == 1  # same work from every tier
    for t in tiers:
        chose = cases[f"controller, {t}"]["controller"]
        assert all(r >= 0.15 for r in chose["ratio"])  # never below the floor
        assert chose["est_compute_ms"] > 0
    written = tmp_path / "results"
    assert json.loads((written / "store.json").read_text())["ttft"].keys() == cases.keys()
    assert "| controller, redis |" in (written / "store.md").read_text()
    # the codecs: a coded entry in about a quarter of the raw one's bytes, and every chunk read through the link
    codecs = report["codecs"]
    assert set(codecs) == {f"bench model, {c}" for c in ("raw", "fp8", "int8")}
    for codec in ("fp8", "int8"):
        assert codecs[f"bench model, {codec}"]["bytes_per_token"] < 0.3 * codecs["bench model, raw"]["bytes_per_token"]
    assert set(report["layered_threads"]) == {"1", "2", "4"}
    throttled = report["throttled"]
    assert {name: row["chunks_hit"] for name, row in throttled.items()} == {"full": 0, "raw": 3, "fp8": 3, "int8": 3}
    assert throttled["int8"]["mb_read"] < 0.3 * throttled["raw"]["mb_read"]
    assert "benchmarks store" in (ROOT / "Makefile").read_text().split("bench:")[1].split("\n\n")[0]
