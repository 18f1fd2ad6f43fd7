"""Persistent tiered store of chunk KV caches.

Tier 1 is an in-process LRU of decoded tensors; tier 2 is a diskcache
directory shared by every process and engine pointing at the same path;
tier 3, optional, is a Redis database shared by machines (see
``redis_tier`` for its layout, size limit and eviction). Writes go through
to every tier; a read looks in each tier in turn and copies a hit into the
tiers above it.

Entries are content-addressed (see ``keys.chunk_key``): a key's value never
legitimately changes, so a process's memory tier can never be stale with
respect to another process's writes, and two writers of one key write the
same bytes. The shared state is the diskcache directory, which is process-
and thread-safe on its own, and Redis, where each operation is one atomic
script.

The cache is an optimisation: any problem with it (damaged entry, full disk,
locked database, Redis down or slow) is logged and turned into a miss, and
the caller recomputes. After a Redis failure the store leaves Redis alone for
``REMOTE_RETRY_S`` seconds instead of paying a timeout on every call, and
entries put meanwhile are written to Redis, from the disk tier, once it
answers again (the backfill).
"""

from __future__ import annotations

import io
import logging
import os
import sqlite3
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import diskcache
import torch
from diskcache.core import MODE_BINARY, MODE_PICKLE, MODE_RAW, MODE_TEXT, UNKNOWN

from .format import ChunkKV, CorruptEntryError, _decode, encode, geometry_mismatch
from .layered import LayerReader, ReadFailed, file_reader
from .rate import Rate
from .redis_tier import RedisTier, redact

logger = logging.getLogger("blend_integrations.store")

# Failures of the disk tier that must never fail a request.
_DISK_ERRORS = (OSError, sqlite3.Error, diskcache.Timeout)

# Seconds to leave Redis alone after a failure before trying it again.
REMOTE_RETRY_S = 5.0
# The most keys remembered for the backfill (entries put while Redis was
# down); a longer outage keeps the newest. In memory only: a restarted
# process forgets them, which costs other machines a recompute, nothing more.
REMOTE_BACKFILL_MAX_KEYS = 4096
_SKIPPED = object()  # a Redis call not made (backing off) or failed
_ABSENT = object()  # not in the memory tier
_DROPPED = object()  # found damaged and dropped (a miss)


TIERS = ("memory", "disk", "remote")

# Read bandwidth (bytes/s) a tier is assumed to have until reads measure it:
# decoded tensors in this process, a local SSD (or the page cache), a
# 1 Gbit/s network to Redis. Set your own with ChunkStore(read_bandwidth=...).
DEFAULT_READ_BANDWIDTH = {"memory": 10e9, "disk": 1e9, "remote": 125e6}


class Location(NamedTuple):
    """Where the store would read a key from, found without reading it."""

    tier: str | None  # "memory", "disk" or "remote"; None: not in the store
    nbytes: int = 0  # what a read moves: the encoded entry (memory: the tensor)


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


class _BytesOnlyDisk(diskcache.Disk):
    """diskcache serialisation that only ever stores or returns raw bytes.

    Plain diskcache pickles non-bytes values and unpickles them on read. The
    store directory is shared, so anything else writing into it (another
    program, a plain ``diskcache.Cache`` on the same path) must not be able to
    make us execute code: pickled or text values are refused on read and
    reported as corrupt, and only exact ``bytes`` are accepted on write.

    It also cleans up after failed writes, which plain diskcache doesn't: a
    partially written value file is removed, and ``discard_pending`` removes
    a fully written one whose database insert then failed. On a full disk
    those orphans (tens of MB each, invisible to size accounting) would
    otherwise keep the disk full.
    """

    def __init__(self, directory, **kwargs):
        super().__init__(directory, **kwargs)
        self._local = threading.local()

    def store(self, value, read, key=UNKNOWN):
        if type(value) is not bytes:
            raise TypeError(f"chunk store values must be bytes, got {type(value).__name__}")
        self._local.pending = None
        if len(value) < self.min_file_size:
            return super().store(value, read, key=key)  # inline sqlite blob
        # Same as diskcache's own path for large bytes, plus the cleanup.
        filename, full_path = self.filename(key, value)
        try:
            self._write(full_path, io.BytesIO(value), "xb")
        except BaseException:
            self.remove(filename)
            raise
        self._local.pending = filename
        return len(value), MODE_BINARY, filename, None

    def discard_pending(self) -> None:
        """Remove the file written by this thread's last ``store``. Only call
        when the ``Cache.set`` that wrote it failed (its row was rolled back)."""
        filename = getattr(self._local, "pending", None)
        self._local.pending = None
        if filename:
            self.remove(filename)

    def forget_pending(self) -> None:
        self._local.pending = None

    def fetch(self, mode, filename, value, read):
        if mode == MODE_BINARY:  # a file holding raw bytes
            return super().fetch(mode, filename, value, read)
        if mode == MODE_RAW and isinstance(value, (bytes, memoryview)):  # small inline blob
            return bytes(value)
        kind = {MODE_RAW: "a raw non-bytes value", MODE_TEXT: "text", MODE_PICKLE: "a pickle"}
        raise CorruptEntryError(
            f"value stored as {kind.get(mode, f'mode {mode}')}, not raw bytes "
            "(refused, never unpickled)"
        )

    def get(self, key, raw):
        # Keys we write are str (raw); a pickled key is only ever unpickled by
        # iteration, which we don't do, but refuse it anyway.
        if not raw:
            raise CorruptEntryError("pickled key in store (refused, never unpickled)")
        return super().get(key, raw)


@dataclass
class StoreStats:
    """Counters of one ChunkStore instance (this process only).

    Every ``get`` counts exactly one of ``memory_hits``, ``disk_hits``,
    ``remote_hits`` or ``misses``; ``corrupt`` counts the misses that found a
    damaged or foreign entry (and dropped it) and ``errors`` the failures of
    the disk tier (I/O, sqlite, lock timeouts) and of Redis (connection,
    timeout, error replies) on reads or writes. ``bytes_read`` and
    ``bytes_written`` are the disk tier's, ``remote_bytes_*`` Redis's
    (backfilled entries included); ``remote_backfilled`` counts the entries
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

    @property
    def hits(self) -> int:
        return self.memory_hits + self.disk_hits + self.remote_hits


# After fork() the child has one thread, but a lock held by another parent
# thread at fork time would stay locked forever: give every live store a fresh
# lock, an empty memory tier and its own Redis client (sockets must not be
# shared with the parent) in the child. (diskcache reconnects on its own.)
# The parent's backfill thread is not in the child, and its keys are the
# parent's to write: the child starts with none.
_live_stores: "weakref.WeakSet[ChunkStore]" = weakref.WeakSet()


def _reset_after_fork() -> None:
    for store in list(_live_stores):
        store._lock = threading.RLock()
        store._memory = OrderedDict()
        store._memory_bytes = 0
        store._backfill_keys = OrderedDict()
        store._backfill_thread = None
        store._backfill_stop = False
        if store._remote is not None:
            store._remote.reset_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


class ChunkStore:
    """Memory LRU in front of a shared, size-bounded diskcache directory, and
    optionally a shared, size-bounded Redis database (``remote``).

    Safe for concurrent use by several threads (a lock guards the memory
    tier), several processes on the same ``path`` (only diskcache state is
    shared) and several machines on the same ``remote``. ``clear()`` clears
    this process's memory tier and the shared disk and Redis tiers; other
    processes' memory and disk tiers keep their (still valid) copies.

    ``remote`` is a ``redis://``, ``rediss://`` or ``unix://`` URL (with the
    database number, e.g. ``redis://cache-host:6379/0``). Every Redis call
    gives up after ``remote_timeout_s`` seconds; ``remote_size_limit_bytes``
    (None: no limit of the store's own) bounds the bytes the store keeps in
    that database. ``remote=None`` is ``$BLEND_STORE_REMOTE`` if that is set
    and not empty, else no Redis tier; ``remote=""`` is no Redis tier
    whatever the environment says. ``store.remote`` is the URL in use, or None.

    Redis failures are misses, and after one the store leaves Redis alone for
    ``REMOTE_RETRY_S`` seconds. A ``put`` whose Redis write failed or was
    skipped meanwhile remembers the key (at most ``REMOTE_BACKFILL_MAX_KEYS``,
    oldest dropped first, in this process's memory only; never an entry over
    ``remote_size_limit_bytes``). The first successful Redis call afterwards
    starts the backfill: a background thread writes those entries, read from
    the disk tier, to Redis (``stats.remote_backfilled``), so other machines
    get them too. An entry no longer on disk is skipped; if Redis fails again
    the rest wait for the next successful call. ``close()`` stops it (the
    rest wait for the next use).

    ``read_rates`` holds each tier's read bandwidth, measured from real reads
    (bytes over seconds, exponentially weighted); ``read_bandwidth`` sets
    what a tier is assumed to read at until then (bytes/s per tier name,
    defaults in ``DEFAULT_READ_BANDWIDTH``). ``locate`` says where a key is
    and how big it is without reading it: with both, the loading controller
    estimates load times.
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        size_limit_bytes: int = 16 * 2**30,
        memory_limit_bytes: int = 1 * 2**30,
        remote: str | None = None,
        remote_size_limit_bytes: int | None = 4 * 2**30,
        remote_timeout_s: float = 1.0,
        read_bandwidth: dict[str, float] | None = None,
    ) -> None:
        bandwidth = dict(DEFAULT_READ_BANDWIDTH)
        for tier, value in (read_bandwidth or {}).items():
            if tier not in TIERS:
                raise ValueError(f"read_bandwidth: unknown tier {tier!r}; the tiers are {', '.join(TIERS)}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"read_bandwidth[{tier!r}] must be a positive number of bytes/s, got {value!r}")
            bandwidth[tier] = float(value)
        if type(size_limit_bytes) is not int or size_limit_bytes <= 0:
            raise ValueError(f"size_limit_bytes must be a positive int, got {size_limit_bytes!r}")
        if type(memory_limit_bytes) is not int or memory_limit_bytes < 0:
            raise ValueError(
                "memory_limit_bytes must be a non-negative int (0 disables the memory tier), "
                f"got {memory_limit_bytes!r}"
            )
        if remote_size_limit_bytes is not None and (
            type(remote_size_limit_bytes) is not int or remote_size_limit_bytes <= 0
        ):
            raise ValueError(
                f"remote_size_limit_bytes must be a positive int or None, got {remote_size_limit_bytes!r}"
            )
        if not isinstance(remote_timeout_s, (int, float)) or not remote_timeout_s > 0:
            raise ValueError(f"remote_timeout_s must be a positive number, got {remote_timeout_s!r}")
        from_env = remote is None
        if from_env:
            remote = default_store_remote()
        if remote == "":
            remote = None
        try:
            self._remote = (
                None
                if remote is None
                else RedisTier(remote, size_limit_bytes=remote_size_limit_bytes, timeout_s=float(remote_timeout_s))
            )
        except ValueError as e:
            if from_env:
                raise ValueError(f"${REMOTE_ENV}: {e}") from None
            raise
        self.path = Path(path).expanduser() if path is not None else default_store_path()
        self.size_limit_bytes = size_limit_bytes
        self.memory_limit_bytes = memory_limit_bytes
        self.remote = remote
        self.remote_size_limit_bytes = remote_size_limit_bytes
        self.remote_timeout_s = remote_timeout_s
        self.stats = StoreStats()
        self.read_rates = {tier: Rate(bandwidth[tier]) for tier in TIERS}

        self._lock = threading.RLock()
        self._memory: OrderedDict[str, ChunkKV] = OrderedDict()
        self._memory_bytes = 0
        self._warned: set[str] = set()  # keys already warned about
        self._write_error_logged = False
        self._remote_error_logged = False
        self._remote_down = False  # the last Redis call failed
        self._remote_retry_at = 0.0  # time.monotonic() before which Redis is skipped
        self._remote_retry_s = REMOTE_RETRY_S
        self._backfill_keys: OrderedDict[str, None] = OrderedDict()  # an ordered set, oldest first
        self._backfill_max_keys = REMOTE_BACKFILL_MAX_KEYS
        self._backfill_thread: threading.Thread | None = None
        self._backfill_stop = False  # set by close()

        self.path.mkdir(parents=True, exist_ok=True)
        self._disk = diskcache.Cache(
            str(self.path),
            disk=_BytesOnlyDisk,
            size_limit=size_limit_bytes,
            eviction_policy="least-recently-used",
            cull_limit=0,  # we evict ourselves, precisely: see _evict_to_limit
        )
        _live_stores.add(self)

    # -- reads -----------------------------------------------------------

    def get(
        self,
        key: str,
        *,
        expect: tuple[int, int, int, int, torch.dtype] | None = None,
    ) -> ChunkKV | None:
        """Return the entry for ``key``, or None on a miss.

        Looks in memory, then on disk, then in Redis; a hit is copied into
        the tiers above the one it came from.

        ``expect = (num_layers, num_kv_heads, num_tokens, head_dim, dtype)``:
        an entry of another geometry is treated as corrupt. Damaged or
        foreign entries are dropped from memory and disk (and from Redis if
        read from there), logged once per key and reported as a miss, so the
        caller recomputes and ``put``s again.

        The returned tensor may be shared with other callers (memory tier):
        treat it as read-only.
        """
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {type(key).__name__}")
        if expect is not None and len(expect) != 5:
            raise ValueError(
                "expect must be (num_layers, num_kv_heads, num_tokens, head_dim, dtype), "
                f"got {expect!r}"
            )
        entry = self._memory_hit(key, expect)
        if entry is not _ABSENT:
            return entry

        started = time.perf_counter()
        value = self._disk_open(key)
        if value is _DROPPED:
            return None
        if value is not None:
            try:
                data = _read_all(value)
            except _DISK_ERRORS as e:
                self._disk_failed(key, e)
            else:
                return self._disk_hit(key, data, expect, started)

        started = time.perf_counter()
        data = None if self._remote is None else self._remote_call("read", self._remote.get, key)
        if data is None or data is _SKIPPED:
            with self._lock:
                self.stats.misses += 1
            return None
        entry = self._checked(key, data, expect, adopt=False, remote=True)
        if entry is not None:
            self.read_rates["remote"].add(len(data), time.perf_counter() - started)
            with self._lock:
                self.stats.remote_hits += 1
                self.stats.remote_bytes_read += len(data)
                self._remember(entry)
            self._disk_put(key, data)
        return entry

    def _memory_hit(self, key: str, expect) -> ChunkKV | None | object:
        """The memory tier's entry, None if it held a bad one (dropped), or
        ``_ABSENT``."""
        started = time.perf_counter()
        with self._lock:
            entry = self._memory.get(key)
            if entry is not None:
                self._memory.move_to_end(key)
        if entry is None:
            return _ABSENT
        reason = _mismatch(entry, expect)
        if reason is not None:
            self._drop_corrupt(key, reason)
            return None
        with self._lock:
            self.stats.memory_hits += 1
        self.read_rates["memory"].add(entry.nbytes, time.perf_counter() - started)
        return entry

    def _disk_open(self, key: str):
        """The disk tier's value of ``key``: an open file, or bytes for a small
        entry kept in the database; None if absent or unreadable (logged);
        ``_DROPPED`` if it was refused as damaged (counted as a miss)."""
        try:
            # read=True: diskcache hands us an open file while holding its
            # lock; the (large) read then happens outside the lock.
            return self._disk.get(key, default=None, read=True)
        except CorruptEntryError as e:  # refused by _BytesOnlyDisk
            self._drop_corrupt(key, str(e))
            return _DROPPED
        except _DISK_ERRORS as e:
            self._disk_failed(key, e)
            return None

    def _disk_failed(self, key: str, error: BaseException) -> None:
        # Possibly transient (locked db, I/O hiccup): don't delete; the
        # caller's recompute-and-put replaces the entry if it is bad.
        with self._lock:
            self.stats.errors += 1
        self._warn_once(key, f"disk tier read failed ({type(error).__name__}: {error}); treating it as a disk miss")

    def _disk_hit(self, key: str, data, expect, started: float) -> ChunkKV | None:
        """Decode bytes read from the disk tier; count and remember a good entry."""
        entry = self._checked(key, data, expect, adopt=True, remote=False)
        if entry is not None:
            self.read_rates["disk"].add(len(data), time.perf_counter() - started)
            with self._lock:
                self.stats.disk_hits += 1
                self.stats.bytes_read += len(data)
                self._remember(entry)
        return entry

    def _checked(self, key: str, data, expect, *, adopt: bool, remote: bool) -> ChunkKV | None:
        """Decode and check stored bytes; a bad entry is dropped (a miss)."""
        try:
            entry = _decode(data, expected_key=key, adopt=adopt)
            reason = _mismatch(entry, expect)
        except CorruptEntryError as e:
            reason = str(e)
        if reason is None:
            return entry
        self._drop_corrupt(key, reason, remote=remote)
        return None

    def open_layers(
        self, key: str, *, expect: tuple[int, int, int, int, torch.dtype] | None = None
    ) -> ChunkKV | LayerReader | None:
        """Start reading ``key`` layer by layer, for loading pipelined with
        compute: a ``LayerReader`` (header read and checked) for an entry in
        a file on disk or in Redis, the ``ChunkKV`` itself when it is at hand
        whole (memory tier, small entries kept in the disk tier's database),
        or None on a miss. Tiers are tried as in ``get``. Read the layers (in
        any one thread), then hand the reader to ``finish_layers``."""
        entry = self._memory_hit(key, expect)
        if entry is not _ABSENT:
            return entry
        started = time.perf_counter()
        value = self._disk_open(key)
        if value is _DROPPED:
            return None
        if isinstance(value, bytes):
            return self._disk_hit(key, value, expect, started)
        if value is not None:
            try:
                size = os.fstat(value.fileno()).st_size
                # The file is this entry's alone and never rewritten in place: a short read is damage.
                return LayerReader("disk", key, expect, size, file_reader(value), value.close, short_read_is_damage=True)
            except CorruptEntryError as e:
                self._drop_corrupt(key, str(e))
                return None
            except OSError as e:
                value.close()
                self._disk_failed(key, e)
        if self._remote is not None:
            size = self._remote_call("lookup", self._remote.size, key)
            if size is not _SKIPPED and size:
                try:
                    # A short read means the value was evicted or replaced meanwhile, not damage.
                    return LayerReader("remote", key, expect, size, self._redis_reader(key), None,
                                       short_read_is_damage=False)
                except CorruptEntryError as e:
                    self._drop_corrupt(key, str(e), remote=True)
                    return None
                except ReadFailed:
                    pass
        with self._lock:
            self.stats.misses += 1
        return None

    def finish_layers(self, reader: LayerReader, error: BaseException | None = None) -> ChunkKV | None:
        """Settle a reader from ``open_layers`` once nothing reads it any more
        (``error``: what reading it raised, if anything). Returns the entry
        if it was read whole and verified, counted and copied to the tiers
        above as ``get`` does; else None, after dropping a damaged entry."""
        reader.close()
        if error is None and not reader.verified:
            error = ReadFailed(f"read stopped after {reader.layers_read} of {reader.num_layers} layers")
        if isinstance(error, CorruptEntryError):
            self._drop_corrupt(reader.key, str(error), remote=reader.tier == "remote")
            return None
        if error is not None:
            with self._lock:
                self.stats.misses += 1
            if reader.tier == "disk":  # Redis failures were counted and logged by _remote_call
                self._disk_failed(reader.key, error)
            return None
        entry = ChunkKV(reader.key, reader.kv)
        self.read_rates[reader.tier].add(reader.nbytes, reader.seconds)
        with self._lock:
            if reader.tier == "disk":
                self.stats.disk_hits += 1
                self.stats.bytes_read += reader.nbytes
            else:
                self.stats.remote_hits += 1
                self.stats.remote_bytes_read += reader.nbytes
            self._remember(entry)
        if reader.tier == "remote":
            self._remote_call("touch", self._remote.touch, reader.key)
            self._disk_put(reader.key, reader.encoded())
        return entry

    def _redis_reader(self, key: str):
        """``read_into`` over Redis: one GETRANGE per call."""

        def read_into(offset: int, view: memoryview) -> int:
            if not len(view):
                return 0
            data = self._remote_call("read", self._remote.getrange, key, offset, offset + len(view) - 1)
            if data is _SKIPPED:
                raise ReadFailed("Redis read failed")
            view[: len(data)] = data
            return len(data)

        return read_into

    def locate(self, key: str) -> Location:
        """The first tier ``get`` would find ``key`` in and the entry's size,
        without reading it (nor counting it as a use). An entry found here
        may still turn out damaged, or be evicted, before it is read."""
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {type(key).__name__}")
        with self._lock:
            entry = self._memory.get(key)
        if entry is not None:
            return Location("memory", entry.nbytes)
        try:
            # diskcache has no size query; this reads its schema (as _evict_to_limit
            # does): ``size`` for values in files, the blob itself for small ones.
            row = self._disk._sql(
                "SELECT size + ifnull(length(value), 0) FROM Cache WHERE key = ? AND raw = 1", (key,)
            ).fetchone()
            if row is not None:
                return Location("disk", int(row[0]))
        except _DISK_ERRORS:
            pass
        if self._remote is not None:
            size = self._remote_call("lookup", self._remote.size, key)
            if size is not _SKIPPED and size:
                return Location("remote", int(size))
        return Location(None)

    def load_seconds(self, location: Location) -> float:
        """Estimated seconds to read an entry at ``location`` (its tier's
        measured bandwidth); 0 for a key not in the store."""
        if location.tier is None:
            return 0.0
        return location.nbytes / self.read_rates[location.tier].value

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.locate(key).tier is not None

    def __len__(self) -> int:
        """Number of entries in the shared disk tier."""
        return len(self._disk)

    # -- writes ----------------------------------------------------------

    def put(self, entry: ChunkKV) -> None:
        """Store ``entry`` in memory, on disk and in Redis (write-through).

        Disk and Redis failures (disk full, locked database, Redis down) are
        logged and swallowed; the other tiers still get the entry. The
        memory tier keeps a reference to ``entry.kv``: don't modify the
        tensor afterwards.
        """
        if not isinstance(entry, ChunkKV):
            raise TypeError(f"put() needs a ChunkKV, got {type(entry).__name__}")
        with self._lock:
            self.stats.puts += 1
            self._remember(entry)
        data = encode(entry)
        too_big = []
        if len(data) > self.size_limit_bytes:
            too_big.append(f"size_limit_bytes={self.size_limit_bytes} (not written to disk)")
        if self._remote is not None and not self._fits_remote(data):
            too_big.append(f"remote_size_limit_bytes={self.remote_size_limit_bytes} (not written to Redis)")
        if too_big:
            self._warn_once(entry.key, f"entry of {len(data)} bytes exceeds {' and '.join(too_big)}")
        self._disk_put(entry.key, data)
        if self._remote is not None and self._fits_remote(data):
            if self._remote_call("write", self._remote.put, entry.key, data) is _SKIPPED:
                with self._lock:
                    self._queue_backfill(entry.key)
            else:
                with self._lock:
                    self.stats.remote_bytes_written += len(data)

    def _fits_remote(self, data: bytes) -> bool:
        return self.remote_size_limit_bytes is None or len(data) <= self.remote_size_limit_bytes

    def _disk_put(self, key: str, data: bytes) -> None:
        """Write to the disk tier and evict down to its limit; an entry larger
        than the limit is skipped. Failures are logged, never raised."""
        if len(data) > self.size_limit_bytes:
            return
        disk = self._disk.disk
        disk.forget_pending()
        try:
            self._disk.set(key, data)
        except _DISK_ERRORS as e:
            disk.discard_pending()  # don't leave an orphaned value file behind
            self._write_failed(key, e)
            return
        disk.forget_pending()  # committed: the file is the entry's now
        with self._lock:
            self.stats.bytes_written += len(data)
        try:
            self._evict_to_limit(keep=key)
        except _DISK_ERRORS as e:
            self._write_failed(key, e)

    def _write_failed(self, key: str, error: BaseException) -> None:
        with self._lock:
            self.stats.errors += 1
            first = not self._write_error_logged
            self._write_error_logged = True
        log = logger.warning if first else logger.debug
        log(
            "chunk store %s: disk write of key %s... failed (%s: %s); not stored on disk%s",
            self.path, key[:16], type(error).__name__, error,
            " (further write failures are logged at DEBUG)" if first else "",
        )

    def _evict_to_limit(self, keep: str) -> None:
        """Evict least recently used entries one at a time until the disk tier
        fits ``size_limit_bytes``, never the entry just written.

        diskcache's own culling (disabled here with ``cull_limit=0``) removes
        up to 10 entries at once whenever a write finds the cache full, the
        new entry included: with entries of tens of MB and a limit holding
        only a few of them it would empty the whole store on every overflow.
        """
        disk = self._disk
        # diskcache has no public "least recently used key" query; this reads
        # its schema (Cache table, access_time indexed for this policy).
        select = "SELECT key FROM Cache WHERE raw = 1 AND key != ? ORDER BY access_time LIMIT 1"
        for _ in range(100_000):  # bounded even if deletes fail to shrink it
            if disk.volume() <= self.size_limit_bytes:
                return
            rows = disk._sql(select, (keep,)).fetchall()
            if not rows:
                return
            disk.delete(rows[0][0])

    def clear(self) -> None:
        """Remove every entry from this process's memory tier, the disk tier
        and Redis (only the store's own ``blend:`` keys there)."""
        with self._lock:
            self._memory.clear()
            self._memory_bytes = 0
        self._disk.clear(retry=True)
        if self._remote is not None:
            self._remote_call("clear", self._remote.clear)

    def close(self) -> None:
        """Stop the backfill (after the entry it is writing), drop the memory
        tier, close this thread's database connection and the Redis
        connections (both reconnect if the store is used again)."""
        with self._lock:
            self._backfill_stop = True
            thread = self._backfill_thread
        if thread is not None:
            thread.join()
        with self._lock:
            self._backfill_stop = False
            self._memory.clear()
            self._memory_bytes = 0
        self._disk.close()
        if self._remote is not None:
            self._remote.close()

    def __enter__(self) -> ChunkStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.stats
        remote = "" if self.remote is None else (
            f"remote={redact(self.remote)!r}, remote_size_limit_bytes={self.remote_size_limit_bytes}, "
        )
        return (
            f"ChunkStore(path={str(self.path)!r}, size_limit_bytes={self.size_limit_bytes}, "
            f"memory_limit_bytes={self.memory_limit_bytes}, {remote}memory_entries={len(self._memory)}, "
            f"hits={s.hits}, misses={s.misses}, corrupt={s.corrupt})"
        )

    # -- internals -------------------------------------------------------

    def _remote_call(self, action: str, fn, *args):
        """``fn(*args)`` on Redis, or ``_SKIPPED`` if it failed or Redis is
        being left alone after a failure. Failures are counted and logged."""
        with self._lock:
            if time.monotonic() < self._remote_retry_at:
                return _SKIPPED
        try:
            result = fn(*args)
        except self._remote.errors as e:
            with self._lock:
                self.stats.errors += 1
                self._remote_down = True
                self._remote_retry_at = time.monotonic() + self._remote_retry_s
                first = not self._remote_error_logged
                self._remote_error_logged = True
            log = logger.warning if first else logger.debug
            log(
                "chunk store %s: Redis %s: %s failed (%s: %s); using the local tiers only, "
                "trying Redis again in %g s%s",
                self.path, redact(self.remote), action, type(e).__name__, e, self._remote_retry_s,
                " (further Redis errors are logged at DEBUG)" if first else "",
            )
            return _SKIPPED
        with self._lock:
            back, self._remote_down = self._remote_down, False
            backfill = len(self._backfill_keys) if self._backfill_thread is None else 0
            if backfill:  # started under the lock, so close() never sees an unstarted thread
                self._backfill_thread = threading.Thread(
                    target=self._backfill, name="chunk-store-backfill", daemon=True)
                self._backfill_thread.start()
        if back:
            logger.info("chunk store %s: Redis %s answers again%s", self.path, redact(self.remote),
                        f"; writing the {backfill} entries put meanwhile to it" if backfill else "")
        return result

    def _queue_backfill(self, key: str, *, oldest: bool = False) -> None:
        """Remember ``key`` for the backfill, dropping the oldest keys beyond
        the bound. Caller holds the lock."""
        self._backfill_keys[key] = None
        self._backfill_keys.move_to_end(key, last=not oldest)
        while len(self._backfill_keys) > self._backfill_max_keys:
            self._backfill_keys.popitem(last=False)

    def _backfill(self) -> None:
        """The backfill thread: write the remembered entries from the disk
        tier to Redis, oldest first, until none is left, Redis fails again
        (the key in hand goes back; the next successful call starts a new
        thread) or ``close()`` stops it. One entry at a time, so the lock is
        never held during I/O."""
        while True:
            with self._lock:
                if self._backfill_stop or not self._backfill_keys:
                    self._backfill_thread = None
                    return
                key, _ = self._backfill_keys.popitem(last=False)
            try:
                # The bytes as stored (diskcache reads a file whole); not
                # decoded here: every reader checks an entry before use.
                data = self._disk.get(key, default=None)
            except (CorruptEntryError, *_DISK_ERRORS):
                data = None  # left for a get to find, report and drop
            if data is None:
                continue  # evicted from disk meanwhile (or unreadable): forgotten
            if self._remote_call("write", self._remote.put, key, data) is _SKIPPED:
                with self._lock:
                    self._queue_backfill(key, oldest=True)
                    self._backfill_thread = None
                return
            with self._lock:
                self.stats.remote_backfilled += 1
                self.stats.remote_bytes_written += len(data)

    def _remember(self, entry: ChunkKV) -> None:
        """Insert into the memory LRU, evicting least recently used entries.
        Caller holds the lock."""
        size = entry.nbytes
        old = self._memory.pop(entry.key, None)
        if old is not None:
            self._memory_bytes -= old.nbytes
        if size > self.memory_limit_bytes:
            return  # would evict everything else and still not fit
        self._memory[entry.key] = entry
        self._memory_bytes += size
        while self._memory_bytes > self.memory_limit_bytes:
            _, evicted = self._memory.popitem(last=False)
            self._memory_bytes -= evicted.nbytes

    def _drop_corrupt(self, key: str, reason: str, *, remote: bool = False) -> None:
        """Drop a bad entry from memory and disk, and from Redis if it came
        from there (a bad local copy says nothing about Redis's)."""
        with self._lock:
            old = self._memory.pop(key, None)
            if old is not None:
                self._memory_bytes -= old.nbytes
            self.stats.corrupt += 1
            self.stats.misses += 1
        try:
            # If another process re-put a good value meanwhile, this deletes
            # it too: costs one recompute, never a wrong answer.
            self._disk.delete(key)
        except _DISK_ERRORS as e:
            reason += f"; deleting it failed too ({type(e).__name__}: {e})"
        if remote:
            self._remote_call("delete", self._remote.delete, key)
            reason = f"from Redis {redact(self.remote)}: {reason}"
        self._warn_once(key, f"dropped corrupt entry {reason}" if remote else f"dropped corrupt entry: {reason}")

    def _warn_once(self, key: str, message: str) -> None:
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        logger.warning("chunk store %s: key %s...: %s", self.path, key[:16], message)


def _mismatch(
    entry: ChunkKV, expect: tuple[int, int, int, int, torch.dtype] | None
) -> str | None:
    """Why ``entry`` doesn't match ``expect``, or None if it does."""
    return geometry_mismatch((entry.num_layers, entry.num_kv_heads, entry.num_tokens, entry.head_dim, entry.dtype), expect)


def _read_all(value) -> bytes | bytearray:
    """Bytes of a diskcache value: inline bytes, or an open file read in one
    copy into a bytearray (which decode then adopts without copying)."""
    if isinstance(value, bytes):
        return value
    with value as f:
        size = os.fstat(f.fileno()).st_size
        buf = bytearray(size)
        view = memoryview(buf)
        got = 0
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
        view.release()
        if got < size:  # file shrank under us; decode reports it truncated
            del buf[got:]
        return buf
