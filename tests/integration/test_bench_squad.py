"""The SQuAD benchmark (``python -m benchmarks squad``): a small run on the real data and a real
engine writes its pages, and a request that was not blended is never scored or timed as a blend."""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks.squad import Answer, loss_bound, summarize


def test_a_small_run_writes_its_pages(model_dirs, tmp_path):
    from tests.fixtures.commands import ROOT

    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "benchmarks", "squad", "--model", model_dirs("llama"), "--backend", "transformers"]
    cmd += ["--questions", "3", "--docs", "2", "3", "--selections", "deviation", "query", "--ratios", "0.5"]
    done = subprocess.run(cmd + ["--out", str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    (page,) = out.glob("squad-*-transformers-float32.json")
    report = json.loads(page.read_text())
    assert set(report["modes"]) == {"full", "reuse", "auto", "deviation@0.5", "query@0.5"}
    c = report["config"]
    assert (c["split"], c["seed"], c["questions"]) == ("dev", 75, 3) and c["retrieval"]["n_docs"] == [2, 3]
    assert report["modes"]["full"]["blended"] is None and report["modes"]["deviation@0.5"]["blended"] == 3
    assert len(report["questions"]) == 3 and set(report["questions"][0]["replies"]) == set(report["modes"])
    text = page.with_suffix(".md").read_text()
    assert "| deviation@0.5 | 3 | 0 | 0 |" in text and page.with_suffix(".png").is_file()
    summary = (out / "squad.md").read_text()
    assert f"]({page.stem}.md) | transformers, float32 | dev, 3 |" in summary


def answer(served: str, f1: float, ttft: float, agree: bool = True) -> Answer:
    return Answer(served, f1, f1, agree, ttft, 0.15 if served == "blend" else None)


def test_a_request_not_blended_is_counted_apart_never_scored_or_timed():
    full = [answer("full", 1.0, 4.0), answer("full", 0.5, 4.0), answer("full", 1.0, 8.0)]
    # the second fell back (vLLM computed it: full prefill's time and answer), the third ran in full
    mode = [answer("blend", 0.5, 1.0, False), answer("fallback", 0.5, 4.0), answer("full", 1.0, 8.0)]
    row = summarize({"full": full, "deviation@0.15": mode}, confidence=0.8)["deviation@0.15"]
    assert (row["blended"], row["fallback"], row["ran_full"]) == (1, 1, 1)
    # scored and timed on the one blended request: against full prefill's on the same question
    assert (row["f1"], row["full_f1"], row["f1_loss"], row["agreement"]) == (0.5, 1.0, 0.5, 0.0)
    assert (row["ttft_s"], row["ttft_speedup"]) == (1.0, 4.0)


def test_the_loss_bound_is_a_seeded_paired_bootstrap():
    full, mode = [1.0] * 10, [1.0] * 9 + [0.0]
    assert loss_bound(full, mode, 0.8) == loss_bound(full, mode, 0.8) >= 0.1  # the mean loss, or more
    assert loss_bound(full, full, 0.8) == 0.0
    assert loss_bound(full, mode, 0.99) >= loss_bound(full, mode, 0.8)


def test_a_stopped_run_resumes_from_its_checkpoint_only_if_it_asks_the_same(tmp_path, capsys):
    from benchmarks.squad import checkpoint, resume

    key = {"model": "m", "backend": "vllm", "dtype": "float32", "cpu": "c", "ids": ["a", "b"], "tokens": 4}
    key["modes"] = {"full": {"mode": "full"}, "deviation@0.15": {"recompute_ratio": 0.15, "check_layers": [1]}}
    path = tmp_path / ".squad.partial.json"
    assert resume(path, key) == ({"full": [], "deviation@0.15": []}, [])  # nothing asked yet
    rows = {"full": [answer("full", 1.0, 2.0)], "deviation@0.15": [answer("blend", 0.5, 1.0)]}
    replies = [{"id": "a", "answers": ["x"], "gold_rank": 0, "replies": {"full": "x", "deviation@0.15": "y"}}]
    checkpoint(path, key, rows, replies)
    assert resume(path, key) == (rows, replies)
    for changed in ({"ids": ["a", "c"]}, {"cpu": "another"}, {"modes": {"full": {"mode": "full"}}}):
        assert resume(path, key | changed)[1] == [] and "of another run: starting over" in capsys.readouterr().out
    path.write_text("{not json")  # a damaged checkpoint is no checkpoint
    assert resume(path, key)[1] == []
