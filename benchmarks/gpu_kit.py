"""An offline kit: vLLM's CUDA build for a GPU machine that cannot reach a package index.

    python -m benchmarks.gpu_kit build [--carry-mib N]      # here, with network (make gpu-kit)
    python3 benchmarks/gpu_kit.py check [--partial]         # anywhere: are the pieces whole?
    python3 benchmarks/gpu_kit.py run [--dry-run]           # on the GPU machine, no network

``build`` (benchmarks/gpu_kit_build.py) fetches ``vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl``
(CUDA 13, 311 MiB) and installs it with the packages the GPU machine lacks into one tree, without
the parts no dense model on a Hopper GPU imports, adds this package's entry point and a
``redis-server`` for the engine tests, packs the tree as one tar.xz and splits it into carry folders
``.kit/a``, ``.kit/b``, ... of at most ``--carry-mib`` each (by default what a device call carries
beside the checkout), each with the manifest (every piece's name, size and SHA-256, and the Python,
torch and triton the kit was built for).

``run`` checks every piece against the manifest (a missing or damaged piece is refused by name),
then the machine's Python, torch and triton against what the kit was built for (``compare_versions``),
unpacks the tree over the machine's own torch, and runs, within ``--budget-s`` (9 minutes): the
import check of vLLM's compiled parts (benchmarks/gpu_kit_imports.py), the coded-chunk CUDA test,
the vLLM engine tests, and the vLLM TTFT benchmark at Llama-3-8B's shape in bfloat16 at 4k, 16k and
32k tokens (``benchmarks/vllm_ttft.py``). Logs and JSON go to ``$OUT`` (or ``--out``).
``--dry-run`` stops after unpacking and checking the tree: it needs no GPU.

Run as a script (``python3 benchmarks/gpu_kit.py``) it imports nothing but the standard library, so
that ``check`` and ``run`` work before anything is installed (docs/offline-gpu.md); its steps run in
processes of their own.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.metadata
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / ".kit"
VLLM_VERSION = "0.32.0"
FORMAT = 2  # the manifest's layout; 2 added "built_for"
MIB = 2**20


class KitError(Exception):
    """A kit that cannot be used, with what is wrong by name."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(MIB):
            h.update(block)
    return h.hexdigest()


# -- check and unpack (anywhere) ------------------------------------------------------------


def manifest_of(kit: Path) -> dict:
    """The manifest the carry folders agree on."""
    found = {p.parent.name: json.loads(p.read_text()) for p in sorted(kit.glob("*/manifest.json"))}
    if not found:
        raise KitError(
            f"no kit in {kit}: no manifest.json in any folder (build it: python -m benchmarks.gpu_kit build)"
        )
    ids = {folder: m.get("kit_id") for folder, m in found.items()}
    if len(set(ids.values())) > 1:
        raise KitError(f"the carry folders come from different builds: {ids}")
    manifest = next(iter(found.values()))
    if manifest.get("format") != FORMAT:
        raise KitError(f"the kit is of format {manifest.get('format')}, not {FORMAT}: build it again")
    return manifest


def check(kit: Path, *, partial: bool = False) -> dict:
    """The manifest, once every piece is there with its size and SHA-256; a missing or damaged
    piece is refused by name (``partial``: missing pieces are only reported)."""
    manifest = manifest_of(kit)
    problems, missing = [], []
    for p in manifest["pieces"]:
        path = kit / p["folder"] / p["name"]
        if not path.exists():
            missing.append(f"{p['folder']}/{p['name']}")
        elif path.stat().st_size != p["bytes"]:
            problems.append(f"piece {p['folder']}/{p['name']} has {path.stat().st_size} bytes, not {p['bytes']}")
        elif sha256(path) != p["sha256"]:
            problems.append(f"piece {p['folder']}/{p['name']} is damaged: its SHA-256 is not the manifest's")
    if missing and not partial:
        problems += [f"piece {m} is missing (carry its folder)" for m in missing]
    if problems:
        raise KitError("; ".join(problems))
    return {**manifest, "missing": missing}


class Joined(io.RawIOBase):
    """The pieces read as one stream, hashed as they are read."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths, self.file, self.hash = list(paths), None, hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while True:
            if self.file is None:
                if not self.paths:
                    return 0
                self.file = open(self.paths.pop(0), "rb")  # noqa: SIM115 (closed at its end below)
            n = self.file.readinto(buffer)
            if n:
                self.hash.update(memoryview(buffer)[:n])
                return n
            self.file.close()
            self.file = None


def unpack(kit: Path, target: Path) -> dict:
    """The kit's tree in ``target`` (``site`` for PYTHONPATH, ``redis``); again only for another kit."""
    manifest = check(kit)
    stamp = target / "kit_id"
    if stamp.exists() and stamp.read_text() == manifest["kit_id"]:
        return {"target": str(target), "unpacked": False, "seconds": 0.0}
    t0 = time.perf_counter()
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    stream = Joined([kit / p["folder"] / p["name"] for p in manifest["pieces"]])
    try:
        with tarfile.open(fileobj=io.BufferedReader(stream, MIB), mode="r|xz") as tar:
            tar.extractall(target, filter="data")
        problem = None if stream.hash.hexdigest() == manifest["kit_id"] else "their SHA-256 is not the manifest's"
    except (tarfile.TarError, EOFError, OSError) as e:  # lzma's own check of its data, a cut archive
        problem = f"{type(e).__name__}: {e}"
    if problem:
        shutil.rmtree(target)
        raise KitError(f"the joined pieces are not the archive the manifest names: {problem}")
    site = target / "site"
    left = [d["path"] for d in manifest["dropped"] if (site / d["path"]).exists()]
    if left:
        raise KitError(f"dropped parts found in the tree: {left}")
    versions = {d.metadata["Name"]: d.version for d in importlib.metadata.distributions(path=[str(site)])}
    if versions.get("vllm") != VLLM_VERSION:
        raise KitError(f"vllm's dist-info in {site} says {versions.get('vllm')}, not {VLLM_VERSION}")
    stamp.write_text(manifest["kit_id"])
    return {"target": str(target), "unpacked": True, "seconds": time.perf_counter() - t0, "versions": versions}


def check_command(args) -> None:
    try:
        m = check(Path(args.kit), partial=args.partial)
    except KitError as e:
        sys.exit(f"kit refused: {e}")
    here = len(m["pieces"]) - len(m["missing"])
    print(f"kit {m['kit_id'][:12]} (vLLM {m['vllm']['version']}): {here} of {len(m['pieces'])} pieces whole", end="")
    print(f"; missing: {', '.join(m['missing'])}" if m["missing"] else "")


# -- run (on the GPU machine) ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Machine:
    """The versions the steps run on: this Python's, and its torch's and triton's as their packages'
    metadata says (pip list's, without importing them; None: not installed)."""

    python: str
    torch: str | None
    triton: str | None

    @classmethod
    def here(cls) -> Machine:
        def version(name: str) -> str | None:
            try:
                return importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                return None

        return cls(platform.python_version(), version("torch"), version("triton"))


def compare_versions(built_for: dict, machine: Machine) -> tuple[list[str], list[str]]:
    """What differs between ``machine`` and what the kit was built for (the manifest's
    ``built_for``), as (what the steps run with anyway, what refuses the kit); both empty when
    the versions match. The kit's compiled wheels are for one Python, and it carries no torch or
    triton: the steps run on the machine's, whatever vLLM's wheel pins, and the import check
    shows whether vLLM's compiled parts load on them (docs/offline-gpu.md, "The torch pin").
    Without torch or triton, vLLM's CUDA path cannot run at all."""
    notes, refusals = [], []
    python = ".".join(machine.python.split(".")[:2])
    if python != built_for["python"]:
        refusals.append(
            f"Python {machine.python} here, the kit's wheels are for Python {built_for['python']} "
            f"({', '.join(built_for['python_tags'])}): run it with Python {built_for['python']}, or build "
            f"a kit for {python} (DEVICE_PYTHON in benchmarks/gpu_kit_build.py)"
        )
    for name in ("torch", "triton"):
        have, pinned = getattr(machine, name), built_for[name]
        wanted = f"{name}=={pinned}" if pinned else f"no {name} version"
        if have is None:
            refusals.append(
                f"{name} is not installed here, and the kit carries none (vLLM {VLLM_VERSION} pins {wanted}): "
                "run it with the python3 that has torch and triton"
            )
        elif pinned and have.split("+")[0] != pinned:  # a local tag (+cu130) still matches, as for pip
            notes.append(
                f"{name} {have} here, vLLM {VLLM_VERSION} pins {wanted}: the steps run on this machine's "
                f"{name} {have} (the kit carries none); the import check shows whether vLLM's parts load on it"
            )
    return notes, refusals


VLLM_TESTS = ["tests/integration/test_vllm_engine.py"]
CODEC_TEST = "tests/integration/test_cuda.py::test_coded_chunks_are_decoded_on_the_gpu"
MIN_STEP_S = 30  # a step is not started with less of the budget left
TTFT = ["--shape", "llama3-8b", "--dtype", "bfloat16", "--tokens", "4096", "16384", "32768", "--ratio", "0.15"]
IMPORTS_MARK = "GPU_KIT_IMPORTS "  # the line gpu_kit_imports.py ends its output with: the JSON follows


def step_env(target: Path) -> dict:
    """The steps' environment: the checkout, then the kit's tree, over the machine's own packages."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", PYTHONUNBUFFERED="1")
    # vLLM's CUDA sampler imports its FlashInfer attention backend (import flashinfer) unless told not to
    env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(target / "site"), env.get("PYTHONPATH")]))
    redis = target / "redis"
    if shutil.which("redis-server") is None and (redis / "bin" / "redis-server").exists():
        wrapper = redis / "path" / "redis-server"  # the kit's libraries for redis-server alone
        wrapper.parent.mkdir(exist_ok=True)
        wrapper.write_text(
            f'#!/bin/sh\nLD_LIBRARY_PATH="{redis / "lib"}" exec "{redis / "bin" / "redis-server"}" "$@"\n'
        )
        wrapper.chmod(0o755)
        env["PATH"] = f"{wrapper.parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def plan(out: Path) -> list[tuple[str, list[str], int]]:
    """(name, command, most seconds) of each step, in order."""
    py, pytest = sys.executable, [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-rA"]
    return [
        ("imports", [py, str(Path(__file__).with_name("gpu_kit_imports.py"))], 120),
        ("codec-test", [*pytest, "--timeout", "120", CODEC_TEST], 120),
        # eager first: if compiled mode (CUDA graphs, torch.compile) fails, eager's result is already in;
        # the TTFT benchmark (compiled) before the compiled tests: a short budget keeps the numbers
        ("vllm-tests-eager", ["env", "BLEND_TEST_VLLM_EAGER=1", *pytest, "--timeout", "150", *VLLM_TESTS], 240),
        ("ttft", [py, "-m", "benchmarks.vllm_ttft", *TTFT, "--repeats", "3", "--out", str(out)], 360),
        ("vllm-tests", [*pytest, "--timeout", "150", *VLLM_TESTS], 240),
    ]


def run_step(name: str, argv: list[str], seconds: float, log: Path, env: dict) -> dict:
    """Run one step, its output appended to ``log`` after a header line: one log for every step, so
    that a device call's files (8 at most) hold the summary, the log and the TTFT results."""
    t0 = time.monotonic()
    with open(log, "ab") as f:
        f.write(f"== step {name}: {' '.join(argv)}\n".encode())
        f.flush()
        start = f.tell()
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc, timed_out = proc.wait(timeout=seconds), False
        except subprocess.TimeoutExpired:
            for sig, wait in ((15, 15), (9, 15)):  # the step's whole process group: vLLM's processes too
                try:
                    os.killpg(proc.pid, sig)
                    rc = proc.wait(timeout=wait)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    rc = proc.returncode
            timed_out = True
    with open(log, "rb") as f:
        f.seek(max(start, log.stat().st_size - 8000))
        tail = f.read().decode(errors="replace").splitlines()[-25:]
    seconds = round(time.monotonic() - t0, 1)
    return {"rc": rc, "timed_out": timed_out, "seconds": seconds, "log": log.name, "log_from_byte": start, "tail": tail}


def render(summary: dict) -> str:
    lines = ["# The offline kit on the GPU machine", "", f"Run {summary['started']}, budget {summary['budget_s']} s."]
    notes = summary.get("versions", {}).get("notes", [])
    lines += ["", *(f"- {note}" for note in notes)] if notes else []
    if "error" in summary:
        return "\n".join([*lines, "", f"Kit refused: {summary['error']}", ""])
    lines += ["", "| step | outcome | seconds |", "|---|---|---:|"]
    for s in summary["steps"]:
        outcome = "skipped: " + s["skipped"] if "skipped" in s else "timed out" if s["timed_out"] else f"rc {s['rc']}"
        lines.append(f"| {s['name']} | {outcome} | {s.get('seconds', 0)} |")
    if summary.get("imports"):
        lines += ["", "| import | result |", "|---|---|"]
        for name, r in summary["imports"].items():
            lines.append(
                f"| {name} | {'ok: ' + json.dumps(r['value']) if r['ok'] else r['error']} |".replace("\n", " ")
            )
    return "\n".join(lines) + "\n"


def run(args, machine: Machine) -> None:
    kit, target = Path(args.kit), Path(args.target)
    out = Path(args.out or os.environ.get("OUT") or KIT / "results")
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    summary: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "budget_s": args.budget_s, "steps": []}

    def save() -> None:
        (out / "gpu_kit.json").write_text(json.dumps(summary, indent=1) + "\n")
        (out / "gpu_kit.md").write_text(render(summary))

    try:
        manifest = check(kit)
        built_for = manifest["built_for"]
        summary["kit"] = {"kit_id": manifest["kit_id"], "vllm": manifest["vllm"]["version"], "built_for": built_for}
        notes, refusals = compare_versions(built_for, machine)  # before anything is installed
        summary["versions"] = {"machine": dataclasses.asdict(machine), "notes": notes}
        for line in notes:
            print(line, flush=True)
        if refusals:
            raise KitError("; ".join(refusals))
        summary["install"] = unpack(kit, target)
    except KitError as e:
        summary["error"] = str(e)
        save()
        sys.exit(f"kit refused: {e}")
    print(f"kit {manifest['kit_id'][:12]} unpacked in {target}", flush=True)
    env = step_env(target)
    for name, argv, cap in plan(out):
        step: dict = {"name": name, "command": " ".join(argv)}
        left = deadline - time.monotonic()
        if args.dry_run:
            step["skipped"] = "dry run"
        elif left < MIN_STEP_S:
            step["skipped"] = f"{left:.0f} s of the budget left"
        else:
            print(f"step {name} (at most {min(cap, left):.0f} s): {step['command']}", flush=True)
            step |= run_step(name, argv, min(cap, left), out / "steps.log", env)
            if name == "imports":
                with open(out / "steps.log", "rb") as f:
                    f.seek(step["log_from_byte"])
                    text = f.read().decode(errors="replace")
                marked = [t for t in text.splitlines() if t.startswith(IMPORTS_MARK)]
                summary["imports"] = json.loads(marked[-1].removeprefix(IMPORTS_MARK)) if marked else None
        summary["steps"].append(step)
        save()
    log = out / "steps.log"  # what comes back from a device call: 16 MiB a file
    if log.exists() and log.stat().st_size > 15 * MIB:
        data = log.read_bytes()
        log.write_bytes(data[:MIB] + b"\n[... cut ...]\n" + data[-14 * MIB :])
    print(render(summary))


def main(argv: list[str] | None = None, machine: Machine | None = None) -> None:
    """``machine``: the versions ``run`` checks the kit against (default: this Python's)."""
    p = argparse.ArgumentParser(prog="gpu_kit", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="fetch and pack the kit (here, with network)")
    b.add_argument("--carry-mib", type=int, help="most MiB per carry folder (default: what a device call carries)")
    b.add_argument("--xz-preset", type=int, default=6)
    c = sub.add_parser("check", help="are the kit's pieces whole?")
    c.add_argument("--partial", action="store_true", help="report missing pieces instead of refusing the kit")
    r = sub.add_parser("run", help="unpack the kit and run the GPU checks (on the GPU machine)")
    r.add_argument("--target", default=str(KIT / "installed"), help="where the kit's tree is unpacked")
    r.add_argument("--out", help="logs and JSON (default $OUT, else .kit/results)")
    r.add_argument("--budget-s", type=float, default=540, help="the steps stop by then (default 9 minutes)")
    r.add_argument("--dry-run", action="store_true", help="check and unpack the kit, list the steps, run none")
    for s in (b, c, r):
        s.add_argument("--kit", default=str(KIT))
    args = p.parse_args(argv)
    if args.command == "build":
        from benchmarks.gpu_kit_build import build  # through the benchmarks package: torch, this package

        build(args)
    elif args.command == "check":
        check_command(args)
    else:
        run(args, machine or Machine.here())


if __name__ == "__main__":
    main()
