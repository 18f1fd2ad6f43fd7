"""Store layer: the counters and warnings the chunk store and its tiers share.

A ``ChunkStore`` and each of its tiers report to one ``Report``: the tiers
count their own reads, writes and failures into the store's ``StoreStats``,
and a key is warned about once, whichever tier found the problem.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

logger = logging.getLogger("blend_integrations.store")


@dataclass
class StoreStats:
    """Counters of one ChunkStore instance (this process only).

    Every ``get`` counts exactly one of ``memory_hits``, ``disk_hits``,
    ``remote_hits`` or ``misses``; ``corrupt`` counts the misses that found a
    damaged or foreign entry (and dropped it), and the damaged or foreign
    records ``get_record`` dropped; ``errors`` the failures of the disk tier
    (I/O, sqlite, lock timeouts) and of Redis (connection, timeout, error
    replies) on reads or writes, of chunks or records. Records count in no
    other field. ``bytes_read`` and ``bytes_written`` are the disk tier's,
    ``remote_bytes_*`` Redis's (backfilled entries included),
    ``memory_bytes_read`` the memory tier's; ``<tier>_read_s`` the seconds the
    hits in each tier took to read; ``remote_backfilled`` counts the entries
    written to Redis by the backfill (see ``ChunkStore``).
    """

    memory_hits: int = 0
    disk_hits: int = 0
    remote_hits: int = 0
    misses: int = 0
    corrupt: int = 0
    puts: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    remote_bytes_read: int = 0
    remote_bytes_written: int = 0
    remote_backfilled: int = 0
    errors: int = 0
    memory_bytes_read: int = 0
    memory_read_s: float = 0.0
    disk_read_s: float = 0.0
    remote_read_s: float = 0.0

    @property
    def hits(self) -> int:
        return self.memory_hits + self.disk_hits + self.remote_hits


class Report:
    """Where a store and its tiers report: ``stats`` (added to under a lock,
    as several threads share a store) and warnings, once per key. ``label``
    (the store's path) starts every log message."""

    def __init__(self, label: object) -> None:
        self.label = label
        self.stats = StoreStats()
        self._lock = threading.Lock()
        self._warned: set[str] = set()  # keys already warned about

    def count(self, **counts: float) -> None:
        """Add to the named ``StoreStats`` fields."""
        with self._lock:
            for name, n in counts.items():
                setattr(self.stats, name, getattr(self.stats, name) + n)

    def warn_once(self, key: str, message: str, *, subject: str | None = None) -> None:
        """Log ``message`` about ``key`` as a warning, unless one was already
        logged for it. ``subject`` is what it is about (default: ``key
        <first 16 characters of key>...``)."""
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        logger.warning(
            "chunk store %s: %s: %s", self.label, f"key {key[:16]}..." if subject is None else subject, message
        )

    def reset_after_fork(self) -> None:
        """In a forked child: a lock another parent thread may have held at fork time is replaced."""
        self._lock = threading.Lock()
