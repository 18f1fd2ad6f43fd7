"""The CacheBlend algorithm in engine-neutral torch code."""

from .blender import Blender, PrefillStats, planned_usage
from .layers import LayerModel, rotate
from .walk import KVCache, ReusedSpan, WalkStats, forward

__all__ = ["Blender", "KVCache", "LayerModel", "PrefillStats", "planned_usage", "ReusedSpan", "WalkStats", "forward", "rotate"]
