"""The plan and walk layers: the CacheBlend algorithm in engine-neutral torch code.

``plan.py`` decides what happens to each chunk of a request, ``walk.py`` runs
the layers (``selection.py``: how its check layers choose the tokens to
recompute), and ``blender.py`` carries a plan out with the store and the walk.
"""

from .blender import Blender, PrefillStats
from .layers import LayerModel, rotate
from .plan import ChunkKeys, ChunkPlan, Planner, PrefillPlan
from .walk import KVCache, ReusedSpan, ScratchCache, WalkStats, forward

__all__ = [
    "Blender",
    "ChunkKeys",
    "ChunkPlan",
    "KVCache",
    "LayerModel",
    "Planner",
    "PrefillPlan",
    "PrefillStats",
    "ReusedSpan",
    "ScratchCache",
    "WalkStats",
    "forward",
    "rotate",
]
