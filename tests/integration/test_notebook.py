"""The example agent notebook runs top to bottom, as a user runs it."""

from __future__ import annotations

import nbformat
from nbclient import NotebookClient

from blend_integrations.calibration import PACKAGED_DIR, PackagedCalibration
from tests.fixtures.commands import ROOT


def test_agent_notebook_runs(smollm2_gguf, examples_store, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("BLEND_STORE_PATH", str(examples_store))  # the examples' store, as a user's
    monkeypatch.delenv("BLEND_AGENT_MODEL", raising=False)  # the notebook's default: SmolLM2-135M-Instruct
    monkeypatch.delenv("BLEND_AGENT_INSTRUCT", raising=False)
    monkeypatch.delenv("BLEND_AGENT_RATIO", raising=False)
    notebook = nbformat.read(ROOT / "examples" / "agent.ipynb", as_version=4)
    NotebookClient(
        notebook, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "examples")}}
    ).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs)
    assert "1. Who founded Harbor Press?" in text
    # nothing calibrated at ingestion: the calibration the package ships for SmolLM2 on this engine
    shipped = PackagedCalibration.from_bytes((PACKAGED_DIR / "smollm2-transformers.json").read_bytes(), PACKAGED_DIR)
    ratio = shipped.record.ratio
    assert f"ratio source: packaged | calibrated ratio: {ratio}\n" in text
    assert f"what it means: {shipped.meaning()}\n" in text
    for step in (1, 2, 3):
        assert f"step {step}: " in text
    if ratio == 1.0:  # no blend policy held the target sooner than full prefill: "auto" runs full prefill
        assert text.count("chunks hit 0, missed 0") == text.count("(ratio 1.0, packaged)") == 3
    else:  # ingestion stored every document, and blend read them
        assert text.count("chunks hit 6, missed 0") == 3
        assert text.count(", packaged)") + text.count(", guard)") == 3
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the plot
    table = next(o["data"]["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {}))
    assert table.startswith("| step | chunks_hit |") and "x sooner than full prefill" in table
    # SmolLM2 answers every step right with full prefill, and blend, calibrated, wherever full prefill does
    for step, expected in ((1, "Ada Okafor"), (2, "Brimford"), (3, "Yarrow")):
        line = text.split(f"step {step}: ")[1].split("answer (blend): ")[1].split("\n")[0]
        blend, full = line.split("   answer (full): ")
        assert expected in full, full
        assert expected in blend, blend


def test_the_notebook_is_kept_with_the_outputs_of_one_run():
    notebook = nbformat.read(ROOT / "examples" / "agent.ipynb", as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.get("outputs") for cell in code), "a code cell has no output: run the notebook and save it"
    counts = [cell.get("execution_count") for cell in code]
    assert counts == list(range(1, len(code) + 1)), f"not one run top to bottom: execution counts {counts}"
