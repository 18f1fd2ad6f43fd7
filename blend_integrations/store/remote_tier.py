"""Store layer: the Redis tier, one Redis database shared by machines (see
``redis_tier`` for its layout, size limit and eviction).

Redis failures are misses, and after one the tier leaves Redis alone for
``retry_s`` seconds instead of paying a timeout on every call. A ``put``
whose Redis write failed or was skipped meanwhile remembers the key (at most
``backfill_max_keys``, oldest dropped first, in this process's memory only:
a restarted process forgets them, which costs other machines a recompute,
nothing more; never an entry over the size limit). The first successful
Redis call afterwards starts the backfill: a background thread writes those
entries, read from the disk tier, to Redis (``stats.remote_backfilled``), so
other machines get them too. An entry no longer on disk is skipped; if Redis
fails again the rest wait for the next successful call. ``close()`` stops it
(the rest wait for the next use).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from .format import ChunkKV, encode
from .layered import LayerReader, ReadFailed
from .rate import Rate
from .redis_tier import RedisClient, redact
from .stats import Report, logger
from .tier import Expect, Hit, Tier, decode_checked

# Seconds to leave Redis alone after a failure before trying it again.
REMOTE_RETRY_S = 5.0
# The most keys remembered for the backfill (entries put while Redis was down);
# a longer outage keeps the newest.
REMOTE_BACKFILL_MAX_KEYS = 4096
_SKIPPED = object()  # a Redis call not made (backing off) or failed


class RemoteTier(Tier):
    """The tier over ``client``; ``backfill_source(key)`` gives the bytes the
    backfill writes (the disk tier's ``read_bytes``)."""

    name = "remote"

    def __init__(
        self,
        client: RedisClient,
        *,
        backfill_source: Callable[[str], bytes | None],
        retry_s: float = REMOTE_RETRY_S,
        backfill_max_keys: int = REMOTE_BACKFILL_MAX_KEYS,
        report: Report,
        rate: Rate,
    ) -> None:
        super().__init__(report, rate)
        self.client = client
        self.size_limit_bytes = client.size_limit_bytes
        self.retry_s = retry_s
        self.backfill_max_keys = backfill_max_keys
        self._backfill_source = backfill_source
        self._error_logged = False
        self._down = False  # the last Redis call failed
        self._retry_at = 0.0  # time.monotonic() before which Redis is skipped
        self._backfill_keys: OrderedDict[str, None] = OrderedDict()  # an ordered set, oldest first
        self._backfill_thread: threading.Thread | None = None
        self._backfill_stop = False  # set by close()

    # -- reads -----------------------------------------------------------

    def read(self, key: str, expect: Expect, *, layered: bool = False) -> Hit | LayerReader | None:
        """With ``layered``, a reader doing one GETRANGE per read."""
        if not layered:
            data = self._call("read", self.client.get, key)
            if data is _SKIPPED or data is None:
                return None
            return decode_checked(key, data, expect, adopt=False)
        size = self.locate(key)
        if size is None:
            return None
        try:
            # A short read means the value was evicted or replaced meanwhile, not damage.
            return LayerReader(self.name, key, expect, size, self._read_into(key), None, short_read_is_damage=False)
        except ReadFailed:
            return None  # Redis failed (counted and logged by _call) or the value went meanwhile

    def _read_into(self, key: str):
        """``read_into`` over Redis: one GETRANGE per call."""

        def read_into(offset: int, view: memoryview) -> int:
            if not len(view):
                return 0
            data = self._call("read", self.client.getrange, key, offset, offset + len(view) - 1)
            if data is _SKIPPED:
                raise ReadFailed("Redis read failed")
            view[: len(data)] = data
            return len(data)

        return read_into

    def finish(self, key: str, error: BaseException | None) -> None:
        """A layered read counts as a use, as a whole ``get`` does. (Its
        failures were Redis's, counted and logged by ``_call``, or the value
        went meanwhile.)"""
        if error is None:
            self._call("touch", self.client.touch, key)

    def locate(self, key: str) -> int | None:
        size = self._call("lookup", self.client.size, key)
        return None if size is _SKIPPED or not size else int(size)

    def hit_counts(self, nbytes: int) -> dict[str, int]:
        return {"remote_hits": 1, "remote_bytes_read": nbytes}

    # -- writes ----------------------------------------------------------

    def too_big(self, nbytes: int) -> str | None:
        if self.size_limit_bytes is not None and nbytes > self.size_limit_bytes:
            return f"remote_size_limit_bytes={self.size_limit_bytes} (not written to Redis)"
        return None

    def put(self, entry: ChunkKV, data: bytes | bytearray | None) -> None:
        data = encode(entry) if data is None else data
        if self.too_big(len(data)):
            return
        if self._call("write", self.client.put, entry.key, data) is _SKIPPED:
            with self._lock:
                self._queue_backfill(entry.key)
        else:
            self.report.count(remote_bytes_written=len(data))

    def delete(self, key: str) -> None:
        self._call("delete", self.client.delete, key)

    def clear(self) -> None:
        """Remove the store's own ``blend:`` keys, records included (nothing
        else in the database)."""
        self._call("clear", self.client.clear)

    # -- records: plain values, outside the size count and eviction --------
    #
    # Failures are handled as for entries (counted, logged, then Redis left
    # alone for retry_s): a failed read is a miss, a failed write or delete is
    # skipped. A record written meanwhile is not backfilled.

    def read_record(self, name: str) -> bytes | None:
        """Record ``name`` as stored (not decoded), or None."""
        data = self._call("record read", self.client.get_record, name)
        return None if data is _SKIPPED else data

    def put_record(self, name: str, raw: bytes) -> None:
        self._call("record write", self.client.put_record, name, raw)

    def delete_record(self, name: str, only: bytes | None = None) -> None:
        """Remove record ``name``; with ``only``, only if it still holds those bytes."""
        self._call("record delete", self.client.delete_record, name, only)

    def close(self) -> None:
        """Stop the backfill (after the entry it is writing), then close the
        connections (both start again if the store is used again)."""
        with self._lock:
            self._backfill_stop = True
            thread = self._backfill_thread
        if thread is not None:
            thread.join()
        with self._lock:
            self._backfill_stop = False
        self.client.close()

    # -- back-off and backfill -------------------------------------------

    def _call(self, action: str, fn, *args):
        """``fn(*args)`` on Redis, or ``_SKIPPED`` if it failed or Redis is
        being left alone after a failure. Failures are counted and logged."""
        with self._lock:
            if time.monotonic() < self._retry_at:
                return _SKIPPED
        try:
            result = fn(*args)
        except self.client.errors as e:
            self.report.count(errors=1)
            with self._lock:
                self._down = True
                self._retry_at = time.monotonic() + self.retry_s
                first = not self._error_logged
                self._error_logged = True
            log = logger.warning if first else logger.debug
            log(
                "chunk store %s: Redis %s: %s failed (%s: %s); using the local tiers only, "
                "trying Redis again in %g s%s",
                self.report.label,
                redact(self.client.url),
                action,
                type(e).__name__,
                e,
                self.retry_s,
                " (further Redis errors are logged at DEBUG)" if first else "",
            )
            return _SKIPPED
        with self._lock:
            back, self._down = self._down, False
            backfill = len(self._backfill_keys) if self._backfill_thread is None else 0
            if backfill:  # started under the lock, so close() never sees an unstarted thread
                self._backfill_thread = threading.Thread(
                    target=self._backfill, name="chunk-store-backfill", daemon=True
                )
                self._backfill_thread.start()
        if back:
            logger.info(
                "chunk store %s: Redis %s answers again%s",
                self.report.label,
                redact(self.client.url),
                f"; writing the {backfill} entries put meanwhile to it" if backfill else "",
            )
        return result

    def _queue_backfill(self, key: str, *, oldest: bool = False) -> None:
        """Remember ``key`` for the backfill, dropping the oldest keys beyond
        the bound. Caller holds the lock."""
        self._backfill_keys[key] = None
        self._backfill_keys.move_to_end(key, last=not oldest)
        while len(self._backfill_keys) > self.backfill_max_keys:
            self._backfill_keys.popitem(last=False)

    def _backfill(self) -> None:
        """The backfill thread: write the remembered entries to Redis, oldest
        first, until none is left, Redis fails again (the key in hand goes
        back; the next successful call starts a new thread) or ``close()``
        stops it. One entry at a time, so the lock is never held during I/O."""
        while True:
            with self._lock:
                if self._backfill_stop or not self._backfill_keys:
                    self._backfill_thread = None
                    return
                key, _ = self._backfill_keys.popitem(last=False)
            data = self._backfill_source(key)
            if data is None:
                continue  # evicted from disk meanwhile (or unreadable): forgotten
            if self._call("write", self.client.put, key, data) is _SKIPPED:
                with self._lock:
                    self._queue_backfill(key, oldest=True)
                    self._backfill_thread = None
                return
            self.report.count(remote_backfilled=1, remote_bytes_written=len(data))

    @property
    def backfill_keys(self) -> list[str]:
        """The keys waiting for the backfill, oldest first."""
        with self._lock:
            return list(self._backfill_keys)

    @property
    def backfilling(self) -> bool:
        """Whether the backfill thread is running."""
        with self._lock:
            return self._backfill_thread is not None

    def reset_after_fork(self) -> None:
        """The parent's backfill thread is not in the child, and its keys are
        the parent's to write: the child starts with none. It gets its own
        Redis client (sockets must not be shared with the parent)."""
        super().reset_after_fork()
        self._backfill_keys = OrderedDict()
        self._backfill_thread = None
        self._backfill_stop = False
        self.client.reset_after_fork()
