"""Benchmarks: ``python -m blend_integrations.bench <part>``."""
