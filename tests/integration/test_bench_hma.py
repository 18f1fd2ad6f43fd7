"""The hybrid-KV-cache-manager benchmark on a small sliding-window model: what
vLLM's hybrid manager holds in the same memory, with it and without it, and
that vLLM runs the blend engine without it (the connector does not declare
``SupportsHMA``)."""

from __future__ import annotations

import json
import os

from tests.fixtures.commands import ROOT, run_python


def test_hma_bench_measures_the_hybrid_managers_capacity(tmp_path, model_dirs):
    env = dict(os.environ, HOME=str(tmp_path), HF_HUB_OFFLINE="1")
    out = tmp_path / "results"
    args = ["--model", model_dirs("gemma3_text"), "--max-model-len", "4096", "--kv-cache-gib", "1"]
    args += ["--prefill-budget", "512", "--chunks", "3", "--chunk-tokens", "96", "--repeats", "1", "--out", str(out)]
    run_python("-m", "benchmarks", "hma", *args, env=env, timeout=1200)
    (path,) = out.glob("hma-*.json")
    report = json.loads(path.read_text())
    assert report["config"]["windowed_layers"] == report["config"]["layers"] // 2  # 32-token windows
    on, off, on_blend_budget, full, blend = report["rows"].values()
    assert [r["hybrid_manager"] for r in (on, off, on_blend_budget, full, blend)] == [True, False, True, False, False]
    assert on["prefill_budget"] == 512 and on_blend_budget["prefill_budget"] == full["prefill_budget"] == 4096
    # With vLLM's own prefill budget the hybrid manager holds far more of the windowed layers'
    # requests in the same memory; with the blend engine's (the whole context) about what it holds without.
    assert on["kv_tokens"] > 1.2 * off["kv_tokens"] and on["max_concurrency"] > 1.2 * off["max_concurrency"]
    assert abs(on_blend_budget["kv_tokens"] / off["kv_tokens"] - 1) < 0.05
    assert full["kv_tokens"] == blend["kv_tokens"] == off["kv_tokens"]  # the blend engine: every layer, every token
    for row in report["rows"].values():
        assert row["prefill_s"] > 0
    text = path.with_suffix(".md").read_text()
    assert "| plain vLLM, its own prefill budget, hybrid manager on | on |" in text and "Memory:" in text
    assert "benchmarks hma" in (ROOT / "Makefile").read_text().split("bench:")[1].split("\n\n")[0]
