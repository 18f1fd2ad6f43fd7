"""The CacheBlend algorithm in engine-neutral torch code."""

from .blender import Blender, PrefillStats
from .layers import LayerModel, rotate
from .walk import KVCache, ReusedSpan, WalkStats, forward

__all__ = ["Blender", "KVCache", "LayerModel", "PrefillStats", "ReusedSpan", "WalkStats", "forward", "rotate"]
