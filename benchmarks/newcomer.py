"""A newcomer's path, timed: the README's two commands on a fresh clone.

Clones the checkout's committed HEAD into a temporary folder, with a new
home folder (so no model conversion or virtual environment is left from an
earlier run; pip's download cache is kept, as on a machine that installed
anything before), and runs there, timed, what the README says:

1. ``make install``: the environment both commands set up first (``.venv``
   in the clone, the demo model fetched and converted);
2. ``make demo``: the RAG question through LangChain on the embedded vLLM
   engine, blend against full prefill;
3. with ``--test``, ``make test``: lint, the tests, and the frameworks'
   environment and tests (most of an hour on 2 CPUs).

    python -m benchmarks newcomer [--test] [--keep] [--out docs/results]

Writes ``newcomer.json`` and ``newcomer.md`` (the README's command times come
from them: ``python -m benchmarks readme``). A step that fails stops the run,
and its output's end is printed; nothing is written then.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import machine, write_results

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
TAIL = 40  # lines of a step's output kept in the results


def clone(into: Path) -> str:
    """A fresh clone of the checkout's HEAD in ``into``; returns its commit."""
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(into)], check=True)
    return subprocess.run(
        ["git", "-C", str(into), "rev-parse", "--short", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()


def step(command: list[str], cwd: Path, env: dict) -> dict:
    """Run one README command, timed, its output kept in the clone's folder and its end returned."""
    print(f"$ {' '.join(command)}", flush=True)
    log = cwd / f".newcomer-{command[-1]}.log"
    started = time.perf_counter()
    with open(log, "w") as out:
        rc = subprocess.run(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    seconds = time.perf_counter() - started
    tail = log.read_text(errors="replace").splitlines()[-TAIL:]
    print(f"  rc {rc} after {seconds:.0f} s", flush=True)
    return {"command": " ".join(command), "seconds": round(seconds, 1), "rc": rc, "tail": tail}


def run(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="blend-newcomer-"))
    home, checkout = work / "home", work / "blend_integrations"
    home.mkdir()
    pip_cache = subprocess.run(
        [sys.executable, "-m", "pip", "cache", "dir"], capture_output=True, text=True, check=False
    ).stdout.strip()
    env = {k: v for k, v in os.environ.items() if k not in ("VENV", "FRAMEWORKS_VENV", "VIRTUAL_ENV", "LD_PRELOAD")}
    env.update(HOME=str(home), PIP_CACHE_DIR=os.environ.get("PIP_CACHE_DIR") or pip_cache or str(work / "pip"))
    try:
        commit = clone(checkout)
        steps = {}
        for name in ("install", "demo", *(["test"] if args.test else [])):
            steps[name] = step(["make", name], checkout, env)
            if steps[name]["rc"] != 0:
                print("\n".join(steps[name]["tail"]), file=sys.stderr)
                sys.exit(f"`make {name}` failed on a fresh clone of {commit}; nothing written")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept: {work}")
    return {
        "config": {
            "commit": commit,
            "date": time.strftime("%Y-%m-%d"),
            "cpu": machine(),
            "cpus": len(os.sched_getaffinity(0)),
        },
        "steps": steps,
    }


def markdown(report: dict) -> str:
    c = report["config"]
    lines = [
        f"A fresh clone of {c['commit']} on {c['cpu']}, {c['date']}: no virtual environment and no converted model "
        "left from an earlier run (a new home folder); pip's download cache kept.",
        "",
        "| command | time | exit |",
        "|---|---:|---:|",
    ]
    for s in report["steps"].values():
        at = f" (at {s['commit']})" if "commit" in s else ""
        lines.append(f"| `{s['command']}`{at} | {s['seconds'] / 60:.1f} min ({s['seconds']:.0f} s) | {s['rc']} |")
    for s in report["steps"].values():
        if s.get("tail"):
            lines += ["", f"The end of `{s['command']}`'s output:", "", "```", *s["tail"], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks newcomer", description=__doc__.splitlines()[0])
    parser.add_argument("--test", action="store_true", help="also time `make test` (most of an hour on 2 CPUs)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary clone and home folder")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    report = run(args)
    previous = args.out / "newcomer.json"
    if not args.test and previous.is_file():  # keep the last `make test` timed, saying from which commit
        old = json.loads(previous.read_text())
        if "test" in old["steps"]:
            report["steps"]["test"] = {**old["steps"]["test"], "commit": old["config"]["commit"], "tail": []}
    write_results(
        args.out,
        "newcomer",
        "A newcomer's path: the README's commands on a fresh clone",
        markdown(report),
        report,
        command=f"`python -m benchmarks newcomer {' '.join(argv or [])}`",
    )


if __name__ == "__main__":
    main()
