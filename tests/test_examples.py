"""The demo and the examples run as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(args, tmp_path):
    env = dict(os.environ, HOME=str(tmp_path), HF_HUB_OFFLINE="1")  # model cache and store under tmp
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_langchain_rag_example_is_the_demo(tmp_path):
    assert "examples/langchain_rag.py" in (ROOT / "Makefile").read_text().split("demo:")[1].split("\n\n")[0]
    out = run(["examples/langchain_rag.py", "--max-tokens", "4"], tmp_path)
    assert "retrieved: [" in out and "(4/4 chunks)" in out
    assert "time to first token: full" in out and "x sooner" in out


def test_llamaindex_rag_example(tmp_path):
    out = run(["examples/llamaindex_rag.py", "--max-tokens", "4"], tmp_path)
    assert "retrieved: [" in out and "(4/4 chunks)" in out
    assert "time to first token: full" in out and "x sooner" in out


def test_quickstart_example(tmp_path):
    out = run(["examples/quickstart.py"], tmp_path)
    assert "computed at warm-up: 5 chunks" in out
    assert "ratio 1.0 reproduces full prefill: True" in out
    assert "chunks_hit=5, chunks_missed=0" in out
