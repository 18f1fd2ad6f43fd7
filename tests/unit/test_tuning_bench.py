"""``benchmarks tuning``'s pages: they say how far a share from their number of questions can be trusted, and
where the default row's ratio came from, as the run recorded it."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from benchmarks.tuning import main, markdown, noise, summary
from blend_integrations.config import CALIBRATION_SOURCES

BOUNDS = Path(__file__).resolve().parents[2] / "docs" / "results" / "tuning-bounds"
RESULT = BOUNDS / "cloze200"


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


def _labels(report: dict) -> dict[tuple[str, str], str]:
    """(model, mode) -> the mode's label in the page's table, in the JSON's order of rows."""
    rows = [line.split(" | ") for line in markdown(report).splitlines() if line.startswith(("| untuned", "| tuned"))]
    keys = [(name, mode) for name, modes in report["held_out"].items() for mode in modes]
    assert len(rows) == len(keys)
    return {key: row[1] for key, row in zip(keys, rows)}


def test_a_default_row_says_calibrated_only_where_its_ratio_was_a_calibration():
    # the bounds runs were not calibrated: the tuned model's default blended at the fallback ratio
    report = json.loads((BOUNDS / "cloze" / "tuning-transformers.json").read_text())
    labels = _labels(report)
    assert labels[("tuned", "default (calibrated)")] == "default (fallback 0.15)"
    assert labels[("untuned", "default (calibrated)")] == "default (packaged calibration)"
    for (name, mode), label in labels.items():
        calibrated = bool(set(report["held_out"][name][mode]["ratio_source"]) & set(CALIBRATION_SOURCES))
        assert ("calibrat" in label) == calibrated, (name, mode, label)


def test_the_bounds_pages_are_what_render_writes_from_their_results(tmp_path):
    # their numbers are the JSON's and their labels the code's; a note written after the table is kept
    for result in sorted(BOUNDS.glob("*/tuning-*.json")):
        copy = tmp_path / result.parent.name
        copy.mkdir()
        shutil.copy(result, copy / result.name)
        shutil.copy(result.with_suffix(".md"), copy / result.with_suffix(".md").name)
        main(["--render", str(copy / result.name)])
        assert (copy / result.with_suffix(".md").name).read_text() == result.with_suffix(".md").read_text(), result
    assert "It was not calibrated" in (tmp_path / "cloze" / "tuning-transformers.md").read_text()
