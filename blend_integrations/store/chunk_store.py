"""Store layer: the persistent tiered store of chunk KV caches, and the one
lookup across its tiers.

Tier 1 is an in-process LRU of tensors (``memory_tier``, coded in a coded store); tier 2 is
a diskcache directory shared by every process and engine pointing at the
same path (``disk_tier``); tier 3, optional, is a Redis database shared by
machines (``remote_tier``, with its layout, size limit and eviction in
``redis_tier``). Each is a ``tier.Tier``; ``ChunkStore`` only orders them:
writes go through to every tier, a read looks in each tier in turn and
copies a hit into the tiers above it.

Entries are content-addressed (see ``keys.chunk_key``): a key's value never
legitimately changes, so a process's memory tier can never be stale with
respect to another process's writes, and two writers of one key write the
same bytes. The shared state is the diskcache directory, which is process-
and thread-safe on its own, and Redis, where each operation is one atomic
script.

The cache is an optimisation: any problem with it (damaged entry, full disk,
locked database, Redis down or slow) is logged and turned into a miss, and
the caller recomputes. After a Redis failure the store leaves Redis alone for
``remote_retry_s`` seconds instead of paying a timeout on every call, and
entries put meanwhile are written to Redis, from the disk tier, once it
answers again (the backfill).

A store may keep its entries coded (``kv_codec``: ``"fp8"`` or ``"int8"``,
``codec.py``) in about a quarter of a float32 entry's bytes. The codec is
part of the key an entry is kept under (``keys.coded_key``), so stores of
several codecs share one directory or Redis database side by side. Every
tier, memory included, holds such an entry coded (``codec.CodedKV``): the
memory tier keeps four times as many float32 chunks, and the walk decodes
each layer on the engine's device, so a GPU engine moves only the codes
over the bus and decodes them there.

Beside the entries the store keeps a few small named blobs, records
(``put_record``/``get_record``/``delete_record``), on disk and in Redis:
never evicted, not entries (not in ``len()``, never read as chunks), and
removed by ``clear()``.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple, Self

from .codec import check_kv_codec
from .defaults import DEFAULT_READ_BANDWIDTH, REMOTE_ENV, TIERS, default_store_path, default_store_remote
from .disk_tier import DiskTier
from .format import ChunkKV, CorruptEntryError, _decode, check_record_name, decode_record, encode, encode_record
from .keys import coded_key, key_codec
from .layered import LayerReader, ReadFailed
from .memory_tier import MemoryTier
from .rate import Rate
from .redis_tier import RedisClient, redact
from .remote_tier import REMOTE_BACKFILL_MAX_KEYS, REMOTE_RETRY_S, RemoteTier
from .stats import Report
from .tier import Expect, Tier


class Location(NamedTuple):
    """Where the store would read a key from, found without reading it."""

    tier: str | None  # "memory", "disk" or "remote"; None: not in the store
    nbytes: int = 0  # what a read moves: the encoded entry (memory: the tensor)


# After fork() the child has one thread, but a lock held by another parent
# thread at fork time would stay locked forever: every live store's report
# and tiers get fresh locks in the child, and drop what is the parent's alone
# (see each tier's reset_after_fork). (diskcache reconnects on its own.)
_live_stores: weakref.WeakSet[ChunkStore] = weakref.WeakSet()


def _reset_after_fork() -> None:
    for store in list(_live_stores):
        store._report.reset_after_fork()
        for tier in store._tiers:
            tier.reset_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


class ChunkStore:
    """Memory LRU in front of a shared, size-bounded diskcache directory, and
    optionally a shared, size-bounded Redis database (``remote``).

    Safe for concurrent use by several threads (each tier guards its own
    state), several processes on the same ``path`` (only diskcache state is
    shared) and several machines on the same ``remote``. ``clear()`` clears
    this process's memory tier and the shared disk and Redis tiers; other
    processes' memory and disk tiers keep their (still valid) copies.

    Records (``put_record``, ``get_record``, ``delete_record``) are small
    named blobs (up to 1 MiB) kept on disk and in Redis beside the entries,
    never evicted and not counted in ``len()``; see ``docs/storage.md``.

    ``remote`` is a ``redis://``, ``rediss://`` or ``unix://`` URL (with the
    database number, e.g. ``redis://cache-host:6379/0``). Every Redis call
    gives up after ``remote_timeout_s`` seconds; ``remote_size_limit_bytes``
    (None: no limit of the store's own) bounds the bytes the store keeps in
    that database. ``remote=None`` is ``$BLEND_STORE_REMOTE`` if that is set
    and not empty, else no Redis tier; ``remote=""`` is no Redis tier
    whatever the environment says. ``store.remote`` is the URL in use, or None.

    Redis failures are misses, and after one the store leaves Redis alone for
    ``remote_retry_s`` seconds (default ``REMOTE_RETRY_S``). A ``put`` whose
    Redis write failed or was skipped meanwhile remembers the key (at most
    ``remote_backfill_max_keys``, default ``REMOTE_BACKFILL_MAX_KEYS``, oldest
    dropped first, in this process's memory only; never an entry over
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

    ``kv_codec`` is how ``put`` keeps entries: None (raw), ``"fp8"`` or
    ``"int8"`` (see ``codec.py``). ``get`` and ``put`` take a chunk's plain
    key; the store reads and writes it under ``coded_key(key, kv_codec)``,
    the key its entries carry, and only its own codec's entries are its
    hits. Reads measure the codec's own rate: its bytes (the walk decodes,
    counted as its compute).
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
        remote_retry_s: float = REMOTE_RETRY_S,
        remote_backfill_max_keys: int = REMOTE_BACKFILL_MAX_KEYS,
        read_bandwidth: dict[str, float] | None = None,
        kv_codec: str | None = None,
    ) -> None:
        self.kv_codec = check_kv_codec(kv_codec)
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
            raise ValueError(f"remote_size_limit_bytes must be a positive int or None, got {remote_size_limit_bytes!r}")
        if not isinstance(remote_timeout_s, (int, float)) or not remote_timeout_s > 0:
            raise ValueError(f"remote_timeout_s must be a positive number, got {remote_timeout_s!r}")
        if isinstance(remote_retry_s, bool) or not isinstance(remote_retry_s, (int, float)) or remote_retry_s < 0:
            raise ValueError(f"remote_retry_s must be a non-negative number, got {remote_retry_s!r}")
        if type(remote_backfill_max_keys) is not int or remote_backfill_max_keys < 0:
            raise ValueError(f"remote_backfill_max_keys must be a non-negative int, got {remote_backfill_max_keys!r}")
        from_env = remote is None
        if from_env:
            remote = default_store_remote()
        if remote == "":
            remote = None
        try:
            client = (
                None
                if remote is None
                else RedisClient(remote, size_limit_bytes=remote_size_limit_bytes, timeout_s=float(remote_timeout_s))
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
        self.read_rates = {tier: Rate(bandwidth[tier]) for tier in TIERS}
        self._report = Report(self.path)
        self.stats = self._report.stats

        # Top tier first: the order reads look in and hits are copied up.
        self._memory = MemoryTier(memory_limit_bytes, report=self._report, rate=self.read_rates["memory"])
        self._disk = DiskTier(self.path, size_limit_bytes, report=self._report, rate=self.read_rates["disk"])
        self._remote = (
            None
            if client is None
            else RemoteTier(
                client,
                backfill_source=self._disk.read_bytes,
                retry_s=remote_retry_s,
                backfill_max_keys=remote_backfill_max_keys,
                report=self._report,
                rate=self.read_rates["remote"],
            )
        )
        self._tiers: tuple[Tier, ...] = tuple(t for t in (self._memory, self._disk, self._remote) if t is not None)
        # Records live in the shared tiers only: a record's value may change
        # under its name, so a memory copy could be stale.
        self._record_tiers: tuple[DiskTier | RemoteTier, ...] = tuple(
            t for t in (self._disk, self._remote) if t is not None
        )
        _live_stores.add(self)

    # -- reads -----------------------------------------------------------

    def get(self, key: str, *, expect: Expect = None) -> ChunkKV | None:
        """Return the entry for ``key``, or None on a miss.

        Looks in memory, then on disk, then in Redis; a hit is copied into
        the tiers above the one it came from.

        ``expect = (num_layers, num_kv_heads, num_tokens, head_dim, dtype)``:
        an entry of another geometry is treated as corrupt. Damaged or
        foreign entries are dropped from memory and disk (and from Redis if
        read from there), logged once per key and reported as a miss, so the
        caller recomputes and ``put``s again.

        The returned tensor may be shared with other callers (memory tier):
        treat it as read-only. In a coded store the entry's ``kv`` is a
        ``CodedKV``: ``entry.values()`` decodes it.
        """
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {type(key).__name__}")
        if expect is not None and len(expect) != 5:
            raise ValueError(f"expect must be (num_layers, num_kv_heads, num_tokens, head_dim, dtype), got {expect!r}")
        found = self._lookup(self._stored(key), expect, layered=False)
        assert not isinstance(found, LayerReader)  # whole reads only
        return found

    def open_layers(self, key: str, *, expect: Expect = None) -> ChunkKV | LayerReader | None:
        """Start reading ``key`` layer by layer, for loading pipelined with
        compute: a ``LayerReader`` (header read and checked) for an entry in
        a file on disk or in Redis, the ``ChunkKV`` itself when it is at hand
        whole (memory tier, small entries kept in the disk tier's database),
        or None on a miss. Tiers are tried as in ``get``. Read the layers (in
        any one thread), then hand the reader to ``finish_layers``."""
        return self._lookup(self._stored(key), expect, layered=True)

    def _stored(self, key: str) -> str:
        """The key ``key``'s entry is kept under in this store's codec (a key
        that already names a codec is kept as it is)."""
        return key if key_codec(key) is not None else coded_key(key, self.kv_codec)

    def _lookup(self, key: str, expect: Expect, *, layered: bool) -> ChunkKV | LayerReader | None:
        """The lookup across tiers: the first tier holding ``key`` answers.
        A whole hit is counted and copied into the tiers above; a damaged
        entry is dropped (a miss, not a look further down)."""
        for tier in self._tiers:
            started = time.perf_counter()
            try:
                found = tier.read(key, expect, layered=layered)
            except CorruptEntryError as e:
                self._drop_corrupt(key, str(e), tier)
                return None
            if isinstance(found, LayerReader):
                return found  # counted by finish_layers
            if found is not None:
                self._hit(tier, found.entry, found.nbytes, time.perf_counter() - started, found.data)
                return found.entry
        self._report.count(misses=1)
        return None

    def finish_layers(self, reader: LayerReader, error: BaseException | None = None) -> ChunkKV | None:
        """Settle a reader from ``open_layers`` once nothing reads it any more
        (``error``: what reading it raised, if anything). Returns the entry
        if it was read whole and verified, counted and copied to the tiers
        above as ``get`` does; else None, after dropping a damaged entry."""
        reader.close()
        if error is None and not reader.verified:
            error = ReadFailed(f"read stopped after {reader.layers_read} of {reader.num_layers} layers")
        tier = next(t for t in self._tiers if t.name == reader.tier)
        if isinstance(error, CorruptEntryError):
            self._drop_corrupt(reader.key, str(error), tier)
            return None
        tier.finish(reader.key, error)
        if error is not None:
            self._report.count(misses=1)
            return None
        entry = ChunkKV(reader.key, reader.kv, reader.token_ids)
        # Only a copy from Redis into the disk tier needs the entry's bytes.
        data = reader.encoded() if tier is self._remote else None
        self._hit(tier, entry, reader.nbytes, reader.seconds, data)
        return entry

    def _hit(self, tier: Tier, entry: ChunkKV, nbytes: int, seconds: float, data: bytes | bytearray | None) -> None:
        """Count a hit in ``tier`` and copy it into the tiers above it."""
        tier.hit(nbytes, seconds)
        for above in self._tiers[: self._tiers.index(tier)]:
            above.put(entry, data)

    def locate(self, key: str) -> Location:
        """The first tier ``get`` would find ``key`` in and the entry's size,
        without reading it (nor counting it as a use). An entry found here
        may still turn out damaged, or be evicted, before it is read."""
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {type(key).__name__}")
        key = self._stored(key)
        for tier in self._tiers:
            nbytes = tier.locate(key)
            if nbytes is not None:
                return Location(tier.name, nbytes)
        return Location(None)

    def load_seconds(self, location: Location) -> float:
        """Estimated seconds to read an entry at ``location`` (its tier's
        measured bandwidth); 0 for a key not in the store."""
        if location.tier is None:
            return 0.0
        bandwidth = self.read_rates[location.tier].value  # every tier starts from an assumed one
        return location.nbytes / bandwidth if bandwidth else 0.0

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.locate(key).tier is not None

    def chunk_token_ids(
        self, key_of: Callable[[Sequence[int]], str], *, limit: int = 256, scan: int = 4096
    ) -> list[list[int]]:
        """The token ids of up to ``limit`` chunks on disk whose key is
        ``key_of(token ids)``: one model's chunks (``ChunkKeys`` of its
        fingerprint and dtype), verified, as the key hashes the tokens. Most
        recently used first, among the ``scan`` most recent entries; chunks
        stored without their tokens (by earlier releases, or too long for the
        header) are not listed.
        Calibration builds probes from them when given no documents."""
        found = []
        for key, tokens in self._disk.token_ids(scan):
            if self._stored(key_of(tokens)) == key:
                found.append(list(tokens))
                if len(found) == limit:
                    break
        return found

    def __len__(self) -> int:
        """Number of entries in the shared disk tier."""
        return len(self._disk)

    # -- writes ----------------------------------------------------------

    def put(self, entry: ChunkKV) -> None:
        """Store ``entry`` in memory, on disk and in Redis (write-through), in
        the store's codec (memory too holds it coded).

        Disk and Redis failures (disk full, locked database, Redis down) are
        logged and swallowed; the other tiers still get the entry. The
        memory tier keeps a reference to ``entry.kv``: don't modify the
        tensor afterwards.
        """
        if not isinstance(entry, ChunkKV):
            raise TypeError(f"put() needs a ChunkKV, got {type(entry).__name__}")
        self._report.count(puts=1)
        stored = self._stored(entry.key)
        if stored != entry.key:
            entry = ChunkKV(stored, entry.kv, entry.token_ids)
        data = encode(entry)
        if key_codec(stored) is not None:  # every tier holds it coded, as a read finds it
            entry = _decode(data, expected_key=stored, adopt=False)
        too_big = [why for tier in self._tiers if (why := tier.too_big(len(data))) is not None]
        if too_big:
            self._report.warn_once(entry.key, f"entry of {len(data)} bytes exceeds {' and '.join(too_big)}")
        for tier in self._tiers:
            tier.put(entry, data)

    def _drop_corrupt(self, key: str, reason: str, source: Tier) -> None:
        """Drop a bad entry from memory and disk, and from Redis if it came
        from there (a bad local copy says nothing about Redis's)."""
        self._report.count(corrupt=1, misses=1)
        # If another process re-put a good value meanwhile, this deletes it
        # too: costs one recompute, never a wrong answer.
        for tier in (self._memory, self._disk, *([source] if source is self._remote else [])):
            failed = tier.delete(key)
            if failed:
                reason += f"; deleting it failed too ({failed})"
        where = f" from Redis {redact(self.remote or '')}" if source is self._remote else ""
        self._report.warn_once(key, f"dropped corrupt entry{where}: {reason}")

    # -- records ---------------------------------------------------------

    def put_record(self, name: str, data: bytes | bytearray) -> None:
        """Store ``data`` (at most 1 MiB) as the record ``name`` on disk and
        in Redis (write-through), replacing any record of that name.

        ``name`` is 1 to 200 characters from ``A-Z a-z 0-9 . _ : -``
        (ValueError otherwise); ``data`` must be bytes or bytearray
        (TypeError). Disk and Redis failures are logged and swallowed.
        """
        raw = encode_record(name, data)
        for tier in self._record_tiers:
            tier.put_record(name, raw)

    def get_record(self, name: str) -> bytes | None:
        """The record ``name``, or None if there is none (or none readable).

        Looks in Redis first, the copy every machine shares (a record
        rewritten on another machine replaces this machine's disk copy when
        read), then on disk (Redis absent, down, or without it). A damaged
        or foreign copy is deleted from the tier it was read from, logged
        once and counted in ``stats.corrupt``, and the next tier is tried.
        """
        check_record_name(name)
        for tier in self._record_tiers[::-1]:
            raw = tier.read_record(name)
            if raw is None:
                continue
            try:
                data = decode_record(raw, name)
            except CorruptEntryError as e:
                self._drop_corrupt_record(name, str(e), tier, raw)
                continue
            if tier is not self._disk and self._disk.read_record(name) != raw:
                self._disk.put_record(name, raw)
            return data
        return None

    def delete_record(self, name: str) -> None:
        """Remove the record ``name`` from disk and Redis (failures are
        logged; with Redis unreachable, its copy stays there)."""
        check_record_name(name)
        for tier in self._record_tiers:
            tier.delete_record(name)

    def _drop_corrupt_record(self, name: str, reason: str, source: DiskTier | RemoteTier, raw: bytes) -> None:
        """Delete a bad copy of a record from ``source``, unless it was
        rewritten meanwhile, and say so once per record and tier."""
        self._report.count(corrupt=1)
        source.delete_record(name, only=raw)
        where = "disk" if source is self._disk else f"Redis {redact(self.remote or '')}"
        self._report.warn_once(
            f"record:{source.name}:{name}", f"dropped corrupt record from {where}: {reason}", subject=f"record {name!r}"
        )

    def clear(self) -> None:
        """Remove every entry from this process's memory tier, the disk tier
        and Redis (only the store's own ``blend:`` keys there), and every
        record."""
        for tier in self._tiers:
            tier.clear()

    def close(self) -> None:
        """Stop the backfill (after the entry it is writing), close the Redis
        connections and this thread's database connection (both reconnect if
        the store is used again), and drop the memory tier."""
        for tier in reversed(self._tiers):
            tier.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.stats
        remote = (
            ""
            if self.remote is None
            else (f"remote={redact(self.remote)!r}, remote_size_limit_bytes={self.remote_size_limit_bytes}, ")
        )
        return (
            f"ChunkStore(path={str(self.path)!r}, size_limit_bytes={self.size_limit_bytes}, "
            f"memory_limit_bytes={self.memory_limit_bytes}, {remote}kv_codec={self.kv_codec!r}, memory_entries={len(self._memory)}, "
            f"hits={s.hits}, misses={s.misses}, corrupt={s.corrupt})"
        )
