"""Store layer: reading one stored entry layer by layer, for loading pipelined
with compute.

An entry's payload is ``[num_layers, 2, num_kv_heads, tokens, head_dim]`` in
C order, or, coded (``codec.py``), one record of codes and scales per layer,
so each layer is one contiguous slice of it: a reader fetches the header,
checks it, and then reads the layers in order into the tensor (or, coded,
the ``CodedKV``) it hands out up front, checking each coded layer's scales
and updating the checksum as it goes (the walk decodes a coded layer itself,
on its own device). The checksum covers
the whole entry, so bytes already handed out are only known good once
``verify`` has passed after the last layer: a caller must be ready to throw
away what it computed from them.

The disk and Redis tiers make readers (for ``ChunkStore.open_layers``);
``ChunkStore.finish_layers`` settles them (counts, memory and disk copies,
dropping damaged entries).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable

import torch

from .codec import CodedKV, check_scales
from .format import CRC_BYTES, PREFIX_BYTES, CorruptEntryError, crc_of, geometry_mismatch, header_end, read_layout


class ReadFailed(Exception):
    """A read did not complete (I/O error, Redis unreachable, the entry gone
    meanwhile); unlike ``CorruptEntryError`` it says nothing against the entry."""


# read_into(offset, view) fills ``view`` from the entry's bytes at ``offset``
# and returns how many bytes it got (fewer only at the end of the entry).
ReadInto = Callable[[int, memoryview], int]


class LayerReader:
    """One entry being read layer by layer into ``kv``.

    ``read_layer`` reads the next layer (``layers_read`` of them so far),
    ``verify`` checks the checksum once all are read; both raise
    ``CorruptEntryError`` for a damaged entry and ``ReadFailed`` for a read
    that did not complete. ``nbytes`` and ``seconds`` add up the reads.
    """

    def __init__(
        self,
        tier: str,
        key: str,
        expect,
        size: int,
        read_into: ReadInto,
        close: Callable[[], None] | None,
        *,
        short_read_is_damage: bool,
    ) -> None:
        self.tier, self.key, self.size = tier, key, size
        self._read_into = read_into
        self._close: Callable[[], None] | None = close  # None: nothing to close
        self._short_is_damage = short_read_is_damage
        self.nbytes, self.seconds = 0, 0.0
        try:
            prefix = bytearray(min(size, PREFIX_BYTES))
            self._read(0, memoryview(prefix))
            head = bytearray(min(size, header_end(prefix)))
            head[: len(prefix)] = prefix
            self._read(len(prefix), memoryview(head)[len(prefix) :])
            layout = read_layout(memoryview(head), size)
            _, dtype, shape = layout.check(key)
            reason = geometry_mismatch((shape[0], shape[2], shape[3], shape[4], dtype), expect)
            if reason is not None:
                raise CorruptEntryError(reason)
        except BaseException:
            self.close()
            raise
        self.head = bytes(head)
        self.token_ids = layout.token_ids(shape)
        self._payload_start = layout.payload_start
        self._buffer = bytearray(layout.payload_bytes)
        self._shape = shape
        self.num_layers = shape[0]
        self._layer_bytes = layout.layer_bytes(shape)
        payload = (
            torch.frombuffer(self._buffer, dtype=torch.uint8)
            if layout.payload_bytes
            else torch.empty(0, dtype=torch.uint8)
        )
        self.kv: torch.Tensor | CodedKV = (
            payload.view(dtype).view(shape)
            if layout.codec is None
            else CodedKV(payload.view(self.num_layers, self._layer_bytes), layout.codec, tuple(shape), dtype)
        )
        self._crc = zlib.crc32(head)
        self.layers_read = 0
        self.verified = False

    def _read(self, offset: int, view: memoryview) -> None:
        started = time.perf_counter()
        got = self._read_into(offset, view)
        self.seconds += time.perf_counter() - started
        self.nbytes += got
        if got != len(view):
            message = f"entry ended at byte {offset + got} of {self.size} while being read"
            raise CorruptEntryError(message) if self._short_is_damage else ReadFailed(message)

    def read_layer(self) -> None:
        i, n = self.layers_read, self._layer_bytes
        with memoryview(self._buffer) as buffer:
            view = buffer[i * n : (i + 1) * n]
            self._read(self._payload_start + i * n, view)
            started = time.perf_counter()
            self._crc = zlib.crc32(view, self._crc)
            if isinstance(self.kv, CodedKV) and n:
                _, _, heads, tokens, head_dim = self._shape
                check_scales(self.kv.payload[i : i + 1], self.kv.codec, heads, tokens, head_dim)
            self.seconds += time.perf_counter() - started
        self.layers_read += 1

    def verify(self) -> None:
        if self.layers_read != self.num_layers:
            raise ReadFailed(f"verify() after {self.layers_read} of {self.num_layers} layers")
        stored = bytearray(CRC_BYTES)
        self._read(self.size - CRC_BYTES, memoryview(stored))
        self.close()
        if crc_of(bytes(stored)) != self._crc:
            raise CorruptEntryError(
                f"checksum mismatch (stored crc32 {crc_of(bytes(stored)):08x}, computed {self._crc:08x})"
            )
        self.verified = True

    def encoded(self) -> bytes:
        """The whole entry's bytes (once verified): for copying it to another tier."""
        return b"".join((self.head, self._buffer, (self._crc).to_bytes(CRC_BYTES, "little")))

    def close(self) -> None:
        if self._close is not None:
            self._close()
            self._close = None


def file_reader(f) -> ReadInto:
    """``read_into`` over an open binary file, straight into the destination."""

    def read_into(offset: int, view: memoryview) -> int:
        f.seek(offset)
        got = 0
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
        return got

    return read_into
