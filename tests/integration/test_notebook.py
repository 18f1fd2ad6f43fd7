"""The example agent notebook runs top to bottom, as a user runs it."""

from __future__ import annotations

import nbformat
from nbclient import NotebookClient

from tests.fixtures.commands import ROOT


def test_agent_notebook_runs(smollm2_gguf, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("BLEND_AGENT_MODEL", raising=False)  # the notebook's default: SmolLM2-135M-Instruct
    monkeypatch.delenv("BLEND_AGENT_INSTRUCT", raising=False)
    notebook = nbformat.read(ROOT / "examples" / "agent.ipynb", as_version=4)
    NotebookClient(
        notebook, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "examples")}}
    ).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs)
    assert "1. Who founded Harbor Press?" in text
    for step in (1, 2, 3):
        assert f"step {step}: " in text
    assert "chunks hit 0, missed 6" in text.split("step 2:")[0]  # step 1 starts from an empty cache
    later = text.split("step 2:")[1]
    assert "chunks hit 0," not in later  # later steps read what earlier steps stored
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the plot
    table = next(o["data"]["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {}))
    assert table.startswith("| step | chunks_hit |") and "x sooner than full prefill" in table
    # SmolLM2 answers every step right with full prefill; blend's answers are printed beside them
    for step, expected in ((1, "Ada Okafor"), (2, "Brimford"), (3, "Yarrow")):
        full = text.split(f"step {step}: ")[1].split("answer (full): ")[1].split("\n")[0]
        assert expected in full, full
