"""The demo and the examples run as a user runs them: the demo on its model,
Qwen2.5-Coder-1.5B-Instruct, the examples on their default, SmolLM2-135M-Instruct
(converted once per machine by the ``smollm2_gguf`` fixture), from any working
directory, with the calibration the package ships for each."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from blend_integrations.calibration import PACKAGED_DIR, PackagedCalibration
from tests.fixtures.commands import ROOT, ended, run_python

BACKEND = "vllm" if importlib.util.find_spec("vllm") is not None else "transformers"


@pytest.fixture
def run(smollm2_gguf, examples_store, tmp_path):
    def run(args, **env_vars):
        env = {**os.environ, "HF_HUB_OFFLINE": "1", **env_vars}
        script, *rest = args
        # from another working directory than the checkout's, as a user may run them
        out = run_python(str(ROOT / script), *rest, "--store", str(examples_store), env=env, cwd=tmp_path,
                         timeout=900)  # fmt: skip
        assert "leaked semaphore" not in out.stderr  # the engine's processes end with the example, not after
        return out.stdout

    return run


def packaged(backend: str, model: str = "smollm2") -> PackagedCalibration:
    path = PACKAGED_DIR / f"{model}-{backend}.json"
    return PackagedCalibration.from_bytes(path.read_bytes(), path)


def demo_command() -> tuple[dict[str, str], list[str]]:
    """What ``make demo`` runs with the environment's Python: (its variables, its arguments), with
    the Makefile's default DEMO_MODEL in place of ``$(DEMO_MODEL)``."""
    makefile = (ROOT / "Makefile").read_text()
    model = re.search(r"^DEMO_MODEL \?= (\S+)$", makefile, re.MULTILINE).group(1)  # type: ignore[union-attr]
    recipe = makefile.split("\ndemo:")[1].split("\n\n")[0]
    line = next(x for x in recipe.splitlines() if "$(PY) " in x).strip().lstrip("@").replace("$(DEMO_MODEL)", model)
    variables, args = line.split("$(PY) ")
    return dict(v.split("=", 1) for v in shlex.split(variables)), shlex.split(args)


def make_demo(store: Path) -> str:
    """``make demo`` in the checkout with this environment, in the examples' store: its output."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "BLEND_STORE_PATH": str(store)}
    venv = Path(sys.executable).parent.parent
    available = psutil.virtual_memory().available  # the demo holds some 14 GiB: a failure says what it had
    done = subprocess.run(["make", "--no-print-directory", "demo", f"VENV={venv}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200, check=False)  # fmt: skip
    assert done.returncode == 0, f"{available / 2**30:.1f} GiB of memory available at the start\n{ended(done)}"
    assert "leaked semaphore" not in done.stderr  # the engine's processes end with the demo, not after
    return done.stdout


def verdict(out: str) -> str:
    return out.rstrip().splitlines()[-1]


@pytest.mark.alone
def test_langchain_rag_example_is_the_demo(run, examples_store):
    """``make demo``: LangChain on the embedded vLLM engine with Qwen2.5-Coder-1.5B-Instruct and the
    calibration the package ships for it, measured in bfloat16: in the dtype ``dtype="auto"`` gives
    on a CPU with bfloat16 instructions, and serving float32 on one without (named in the output)."""
    from blend_integrations.models.loading import resolve_dtype
    from blend_integrations.models.packaged import MODELS
    from blend_integrations.store.format import dtype_name

    variables, command = demo_command()
    # LangChain on the embedded vLLM engine, with the packaged model that answers best
    assert command == ["examples/langchain_rag.py", "--backend", "vllm", "--model", "qwen2.5-coder-1.5b"]
    if BACKEND == "vllm":  # `make demo` itself, the README's first command (docs/index.md leaves it to this test)
        out = make_demo(examples_store)
    else:  # the environment without vLLM runs the demo's example on the reference engine
        command[2] = BACKEND
        out = run(command, **variables)
    assert f"starting the {BACKEND} engine ..." in out and re.search(r"\nengine started in \d+\.\d s\n", out)
    assert "calibrating" not in out  # nothing measured at run time: the packaged calibration
    checkpoint = str(MODELS["qwen2.5-coder-1.5b"].checkpoint())
    dtype = dtype_name(resolve_dtype("auto", torch.device("cpu"), checkpoint))
    shipped = packaged(BACKEND, "qwen2.5-coder-1.5b")
    # measured in bfloat16; a CPU without bfloat16 instructions runs the model in float32, and the same
    # calibration serves it there, named
    assert shipped.record.dtype == "bfloat16"
    assert (f"measured in bfloat16, run here in {dtype}" in out) == (dtype != "bfloat16")
    choice = shipped.record.choice()  # with a guard, its base ratio and settings
    ratio = choice.ratio
    assert f'recompute_ratio="auto": {ratio}' in out
    assert f"(the calibration shipped with the package for this model on the {BACKEND} engine)" in out
    assert f"\nwhat it means: {shipped.meaning()}\n" in out
    assert "retrieved: ['ada_okafor.txt'" in out
    assert re.search(r"\nfull +TTFT +\d+ ms: ", out) and re.search(r"\nblend +TTFT +\d+ ms, \d+\.\d\dx sooner: ", out)
    used = re.search(r"\n +ratio ([0-9.]+) \((packaged|guard)\): of ", out)
    assert used, out
    # the packaged ratio, or, with a guard, its base unless the guard raised it for this question
    assert float(used[1]) == ratio if used[2] == "packaged" else (shipped.record.guard and float(used[1]) > ratio)
    if ratio != 0.15:  # the fallback ratio beside it, to show what speed costs
        assert re.search(r"\nblend@0\.15 +TTFT +\d+ ms, \d+\.\d\dx sooner: ", out)
        assert "ratio 0.15 (request): of " in out and "(4/4 chunks)" in out
    # blend with the packaged calibration answers right, as full prefill does
    assert verdict(out).startswith("expected answer: 'Brimford'; full right: True, blend right: True")


def test_langchain_rag_example_answers_right_blended_at_a_high_ratio(run):
    # on SmolLM2 blend answers the example questions as full prefill does only near 0.9 (docs/tuning.md)
    out = run(["examples/langchain_rag.py", "--recompute-ratio", "0.9"])
    # round(0.9 * 409) of the 409 read
    assert "ratio 0.9 (request): of 455 prompt tokens, 409 read from the chunk cache (4/4 chunks), 368 of them" in out
    assert verdict(out).startswith("expected answer: 'Brimford'; full right: True, blend right: True")


def test_examples_refuse_bad_arguments_before_loading_a_model(tmp_path, monkeypatch, capsys):
    """Each example run as a script (in this process: one import of the frameworks, not six)."""
    import runpy

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("  \n")
    monkeypatch.syspath_prepend(str(ROOT / "examples"))

    def refused(example: str, *args: str) -> str:
        monkeypatch.setattr(sys, "argv", [example, *args])
        with pytest.raises(SystemExit) as exit:
            runpy.run_path(str(ROOT / example), run_name="__main__")
        assert exit.value.code == 2
        return capsys.readouterr().err

    for example in ("examples/langchain_rag.py", "examples/llamaindex_rag.py"):
        err = refused(example, "--recompute-ratio", "1.5")
        assert 'argument --recompute-ratio: recompute_ratio must be a number in [0, 1] or "auto", got 1.5' in err
        err = refused(example, "--documents", str(empty))
        assert f"argument --documents: {str(empty)!r} holds no non-empty .txt document to answer from" in err
        assert "is not a folder" in refused(example, "--documents", str(tmp_path / "missing"))


def test_llamaindex_rag_example(run):
    out = run(["examples/llamaindex_rag.py"])
    ratio = packaged("transformers").record.ratio
    assert f'recompute_ratio="auto": {ratio}' in out and f"ratio {ratio} (packaged): of " in out
    assert "retrieved: ['ada_okafor.txt'" in out and "x sooner: " in out
    # blend is right wherever full prefill is (SmolLM2's full prefill misses this one through LlamaIndex's prompt)
    line = verdict(out)
    assert line.startswith("expected answer: 'Brimford'; full right: ")
    assert (
        line.startswith("expected answer: 'Brimford'; full right: False")
        or "full right: True, blend right: True" in line
    )


def test_quickstart_example(run):
    out = run(["examples/quickstart.py"])
    assert "computed at warm-up: 5 chunks" in out
    assert "ratio 1.0 reproduces full prefill: True" in out
    shipped = packaged("transformers")
    assert f"ratio used: {shipped.record.ratio} (the calibration shipped for this model)" in out
    assert f"what it means: {shipped.meaning()}" in out
    # blend with the packaged calibration either blends, reading the five chunks, or chose full prefill, reading none
    assert "chunks_hit=5, chunks_missed=0" in out or (
        "chunks_hit=0, chunks_missed=0" in out and "recompute_ratio=1.0, ratio_source='packaged'" in out
    )
    blend, full = (line for line in out.splitlines() if line.startswith(("blend:", "full:")))
    assert "Brimford" in full and "Brimford" in blend
