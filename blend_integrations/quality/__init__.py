"""Answer quality, beside the layers: the bundled reader model, a small model trained
here (``training/``) to answer questions from its documents, so answer
quality under blending can be measured without downloading a model, the
answer metrics (``metrics.py``), and real questions: SQuAD v1.1 from the
package index with a BM25 retriever and SQuAD's official scores
(``squad.py``)."""

from __future__ import annotations

from pathlib import Path

READER_DIR = Path(__file__).parent / "reader"


def reader_model_dir() -> Path:
    """The bundled reader model (weights, tokenizer, model card)."""
    if not (READER_DIR / "model.safetensors").exists():
        raise FileNotFoundError(
            f"the reader model is missing from {READER_DIR}; train it with "
            f"`python -m training.train {READER_DIR}` in a checkout of the repository"
        )
    return READER_DIR
