"""The profile benchmark on a small model: the profiler sees the blend pass and
vLLM's forward (vLLM's engine core in its process), and the report holds together."""

from __future__ import annotations

import json
import os
import re

from tests.fixtures.commands import ROOT, run_python


def test_profile_bench_splits_the_blend_pass_by_phase(tmp_path):
    env = dict(os.environ, HOME=str(tmp_path), HF_HUB_OFFLINE="1")  # the small model is built under HOME
    out = tmp_path / "results"
    args = ["--layers", "4", "--chunks", "3", "--chunk-tokens", "256", "--repeats", "1", "--kv-cache-gib", "1"]
    run_python("-m", "benchmarks", "profile", *args, "--out", str(out), env=env, timeout=1200)
    report = json.loads((out / "profile.json").read_text())
    # the backend, how the blend pass attends ("auto": the faster, with what it measured) and the ISA
    assert re.fullmatch(
        r"CPU_ATTN \(blend pass: (its kernel|SDPA), measured [\d.]+ ms kernel against [\d.]+ ms SDPA\), ISA \w+",
        report["config"]["attention"],
    )
    assert report["config"]["machine"].startswith("CPU ")
    runs = report["profiled"]
    assert set(runs) == {"full", "blend@0.15", "blend@1.0", "reuse"}
    full = runs["full"]["scopes"]
    assert "blend pass" not in full  # full prefill is vLLM's own forward alone
    assert {"attention (vLLM kernel, writes KV)", "q/k/v projection", "MLP", "norms"} <= set(full["vLLM forward"])
    blend = runs["blend@0.15"]["scopes"]["blend pass"]
    for phase in ("attention (walk)", "write KV (paged cache)", "load reused KV", "q/k/v projection", "MLP", "RoPE"):
        assert blend[phase] > 0, phase
    # every token through the walk costs more than a blend at 0.15, which costs more than reuse
    totals = {name: run["totals_ms"]["blend pass"] for name, run in runs.items() if name != "full"}
    assert totals["blend@1.0"] > totals["blend@0.15"] > totals["reuse"]
    assert report["predicted"]["blend_over_predicted"] > 0
    assert "blend / predicted" in (out / "profile.md").read_text()
    assert "benchmarks profile" in (ROOT / "Makefile").read_text().split("bench:")[1].split("\n\n")[0]
