"""Store layer: the one interface the chunk store's tiers share.

As diskcache splits ``Disk`` (how a value is kept) from ``Cache`` (the
lookup), each tier (``MemoryTier``, ``DiskTier``, ``RemoteTier``) knows only
its own storage, and ``ChunkStore`` does what is common to all of them, once:
trying the tiers in order, counting hits and misses, copying a hit into the
tiers above it and dropping a damaged entry from every tier it may be in.

A tier's own failures (I/O, database locks, Redis down) never raise: the tier
counts and logs them through its ``Report`` and they read as a miss there.
A damaged or foreign entry is different: ``read`` raises
``CorruptEntryError`` and the store drops it.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import NamedTuple

import torch

from .format import ChunkKV, CorruptEntryError, _decode, geometry_mismatch
from .layered import LayerReader
from .rate import Rate
from .stats import Report

# (num_layers, num_kv_heads, num_tokens, head_dim, dtype) an entry must have; None: any
Expect = tuple[int, int, int, int, torch.dtype] | None


class Hit(NamedTuple):
    """A whole entry read from a tier and checked."""

    entry: ChunkKV
    nbytes: int  # what the read moved: the encoded entry (memory: the tensor)
    data: bytes | bytearray | None  # the encoded entry as read, None where the tier keeps tensors


class Tier(ABC):
    """One tier of a ``ChunkStore``: ``name`` is one of ``TIERS``, ``rate``
    its read bandwidth as measured by the store's reads from it."""

    name: str

    def __init__(self, report: Report, rate: Rate) -> None:
        self.report = report
        self.rate = rate
        self._lock = threading.RLock()

    @abstractmethod
    def read(self, key: str, expect: Expect, *, layered: bool = False) -> Hit | LayerReader | None:
        """``key``'s entry, checked against ``expect``, or None if it is not
        here (or could not be read). With ``layered``, a ``LayerReader`` for
        an entry that can be read layer by layer (the header read and
        checked). Raises ``CorruptEntryError`` for a damaged or foreign entry."""

    def finish(self, key: str, error: BaseException | None) -> None:  # noqa: B027 - optional, so not abstract
        """A layered read of ``key`` from this tier ended, with ``error``
        unless it was read whole and verified. Nothing to do by default."""

    @abstractmethod
    def locate(self, key: str) -> int | None:
        """Bytes a read of ``key`` would move, without reading it (nor
        counting it as a use); None if it is not here."""

    @abstractmethod
    def put(self, entry: ChunkKV, data: bytes | bytearray | None) -> None:
        """Keep ``entry`` (``data``: its encoded bytes; None where a hit is
        copied up from a tier that had no bytes at hand) unless it is too big
        for this tier; evict down to the tier's limit."""

    def too_big(self, nbytes: int) -> str | None:
        """Why an encoded entry of ``nbytes`` is not written here (for the
        store's warning), or None if it is (or is skipped without warning)."""
        return None

    @abstractmethod
    def delete(self, key: str) -> str | None:
        """Remove ``key``; returns why that failed, if the store should say so."""

    @abstractmethod
    def clear(self) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    def hit(self, nbytes: int, seconds: float) -> None:
        """Count a read of ``nbytes`` from this tier that took ``seconds``."""
        self.rate.add(nbytes, seconds)
        self.report.count(**self.hit_counts(nbytes), **{f"{self.name}_read_s": seconds})

    @abstractmethod
    def hit_counts(self, nbytes: int) -> dict[str, int]:
        """The ``StoreStats`` fields a hit of ``nbytes`` adds to."""

    def reset_after_fork(self) -> None:
        """In a forked child: a lock another parent thread may have held at
        fork time is replaced (subclasses drop what is the parent's alone)."""
        self._lock = threading.RLock()


def mismatch(entry: ChunkKV, expect: Expect) -> str | None:
    """Why ``entry`` doesn't match ``expect``, or None if it does."""
    return geometry_mismatch(
        (entry.num_layers, entry.num_kv_heads, entry.num_tokens, entry.head_dim, entry.dtype), expect
    )


def decode_checked(key: str, data, expect: Expect, *, adopt: bool) -> Hit:
    """Decode bytes read from a tier and check them against ``key`` and
    ``expect``; raises ``CorruptEntryError`` if they fail either."""
    entry = _decode(data, expected_key=key, adopt=adopt)
    reason = mismatch(entry, expect)
    if reason is not None:
        raise CorruptEntryError(reason)
    return Hit(entry, len(data), data)
