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
    "ChunkStore",
    "Location",
    "TIERS",
    "DEFAULT_READ_BANDWIDTH",
    "ChunkKV",
    "StoreStats",
    "CorruptEntryError",
    "chunk_key",
    "model_fingerprint",
    "RECIPE_VERSION",
    "default_store_path",
    "default_store_remote",
    "REMOTE_ENV",
]
