"""Models layer: per-architecture adapters from a model's own modules to ``fusion.LayerModel``."""

from .hf import SUPPORTED_MODEL_TYPES, HFDecoder, UnsupportedModelError, check_supported

__all__ = ["SUPPORTED_MODEL_TYPES", "HFDecoder", "UnsupportedModelError", "check_supported"]
