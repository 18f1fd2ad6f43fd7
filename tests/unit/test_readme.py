"""The README reads at a glance: short, the two commands on top, every number rendered from docs/results/
by ``python -m benchmarks readme``, a LICENSE, and no broken links."""

import re
import shutil
from pathlib import Path

import pytest

from benchmarks import readme

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

RELATIVE_LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_BLOCK = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK_TARGET = re.compile(r"\]\([^)\s]*\)")
# what a measurement looks like in prose: a speedup (3.86x), a share (95%), a time (9 min, 791 ms) or a
# decimal (0.95); not a version's lower bound (3.11+) nor the digits of a name (SmolLM2-135M, Apache-2.0)
MEASURED = re.compile(
    r"(?<![\w.-])\d+(?:\.\d+)?(?:x\b|%|\s?(?:ms|s|sec|seconds?|min|minutes?|h|hours?)\b)"
    r"|(?<![\w.-])\d+\.\d+(?![\d+.\w])"
)


def text() -> str:
    return README.read_text(encoding="utf-8")


def prose(markdown: str) -> str:
    """The README less its code, its link targets and the blocks the script renders."""
    markdown = readme.BLOCK.sub("", markdown)
    markdown = CODE_BLOCK.sub("", markdown)
    markdown = INLINE_CODE.sub("", markdown)
    return LINK_TARGET.sub("]", markdown)


def slug(heading: str) -> str:
    """A heading's anchor, as GitHub and mkdocs' toc make it."""
    heading = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"\s+", "-", heading)


def test_readme_is_at_most_150_lines():
    assert len(text().splitlines()) <= 150


def test_make_demo_and_make_test_are_in_the_first_25_lines():
    top = "\n".join(text().splitlines()[:25])
    assert "`make demo`" in top
    assert "`make test`" in top


def test_license_is_the_apache_license_2_0():
    license_text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert "[LICENSE](LICENSE)" in text()


def test_generated_blocks_are_what_the_script_renders():
    current = text()
    rendered = readme.render(current)
    assert rendered == current, "README.md is stale or edited by hand: run `python -m benchmarks readme`"


def test_render_undoes_a_hand_edit_of_a_generated_block():
    current = text()
    block = readme.BLOCK.search(current[current.index("<!-- readme:gains -->") :])
    assert block is not None and re.search(r"\d\.\d\dx", block.group("body"))
    edited = current.replace(block.group("body"), re.sub(r"\d\.\d\dx", "9.99x", block.group("body")))
    assert edited != current
    assert readme.render(edited) == readme.render(current)


def test_render_names_the_missing_results_and_the_command_that_makes_them(tmp_path):
    for path in readme.RESULTS.glob("*.json"):
        if path.name != "newcomer.json":
            shutil.copy(path, tmp_path / path.name)
    with pytest.raises(FileNotFoundError, match=r"newcomer\.json.*python -m benchmarks newcomer"):
        readme.render(text(), tmp_path)


def test_render_refuses_a_readme_without_its_blocks():
    with pytest.raises(ValueError, match="gains"):
        readme.render(text().replace("<!-- readme:gains -->", "<!-- gains -->"))


def test_no_measured_number_is_written_by_hand():
    found = MEASURED.findall(prose(text()))
    assert not found, f"numbers outside the generated blocks (render them from docs/results/): {found}"


def test_the_measured_number_check_can_fail():
    sample = "Blend is 3.86x sooner, agrees on 95% and 0.95 of prompts, in 9 min; Python 3.11+, SmolLM2-135M."
    assert MEASURED.findall(prose(sample)) == ["3.86x", "95%", "0.95", "9 min"]
    assert MEASURED.findall(prose("<!-- readme:gains -->\n| 3.86x |\n<!-- /readme:gains -->\n")) == []


def test_relative_links_point_to_existing_files_and_headings():
    for target in RELATIVE_LINK.findall(text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = ROOT / path if path else README
        assert file.is_file(), f"README.md links to {target}, which does not exist"
        if anchor and file.suffix == ".md":
            headings = re.findall(r"^#+\s+(.+)$", CODE_BLOCK.sub("", file.read_text(encoding="utf-8")), re.M)
            assert anchor in {slug(h) for h in headings}, f"README.md links to {target}: no such heading"
