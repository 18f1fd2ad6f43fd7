"""Run one documentation page's code samples in order, as a reader would.

    python tests/docs_runner.py PAGE.md MODEL_DIR

Python samples share one namespace (a page is one session); shell samples run
with bash (``make``, benchmark and training commands in the checkout, the rest where the page runs).
The model placeholder ``path/or/hub-id`` is replaced by MODEL_DIR.
A comment line right before a sample can change how it runs:

- ``<!-- docs-test: background -->``: a server command; it is started in the
  background, the page goes on once ``http://127.0.0.1:PORT/health`` answers
  (PORT from ``--port``), and it is stopped when the page ends.
- ``<!-- docs-test: skip, REASON -->``: not run (only for ``make test``, which
  is the command that runs this, and ``make demo``, which
  tests/integration/test_examples.py runs and checks).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PLACEHOLDER = "path/or/hub-id"
ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"(?:<!-- docs-test: (?P<directive>[^>]*?) -->\n)?```(?P<lang>\w*)\n(?P<code>.*?)```", re.S)


def samples(page: Path) -> list[tuple[str, str, str]]:
    """(language, code, directive) for every fenced block of the page, in order."""
    return [(m["lang"], m["code"], (m["directive"] or "").strip()) for m in FENCE.finditer(page.read_text())]


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the background command exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"nothing answered on port {port} within {timeout:.0f} s")


def main(page: Path, model: str) -> None:
    namespace: dict = {"__name__": "__main__"}
    background: list[subprocess.Popen] = []
    try:
        for i, (lang, code, directive) in enumerate(samples(page)):
            code = code.replace(PLACEHOLDER, model)
            if directive.startswith("skip"):
                continue
            print(f"--- {page.name} sample {i} ({lang})", flush=True)
            if lang == "python":
                exec(compile(code, f"{page.name}:sample{i}", "exec"), namespace)
            elif lang in ("bash", "sh", "shell"):
                if directive == "background":
                    proc = subprocess.Popen(["bash", "-c", "exec " + code.strip()], start_new_session=True)
                    background.append(proc)
                    wait_healthy(int(re.search(r"--port[ =](\d+)", code)[1]), proc)
                else:
                    # make targets, benchmarks and training are the checkout's, not the installed package's
                    cwd = ROOT if code.startswith(("make ", "python -m benchmarks", "python -m training")) else None
                    subprocess.run(["bash", "-ec", code], check=True, cwd=cwd)
    finally:
        for proc in background:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
