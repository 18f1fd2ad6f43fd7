"""Store layer: the persistent, content-addressed store of per-chunk KV caches (CacheBlend)."""

from .chunk_store import ChunkStore, Location
from .codec import KV_CODECS, CodedKV, check_kv_codec
from .defaults import DEFAULT_READ_BANDWIDTH, REMOTE_ENV, TIERS, default_store_path, default_store_remote
from .format import ChunkKV, CorruptEntryError
from .keys import RECIPE_VERSION, chunk_key, coded_key, model_fingerprint
from .stats import StoreStats

__all__ = [
    "DEFAULT_READ_BANDWIDTH",
    "KV_CODECS",
    "RECIPE_VERSION",
    "REMOTE_ENV",
    "TIERS",
    "ChunkKV",
    "ChunkStore",
    "CodedKV",
    "CorruptEntryError",
    "Location",
    "StoreStats",
    "check_kv_codec",
    "chunk_key",
    "coded_key",
    "default_store_path",
    "default_store_remote",
    "model_fingerprint",
]
