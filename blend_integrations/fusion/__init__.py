"""The CacheBlend algorithm in engine-neutral torch code."""

from .layers import LayerModel, rotate
from .walk import KVCache, ReusedSpan, WalkStats, forward

__all__ = ["KVCache", "LayerModel", "ReusedSpan", "WalkStats", "forward", "rotate"]
