"""What the repository tracks: plain files inside the checkout, so that a fresh clone is the same on every machine;
CI walks the README's path, so that what a fresh machine needs is installed by `make test` itself; and no source
module is over 500 lines, so that each can be read whole (issue 77)."""

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# anything that installs system software (pip's own installs are the Makefile's)
SYSTEM_INSTALL = re.compile(r"\b(apt-get|apt|dpkg|dnf|yum|apk|brew|snap)\b")
SOURCE_PACKAGES = ("blend_integrations", "benchmarks", "training")
MAX_MODULE_LINES = 500


def tracked() -> list[tuple[str, str]]:
    """(git mode, path) of every file the index tracks."""
    out = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-s", "-z"], check=True, capture_output=True, text=True
    ).stdout
    entries = []
    for entry in filter(None, out.split("\0")):
        meta, path = entry.split("\t", 1)
        entries.append((meta.split()[0], path))
    return entries


def test_the_tree_tracks_no_symbolic_link_nor_submodule():
    entries = tracked()
    assert len(entries) > 100, "git ls-files found too few files: is this a checkout?"
    links = [path for mode, path in entries if mode == "120000"]
    submodules = [path for mode, path in entries if mode == "160000"]
    assert not links, f"tracked symbolic links (a clone gets a link where the Makefile makes a folder): {links}"
    assert not submodules, f"tracked submodules: {submodules}"


def test_every_tracked_path_stays_inside_the_checkout():
    root = ROOT.resolve()
    # a tracked path under a folder that is a link on disk resolves elsewhere
    outside = [path for _, path in tracked() if not (ROOT / path).resolve().is_relative_to(root)]
    assert not outside, f"tracked paths that resolve outside the checkout: {outside}"


def prerequisites(makefile: str, target: str) -> list[str]:
    """A rule's prerequisites, as its ``target: ...`` line names them."""
    rule = re.search(rf"^{re.escape(target)}:(?!=)(.*)$", makefile, re.MULTILINE)
    assert rule is not None, f"the Makefile has no {target} rule"
    return rule.group(1).split()


def test_make_test_installs_the_system_packages_and_ci_installs_nothing_itself():
    # CI must fail where a newcomer's `make test` would: were .ci/run to install a package, a fresh
    # machine following the README could lack it while CI stays green
    assert "system-packages" in prerequisites((ROOT / "Makefile").read_text(), "test")
    commands = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if not line.lstrip().startswith("#")]
    assert not [line for line in commands if SYSTEM_INSTALL.search(line)], ".ci/run installs system packages itself"
    assert any(re.match(r"\s*make test\b", line) for line in commands), ".ci/run does not run `make test`"


def test_system_packages_stops_and_names_the_command_where_it_cannot_install(tmp_path):
    # a machine without apt-get, redis-server or chromium: only what the recipe itself runs is on PATH
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("make", "grep", "id"):
        found = shutil.which(tool)
        assert found is not None, f"{tool} is not installed"
        (bin_dir / tool).symlink_to(found)
    done = subprocess.run(
        ["make", "--no-print-directory", "-C", str(ROOT), "system-packages"],
        env={"PATH": str(bin_dir)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0, done.stdout + done.stderr
    assert re.search(r"sudo apt-get install -y redis-server chromium( libtcmalloc-minimal4)?\n", done.stderr), (
        done.stderr
    )
    assert "installing" not in done.stdout


def test_no_source_module_is_over_500_lines():
    # every module on disk, tracked or not: a new module counts before its first commit
    lengths = {
        path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
        for package in SOURCE_PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    assert len(lengths) > 100, "found too few modules: is this a checkout?"
    over = [f"{path} ({n} lines)" for path, n in lengths.items() if n > MAX_MODULE_LINES]
    assert not over, f"modules over {MAX_MODULE_LINES} lines: split them along their seams: {over}"
