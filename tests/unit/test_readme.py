"""The README's first screen: the two commands on top, a results table from a committed run, and no broken links."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CALIBRATION_RESULTS = ROOT / "docs" / "results" / "calibration.md"

# a number as written in the tables: 0.950, 1.69x, 48; not the digits inside a name such as SmolLM2-135M
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?x?(?!\w|\.\d)")
SPEEDUP = re.compile(r"(?<![\w.])\d+(?:\.\d+)?x(?!\w)")
RELATIVE_LINK = re.compile(r"\]\(([^)\s]+)\)")


def readme_lines():
    return README.read_text(encoding="utf-8").splitlines()


def results_table():
    """The first table whose header mentions agreement and TTFT: (index of its header line, its data rows)."""
    lines = readme_lines()
    for i, line in enumerate(lines):
        if line.startswith("|") and "TTFT" in line and ("agrees" in line or "agreement" in line):
            assert re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1].strip()), (
                "the header is not followed by a separator"
            )
            rows = []
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                rows.append(row)
            return i, rows
    raise AssertionError("README.md has no table whose header mentions agreement and TTFT")


def test_make_demo_and_make_test_are_in_the_first_15_lines():
    top = "\n".join(readme_lines()[:15])
    assert "`make demo`" in top
    assert "`make test`" in top


def test_results_table_is_within_the_first_40_lines_with_a_speedup_per_row():
    header, rows = results_table()
    assert len(rows) >= 4
    assert header + 2 + len(rows) <= 40, "the results table ends after line 40"
    for row in rows:
        assert SPEEDUP.search(row), f"no speedup (a number followed by x) in {row!r}"


def test_results_table_numbers_come_from_the_committed_calibration_run():
    committed = set(NUMBER.findall(CALIBRATION_RESULTS.read_text(encoding="utf-8")))
    _, rows = results_table()
    for row in rows:
        for number in NUMBER.findall(row):
            assert number in committed, f"{number} in README row {row!r} is not in docs/results/calibration.md"


def test_relative_links_point_to_existing_files():
    text = README.read_text(encoding="utf-8")
    for target in RELATIVE_LINK.findall(text):
        if target.startswith(("http://", "https://", "#", "mailto:")):
            continue
        path = target.split("#", 1)[0]
        assert (ROOT / path).is_file(), f"README.md links to {target}, which does not exist"
