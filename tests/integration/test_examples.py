"""The demo and the examples run as a user runs them, on their default model,
SmolLM2-135M-Instruct (converted once per machine by the ``smollm2_gguf`` fixture)."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex

import pytest

from tests.fixtures.commands import ROOT, run_python


@pytest.fixture
def run(smollm2_gguf, examples_store):
    def run(args, **env_vars):
        env = {**os.environ, "HF_HUB_OFFLINE": "1", **env_vars}
        return run_python(*args, "--store", str(examples_store), env=env, timeout=900).stdout

    return run


def demo_command() -> tuple[dict[str, str], list[str]]:
    """What ``make demo`` runs with the environment's Python: (its variables, its arguments)."""
    recipe = (ROOT / "Makefile").read_text().split("\ndemo:")[1].split("\n\n")[0]
    line = next(x for x in recipe.splitlines() if "$(PY) " in x).strip().lstrip("@")
    variables, args = line.split("$(PY) ")
    return dict(v.split("=", 1) for v in shlex.split(variables)), shlex.split(args)


def test_langchain_rag_example_is_the_demo(run):
    variables, command = demo_command()
    assert command == ["examples/langchain_rag.py", "--backend", "vllm"]  # LangChain on the embedded vLLM engine
    if importlib.util.find_spec("vllm") is None:  # the environment without vLLM: the reference engine
        command[-1] = "transformers"
    out = run(command, **variables)
    assert f"starting the {command[-1]} engine ..." in out and re.search(r"\nengine started in \d+\.\d s\n", out)
    assert "retrieved: ['ada_okafor.txt'" in out and ("(4/4 chunks)" in out or "(ratio 1.0, calibrated)" in out)
    assert "time to first token: full" in out and "x sooner" in out
    # calibrated at ingestion, blend with the defaults answers right where full prefill does
    assert "calibrated on 48 probe prompts" in out and "target 0.95 agreement with full prefill" in out
    assert "(ratio " in out and ("calibrated)" in out or "guard)" in out)
    assert out.splitlines()[-1] == "expected answer: 'Brimford'; blend right: True, full right: True"


def test_langchain_rag_example_answers_right_blended_at_a_high_ratio(run):
    # on SmolLM2 blend answers the example questions as full prefill does only near 0.9 (docs/tuning.md)
    out = run(["examples/langchain_rag.py", "--recompute-ratio", "0.9"])
    assert "(4/4 chunks), recomputed 368 (ratio 0.9, request)" in out  # round(0.9 * 409) of the 409 read
    assert out.rstrip().endswith("expected answer: 'Brimford'; blend right: True, full right: True")


def test_examples_refuse_a_ratio_outside_0_to_1_before_loading_a_model():
    for example in ("examples/langchain_rag.py", "examples/llamaindex_rag.py"):
        out = run_python(example, "--recompute-ratio", "1.5", timeout=120, returncode=2)
        assert 'argument --recompute-ratio: recompute_ratio must be a number in [0, 1] or "auto", got 1.5' in out.stderr


def test_llamaindex_rag_example(run):
    out = run(["examples/llamaindex_rag.py"])
    # (0/0 chunks) when the calibration chose full prefill for SmolLM2
    assert "retrieved: ['ada_okafor.txt'" in out and ("(4/4 chunks)" in out or "(ratio 1.0, calibrated)" in out)
    assert "time to first token: full" in out and "x sooner" in out
    assert "calibrated on 48 probe prompts" in out  # the store's calibration, whichever example made it
    # blend is right wherever full prefill is (SmolLM2's full prefill misses this one through LlamaIndex's prompt)
    verdict = out.rstrip().splitlines()[-1]
    assert verdict.startswith("expected answer: 'Brimford'; blend right: ")
    assert verdict.endswith("full right: False") or verdict.endswith("blend right: True, full right: True")


def test_quickstart_example(run):
    out = run(["examples/quickstart.py"])
    assert "computed at warm-up: 5 chunks" in out
    assert "ratio 1.0 reproduces full prefill: True" in out
    # blend with the defaults, in the examples' store: SmolLM2's calibration there (the first example
    # made it) either blends, reading the five chunks, or chose full prefill, reading none
    assert "chunks_hit=5, chunks_missed=0" in out or (
        "chunks_hit=0, chunks_missed=0" in out and "recompute_ratio=1.0, ratio_source='calibrated'" in out
    )
    blend, full = (line for line in out.splitlines() if line.startswith(("blend:", "full:")))
    assert "Brimford" in full and "Brimford" in blend
