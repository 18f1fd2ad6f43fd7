"""Training and diagnosis of the bundled reader model, and its synthetic task:
``python -m training.train OUT_DIR``, ``python -m training.diagnose DIR``."""
