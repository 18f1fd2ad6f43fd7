"""The ttft benchmark on a tiny random model: several codecs' stores in one run
against one full prefill per round, and one codec as before."""

from __future__ import annotations

import json
import os

from tests.fixtures.commands import run_python

# two layers of width 64, a prompt of 2 chunks of 32 tokens, one timed round
TINY = ["--layers", "2", "--hidden", "64", "--heads", "2", "--kv-heads", "1", "--chunks", "2"]
TINY += ["--chunk-tokens", "32", "--repeats", "1", "--ratios", "0.5", "--device", "cpu"]
MODES = ["full", "reuse", "blend@0.50", "blend@0.50 query", "reuse (disk)", "blend@0.15 (disk)"]


def test_codecs_side_by_side_in_one_run(tmp_path):
    env = dict(os.environ, HOME=str(tmp_path), HF_HUB_OFFLINE="1")  # the small model is built under HOME
    out = tmp_path / "results"
    run_python("-m", "benchmarks", "ttft", *TINY, "--kv-codec", "raw", "int8", "--out", str(out), env=env, timeout=900)
    assert sorted(p.name for p in out.iterdir()) == ["ttft-codecs.json", "ttft-codecs.md"]
    report = json.loads((out / "ttft-codecs.json").read_text())
    assert report["config"]["kv_codecs"] == ["raw", "int8"] and "kv_codec" not in report["config"]
    results = report["results"]
    assert list(results) == ["raw", "int8"]
    for codec in ("raw", "int8"):
        assert list(results[codec]) == MODES, codec
        assert results[codec]["reuse"]["cached_tokens"] > 0 and results[codec]["full"]["cached_tokens"] == 0
    # full prefill is one measurement per round, shared: two would not time alike to the nanosecond
    timed = ("ttft_ms", "ttft_min_ms", "ttft_max_ms", "speedup")
    assert [results["raw"]["full"][k] for k in timed] == [results["int8"]["full"][k] for k in timed]
    # while each codec's own modes were timed apart
    assert results["raw"]["reuse"]["ttft_ms"] != results["int8"]["reuse"]["ttft_ms"]
    text = (out / "ttft-codecs.md").read_text()
    assert "--kv-codec raw int8" in text and "walk decodes every layer on every reuse" in text
    full_ms = round(results["raw"]["full"]["ttft_ms"])
    assert f"| full | {full_ms} | 1.00x | {full_ms} | 1.00x |" in text
    assert all(f"| {mode} |" in text for mode in MODES)


def test_one_codec_writes_its_own_results(tmp_path):
    env = dict(os.environ, HOME=str(tmp_path), HF_HUB_OFFLINE="1")
    out = tmp_path / "results"
    run_python("-m", "benchmarks", "ttft", *TINY, "--kv-codec", "int8", "--out", str(out), env=env, timeout=900)
    assert sorted(p.name for p in out.iterdir()) == ["ttft-int8.json", "ttft-int8.md", "ttft-int8.png"]
    report = json.loads((out / "ttft-int8.json").read_text())
    assert report["config"]["kv_codec"] == "int8" and report["config"]["results"] == "ttft-int8"
    assert list(report["results"]) == MODES  # modes by name, as before the codecs side by side


def test_codecs_refused_by_name(tmp_path):
    env = dict(os.environ, HOME=str(tmp_path), HF_HUB_OFFLINE="1")
    args = ["-m", "benchmarks", "ttft", *TINY, "--out", str(tmp_path)]  # were it to run: tiny, and not in docs
    unknown = run_python(*args, "--kv-codec", "int4", env=env, timeout=300, returncode=2)
    assert "invalid choice: 'int4'" in unknown.stderr and "'raw', 'fp8', 'int8'" in unknown.stderr
    twice = run_python(*args, "--kv-codec", "int8", "raw", "int8", env=env, timeout=300, returncode=2)
    assert "a codec given twice" in twice.stderr
