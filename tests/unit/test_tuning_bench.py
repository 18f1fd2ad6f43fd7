"""``benchmarks tuning``'s pages: they say how far a share from their number of questions can be trusted."""

from __future__ import annotations

import json
import random
from pathlib import Path

from benchmarks.tuning import markdown, noise, summary

RESULT = Path(__file__).resolve().parents[2] / "docs" / "results" / "tuning-bounds" / "cloze200"


def _spread(n: int, trials: int = 4000) -> float:
    """Half the width of the middle 95% of shares from ``n`` fair coin flips, by simulation."""
    rng = random.Random(0)
    shares = sorted(sum(rng.random() < 0.5 for _ in range(n)) / n for _ in range(trials))
    return (shares[int(0.975 * trials)] - shares[int(0.025 * trials)]) / 2


def test_the_stated_noise_is_what_coin_flips_show_and_shrinks_with_more_questions():
    for n in (60, 300):
        stated = float(noise(n).split("±")[1].split(" ")[0])
        assert abs(stated - _spread(n)) <= 0.015, (n, stated, _spread(n))
    assert float(noise(300).split("±")[1].split(" ")[0]) < float(noise(60).split("±")[1].split(" ")[0])


def test_both_pages_state_the_noise_of_their_question_count(tmp_path):
    report = json.loads((RESULT / "tuning-transformers.json").read_text())
    n = report["config"]["questions"]
    assert noise(n) in markdown(report)
    (tmp_path / "tuning-transformers.json").write_text(json.dumps(report))
    assert noise(n) in summary(tmp_path).read_text()
