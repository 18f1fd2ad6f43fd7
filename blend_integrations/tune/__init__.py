"""Tuning layer: make a model blend-ready (``tune``), by LoRA self-distillation.

    from blend_integrations.tune import TuneOptions, tune
    tune("path/to/model", ["docs/"], "tuned-model", options=TuneOptions(steps=300))

or ``python -m blend_integrations.tune MODEL --documents PATH... --out DIR``.
See ``distill.py`` for the method and docs/tuning.md for its results.
"""

from .distill import TuneError, TuneOptions, TuneResult, tune
from .prompts import DocumentsError

__all__ = ["DocumentsError", "TuneError", "TuneOptions", "TuneResult", "tune"]
