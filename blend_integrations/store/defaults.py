"""Store layer: what a ``ChunkStore`` uses when not told: its tiers' names,
the read bandwidth each is assumed to have until reads measure it, and where
it lives (``$BLEND_STORE_PATH``, ``$BLEND_STORE_REMOTE``)."""

from __future__ import annotations

import os
from pathlib import Path

TIERS = ("memory", "disk", "remote")

# Read bandwidth (bytes/s) a tier is assumed to have until reads measure it:
# tensors in this process, a local SSD (or the page cache), a
# 1 Gbit/s network to Redis. Set your own with ChunkStore(read_bandwidth=...).
DEFAULT_READ_BANDWIDTH = {"memory": 10e9, "disk": 1e9, "remote": 125e6}


def default_store_path() -> Path:
    """``$BLEND_STORE_PATH`` if set, else ``~/.cache/blend_integrations/chunks``."""
    env = os.environ.get("BLEND_STORE_PATH")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "blend_integrations" / "chunks"


REMOTE_ENV = "BLEND_STORE_REMOTE"


def default_store_remote() -> str | None:
    """``$BLEND_STORE_REMOTE`` if set and not empty, else None (no Redis tier)."""
    return os.environ.get(REMOTE_ENV) or None
