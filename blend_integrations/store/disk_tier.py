"""Store layer: the disk tier, a diskcache directory shared by every process
and engine pointing at the same path.

diskcache is process- and thread-safe on its own; this adds what the store
needs on top: values that are only ever raw bytes (``_BytesOnlyDisk``),
eviction one entry at a time (``_evict_to_limit``), a size query
(``locate``), and failures that are counted and logged instead of raised.

Records (``ChunkStore.put_record``) are not in the diskcache at all: each is
a plain file ``records/<name>.rec`` in the directory, replaced atomically.
Kept apart, they cannot be evicted by the chunk LRU, counted in ``len()``,
returned by a chunk read or counted against ``size_limit_bytes``, with no
special case in the eviction or diskcache's schema; and ``os.replace`` of a
fully written temporary file means a reader (or a concurrent writer) only
ever sees one whole record, never a torn one.
"""

from __future__ import annotations

import contextlib
import io
import os
import secrets
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import diskcache
from diskcache.core import MODE_BINARY, MODE_PICKLE, MODE_RAW, MODE_TEXT, UNKNOWN

from .format import MAX_RECORD_ENCODED, PREFIX_BYTES, ChunkKV, CorruptEntryError, encode, header_end, read_layout
from .layered import LayerReader, file_reader
from .rate import Rate
from .stats import Report, logger
from .tier import Expect, Hit, Tier, decode_checked

# Failures of the disk tier that must never fail a request.
DISK_ERRORS = (OSError, sqlite3.Error, diskcache.Timeout)
RECORDS_DIR = "records"  # the records' folder in the store directory
RECORD_SUFFIX = ".rec"


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
            f"value stored as {kind.get(mode, f'mode {mode}')}, not raw bytes (refused, never unpickled)"
        )

    def get(self, key, raw):
        # Keys we write are str (raw); a pickled key is only ever unpickled by
        # iteration, which we don't do, but refuse it anyway.
        if not raw:
            raise CorruptEntryError("pickled key in store (refused, never unpickled)")
        return super().get(key, raw)


class DiskTier(Tier):
    """The encoded entries (``format.encode``) in the diskcache directory
    ``path`` (``cache``), least recently used ones evicted beyond
    ``size_limit_bytes``. A read failure is logged once per key, a write
    failure once per tier (then at DEBUG)."""

    name = "disk"

    def __init__(self, path: Path, size_limit_bytes: int, *, report: Report, rate: Rate) -> None:
        super().__init__(report, rate)
        self.path = path
        self.records_path = path / RECORDS_DIR
        self.size_limit_bytes = size_limit_bytes
        self._write_error_logged = False
        path.mkdir(parents=True, exist_ok=True)
        self.cache = diskcache.Cache(
            str(path),
            disk=_BytesOnlyDisk,
            size_limit=size_limit_bytes,
            eviction_policy="least-recently-used",
            cull_limit=0,  # we evict ourselves, precisely: see _evict_to_limit
        )

    # -- reads -----------------------------------------------------------

    def read(self, key: str, expect: Expect, *, layered: bool = False) -> Hit | LayerReader | None:
        """Small entries kept in the database are always read whole; with
        ``layered``, one in a file gives a ``LayerReader`` over the open file."""
        try:
            # read=True: diskcache hands us an open file while holding its
            # lock; the (large) read then happens outside the lock. A value
            # refused by _BytesOnlyDisk raises CorruptEntryError.
            value = self.cache.get(key, default=None, read=True)
        except DISK_ERRORS as e:
            self._read_failed(key, e)
            return None
        if value is None:
            return None
        if layered and not isinstance(value, bytes):
            try:
                size = os.fstat(value.fileno()).st_size
                # The file is this entry's alone and never rewritten in place: a short read is damage.
                return LayerReader(
                    self.name, key, expect, size, file_reader(value), value.close, short_read_is_damage=True
                )
            except OSError as e:
                value.close()
                self._read_failed(key, e)
                return None
        try:
            data = _read_all(value)
        except DISK_ERRORS as e:
            self._read_failed(key, e)
            return None
        return decode_checked(key, data, expect, adopt=True)

    def finish(self, key: str, error: BaseException | None) -> None:
        if error is not None:
            self._read_failed(key, error)

    def _read_failed(self, key: str, error: BaseException) -> None:
        # Possibly transient (locked db, I/O hiccup): don't delete; the
        # caller's recompute-and-put replaces the entry if it is bad.
        self.report.count(errors=1)
        self.report.warn_once(
            key, f"disk tier read failed ({type(error).__name__}: {error}); treating it as a disk miss"
        )

    def read_bytes(self, key: str) -> bytes | None:
        """The bytes as stored (diskcache reads a file whole), not decoded:
        every reader checks an entry before use. None if absent or unreadable
        (then left for a ``read`` to find, report and drop)."""
        try:
            return self.cache.get(key, default=None)
        except (CorruptEntryError, *DISK_ERRORS):
            return None

    def locate(self, key: str) -> int | None:
        try:
            # diskcache has no size query; this reads its schema (as _evict_to_limit
            # does): ``size`` for values in files, the blob itself for small ones.
            row = self.cache._sql(
                "SELECT size + ifnull(length(value), 0) FROM Cache WHERE key = ? AND raw = 1", (key,)
            ).fetchone()
        except DISK_ERRORS:
            return None
        return None if row is None else int(row[0])

    def hit_counts(self, nbytes: int) -> dict[str, int]:
        return {"disk_hits": 1, "bytes_read": nbytes}

    def token_ids(self, max_entries: int) -> Iterator[tuple[str, tuple[int, ...]]]:
        """(key, token ids) of up to ``max_entries`` entries that keep their
        tokens, most recently used first, from their headers alone. Reads
        the database directly (as ``locate`` does), so listing touches no
        entry's recency; an entry that cannot be read or parsed is skipped,
        left for a ``read`` to find and drop."""
        try:
            rows = self.cache._sql(
                "SELECT key, filename, value FROM Cache WHERE raw = 1 ORDER BY access_time DESC LIMIT ?",
                (max_entries,),
            ).fetchall()
        except DISK_ERRORS:
            return
        for key, filename, value in rows:
            try:
                if filename:
                    with open(self.path / filename, "rb") as f:
                        size = os.fstat(f.fileno()).st_size
                        head = f.read(PREFIX_BYTES)
                        head += f.read(header_end(head) - len(head))
                else:
                    head = bytes(value)
                    size = len(head)
                layout = read_layout(memoryview(head), size)
                _, _, shape = layout.check(key)
                tokens = layout.token_ids(shape)
            except (CorruptEntryError, OSError, TypeError):
                continue
            if tokens is not None:
                yield key, tokens

    def __len__(self) -> int:
        return len(self.cache)

    # -- writes ----------------------------------------------------------

    def too_big(self, nbytes: int) -> str | None:
        if nbytes > self.size_limit_bytes:
            return f"size_limit_bytes={self.size_limit_bytes} (not written to disk)"
        return None

    def put(self, entry: ChunkKV, data: bytes | bytearray | None) -> None:
        """Write ``data`` and evict down to the limit; an entry larger than
        the limit is skipped. Failures are logged, never raised."""
        data = encode(entry) if data is None else data
        if len(data) > self.size_limit_bytes:
            return
        disk = self.cache.disk
        disk.forget_pending()
        try:
            self.cache.set(entry.key, data)
        except DISK_ERRORS as e:
            disk.discard_pending()  # don't leave an orphaned value file behind
            self._write_failed(entry.key, e)
            return
        disk.forget_pending()  # committed: the file is the entry's now
        self.report.count(bytes_written=len(data))
        try:
            self._evict_to_limit(keep=entry.key)
        except DISK_ERRORS as e:
            self._write_failed(entry.key, e)

    def _write_failed(self, key: str, error: BaseException, *, what: str | None = None) -> None:
        """Count and log a failed write of ``key`` (shown as ``what``, by
        default ``key <first 16 characters>...``)."""
        self.report.count(errors=1)
        with self._lock:
            first = not self._write_error_logged
            self._write_error_logged = True
        log = logger.warning if first else logger.debug
        log(
            "chunk store %s: disk write of %s failed (%s: %s); not stored on disk%s",
            self.report.label,
            f"key {key[:16]}..." if what is None else what,
            type(error).__name__,
            error,
            " (further write failures are logged at DEBUG)" if first else "",
        )

    def _evict_to_limit(self, keep: str) -> None:
        """Evict least recently used entries one at a time until the tier
        fits ``size_limit_bytes``, never the entry just written.

        diskcache's own culling (disabled here with ``cull_limit=0``) removes
        up to 10 entries at once whenever a write finds the cache full, the
        new entry included: with entries of tens of MB and a limit holding
        only a few of them it would empty the whole store on every overflow.
        """
        # diskcache has no public "least recently used key" query; this reads
        # its schema (Cache table, access_time indexed for this policy).
        select = "SELECT key FROM Cache WHERE raw = 1 AND key != ? ORDER BY access_time LIMIT 1"
        for _ in range(100_000):  # bounded even if deletes fail to shrink it
            if self.cache.volume() <= self.size_limit_bytes:
                return
            rows = self.cache._sql(select, (keep,)).fetchall()
            if not rows:
                return
            self.cache.delete(rows[0][0])

    def delete(self, key: str) -> str | None:
        try:
            self.cache.delete(key)
        except DISK_ERRORS as e:
            return f"{type(e).__name__}: {e}"
        return None

    def clear(self) -> None:
        """Remove every entry and every record (and any temporary file a
        writer of a record left behind)."""
        self.cache.clear(retry=True)
        try:
            with os.scandir(self.records_path) as it:
                files = [e.path for e in it if not e.is_dir(follow_symlinks=False)]
        except (FileNotFoundError, NotADirectoryError):
            return  # no records (a file in the folder's place is not ours)
        for path in files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    # -- records ---------------------------------------------------------

    def _record_file(self, name: str) -> Path:
        # Names are [A-Za-z0-9._:-]{1,200} (format.check_record_name): a safe
        # file name once suffixed, never "." or "..", never a temporary file's.
        return self.records_path / (name + RECORD_SUFFIX)

    def read_record(self, name: str) -> bytes | None:
        """Record ``name`` as stored (not decoded), or None if there is none
        or it could not be read (counted and logged once). At most one byte
        more than the largest record is read: decoding refuses a longer file."""
        try:
            with open(self._record_file(name), "rb") as f:
                return f.read(MAX_RECORD_ENCODED + 1)
        except FileNotFoundError:
            return None
        except OSError as e:
            self._record_failed(name, "read", f"disk read failed ({type(e).__name__}: {e}); treating it as a disk miss")
            return None

    def put_record(self, name: str, raw: bytes) -> None:
        """Write record ``name`` atomically: a temporary file in the same
        folder, fsync'd, then ``os.replace``d over the old one. Failures are
        counted and logged, never raised."""
        tmp = self.records_path / f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            self.records_path.mkdir(parents=True, exist_ok=True)
            # os.open, not mkstemp: the file gets the umask's mode (0600 would
            # hide it from other users sharing the store), as diskcache's do.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            try:
                with open(fd, "wb") as f:
                    f.write(raw)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self._record_file(name))
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            _fsync_dir(self.records_path)
        except OSError as e:
            self._write_failed(f"record:{name}", e, what=f"record {name!r}")

    def delete_record(self, name: str, only: bytes | None = None) -> None:
        """Remove record ``name``; with ``only``, only if the file still holds
        those bytes (so a good record written meanwhile by another process
        survives the drop of a damaged one, but for a window of microseconds
        between the check and the unlink). Failures are counted and logged."""
        path = self._record_file(name)
        try:
            if only is not None:
                with open(path, "rb") as f:
                    if f.read(MAX_RECORD_ENCODED + 1) != only:
                        return
            os.unlink(path)
        except FileNotFoundError:
            return
        except OSError as e:
            self._record_failed(name, "delete", f"deleting it from disk failed ({type(e).__name__}: {e})")

    def _record_failed(self, name: str, action: str, message: str) -> None:
        """Count a failed record read or delete and say so once per record and action."""
        self.report.count(errors=1)
        self.report.warn_once(f"record:disk-{action}:{name}", message, subject=f"record {name!r}")

    def close(self) -> None:
        """Close this thread's database connection (it reconnects on use)."""
        self.cache.close()


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable, where the platform allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # not supported here (some filesystems): the rename itself is still atomic
    finally:
        os.close(fd)


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
