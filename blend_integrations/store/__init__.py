"""Store layer: the persistent, content-addressed store of per-chunk KV caches (CacheBlend)."""

from .chunk_store import (
    DEFAULT_READ_BANDWIDTH,
    REMOTE_ENV,
    TIERS,
    ChunkStore,
    Location,
    default_store_path,
    default_store_remote,
)
from .format import ChunkKV, CorruptEntryError
from .keys import RECIPE_VERSION, chunk_key, model_fingerprint
from .stats import StoreStats

__all__ = [
    "DEFAULT_READ_BANDWIDTH",
    "RECIPE_VERSION",
    "REMOTE_ENV",
    "TIERS",
    "ChunkKV",
    "ChunkStore",
    "CorruptEntryError",
    "Location",
    "StoreStats",
    "chunk_key",
    "default_store_path",
    "default_store_remote",
    "model_fingerprint",
]
