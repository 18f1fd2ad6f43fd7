"""What the repository tracks: plain files inside the checkout, so that a fresh clone is the same on every machine."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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
