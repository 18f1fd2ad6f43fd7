"""The live-check benchmark (``python -m benchmarks live-check``): a small run on the real models
writes its page, with each stream's ratio, its agreement asked apart from the checks, and the
arrivals' times with checks on."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def bench(tmp_path, *args: str) -> Path:
    """Run ``python -m benchmarks ARGS`` from the checkout; the folder it wrote its results to."""
    from tests.fixtures.commands import ROOT

    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "benchmarks", *args, "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def test_a_small_run_writes_its_page(tmp_path):
    out = bench(tmp_path, "live-check", "--backend", "transformers", "--requests", "3", "--arrivals", "20")
    report = json.loads((out / "live-check-transformers.json").read_text())
    loses, holds = report["loses"], report["holds"]
    # every request of the stream that loses answers is checked (share 1) and starts at the fallback
    assert loses["start_ratio"] == 0.15 and loses["checks"]["checked"] == loses["blended"] == 3
    assert len(loses["ratios"]) == len(loses["agrees"]) == 3 and holds["requests"] == 3
    page = (out / "live-check-transformers.md").read_text()
    # the reader at the policy its calibration chose (docs/results/records/), kept as a user's own: the live
    # check never steps it (a guard gives each request its own ratio all the same)
    assert holds["steps"] == []
    assert "blend_integrations/quality/reader, at the policy its calibration chose (0.15 " in page
    # arrivals at the default risk: where the checks ran is said, and the users' times compared
    assert report["config"]["risk"] == 0.05
    assert report["arrivals"]["failed"] == {"checks on": 0, "checks off": 0}
    # 10 requests, each asked with checks on and off: each is a paired ratio
    arrivals = report["arrivals"]
    assert arrivals["ttft"]["checks on"]["n"] == arrivals["ttft"]["checks off"]["n"] == 10
    assert arrivals["paired"]["n"] == 10 and arrivals["paired"]["median"] > 0, arrivals["paired"]
    assert " of them ended while users were arriving, the rest in the pause after a block." in page
    assert "- No user slower (the goal): time to first token with checks on over off, paired by request " in page
    assert "each block asked with checks on and off one after the other" in page
    assert "| loses | SmolLM2-135M-Instruct, uncalibrated copy | 1 | 3 | 0.15 → " in page
    assert "- Where the policy loses answers: after request " in page and "- Where it holds: the checks cost" in page
    # what users got after the last step: every answer, blended or run in full
    later = loses["agreement_after_last_step"]
    assert later["n"] == 3 - loses["settled_at_request"] >= 1 and loses["blended_after_last_step"] <= later["n"]
    assert (out / "live-check-transformers.png").is_file()
    # the page is rendered again from its JSON, unchanged
    from benchmarks import live_check

    live_check.main(["--render", str(out / "live-check-transformers.json")])
    assert (out / "live-check-transformers.md").read_text() == page


def test_a_small_run_on_the_server_writes_its_page(tmp_path):
    """``--server``: a server with checks on, then one with checks off, on one store; users stream
    their requests over HTTP. The reader's calibrated policy is checked at an eighth of the share,
    so the 8 answers the server with checks on blends (3 untimed, 5 timed) bring exactly one check."""
    out = bench(tmp_path, "live-check", "--server", "--server-rounds", "1", "--arrivals", "10", "--risk", "1")
    report = json.loads((out / "live-check-served-vllm-risk-1.json").read_text())  # a risk of its own: its own page
    served = report["served"]
    assert served["failed"] == {"checks on": 0, "checks off": 0}
    assert served["ttft"]["checks on"]["n"] == served["ttft"]["checks off"]["n"] == 5
    # both servers of the pair were asked the same 5 requests: each is a paired ratio
    assert served["paired"]["n"] == 5 and served["paired"]["median"] > 0, served["paired"]
    on, off = served["checks"]["1: checks on"], served["checks"]["2: checks off"]
    assert on["agreed"] + on["disagreed"] == 1 and on["failed"] == on["dropped"] == 0, on
    assert not any(off[k] for k in ("agreed", "disagreed", "failed", "preempted", "dropped")), off
    assert on["ttft_p50"] > 0 and off["ttft_p50"] > 0
    page = (out / "live-check-served-vllm-risk-1.md").read_text()
    assert "streamed over HTTP, on 2 servers one after another on one store" in page
    assert (
        f"| 1: checks on | {on['ttft_p50']} | " in page
        and "- No user slower (the goal): time to first token with checks on over off, paired by request" in page
    )
    # a control run (no checks on any server) says so, and has a page of its own
    from benchmarks import live_check, live_check_served

    control = live_check_served.markdown({**report, "config": {**report["config"], "arrivals_share": 0.0}})
    assert "a control, every server with `--quality-check 0`" in control and "No user slower" not in control
    assert "- A control (no checks on any server): time to first token with checks on over off" in control
    # the page is rendered again from its JSON, unchanged; a page from before the arrivals were paired
    # (no "paired", no server's own TTFT) keeps its own wording
    live_check.main(["--render", str(out / "live-check-served-vllm-risk-1.json")])
    assert (out / "live-check-served-vllm-risk-1.md").read_text() == page
    checks = {name: {k: v for k, v in c.items() if k != "ttft_p50"} for name, c in served["checks"].items()}
    older = {k: v for k, v in served.items() if k != "paired"} | {"checks": checks}
    unpaired = live_check_served.markdown({**report, "served": older})
    assert "one after another on one store (each asked its own requests): checks on" in unpaired
    assert "| server | checks agreed |" in unpaired and "paired by request" not in unpaired
    assert "at the median, " in unpaired and "the arms' median" in page
    for argv, part in (
        (["--server"], "live-check-served-vllm"),
        (["--server", "--arrivals-share", "0"], "live-check-served-vllm-share-0"),
        (["--server", "--arrivals-share", "0.5", "--risk", "1"], "live-check-served-vllm-share-0.5-risk-1"),
        ([], "live-check-vllm"),
        (["--risk", "1"], "live-check-vllm-risk-1"),
    ):
        args = argparse.Namespace(
            server="--server" in argv,
            backend="vllm",
            arrivals_share=1.0,
            risk=live_check.BlendConfig().quality_check_risk,
        )
        options = [a for a in argv if a != "--server"]
        for name, value in zip(options[::2], options[1::2], strict=True):
            setattr(args, name.removeprefix("--").replace("-", "_"), float(value))
        assert live_check.page_name(args) == part


def test_the_paired_ratios_median_has_a_distribution_free_interval():
    """The order statistics of the sign test's table: ranks 42 and 59 of 100 at 90%, 40 and 61 at 95%;
    with 5 ratios the extremes at 90% (coverage 1 - 2/32), with 4 none."""
    from benchmarks.paired import median_interval, paired

    ranks = [float(r) for r in range(1, 101)]
    assert median_interval(ranks[::-1]) == (42.0, 59.0)
    assert median_interval(ranks, confidence=0.95) == (40.0, 61.0)
    assert median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0)
    assert median_interval([1.0, 2.0, 3.0, 4.0]) is None
    # only the requests both arms answered are paired
    assert paired({1: 2.0, 2: 1.0, 3: 9.0}, {1: 1.0, 2: 1.0}) == {
        "n": 2,
        "median": 1.5,
        "interval": None,
        "confidence": 0.9,
    }


def test_the_walk_benchmark_compares_the_checks_walk_with_vllms_full_prefill(tmp_path):
    """``check-walk``: in float32 the live check's walk gives vLLM's own full prefill's first tokens."""
    out = bench(tmp_path, "check-walk", "--models", "smollm2", "--dtypes", "float32", "--prompts", "2")
    (run,) = json.loads((out / "check-walk.json").read_text())["runs"]
    assert (run["dtype"], run["prompts"], run["same"], run["differs_at"]) == ("float32", 2, 2, [])
    assert run["mean_prompt_tokens"] > 100
    assert "| SmolLM2-135M-Instruct" in (out / "check-walk.md").read_text()
