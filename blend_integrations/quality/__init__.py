"""The reader model and its task: a small model trained here to answer questions
from its documents, so answer quality under blending can be measured (and the
examples give right answers) without downloading a model."""

from __future__ import annotations

from pathlib import Path

READER_DIR = Path(__file__).parent / "reader"


def reader_model_dir() -> Path:
    """The bundled reader model (weights, tokenizer, model card)."""
    if not (READER_DIR / "model.safetensors").exists():
        raise FileNotFoundError(
            f"the reader model is missing from {READER_DIR}; train it with "
            f"`python -m blend_integrations.quality.train {READER_DIR}`")
    return READER_DIR
