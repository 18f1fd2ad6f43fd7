"""Store layer: the on-disk format of one chunk's KV cache (and, at the end
of this module, of a record: ``encode_record``).

Layout (all integers little-endian)::

    b"BLKV"            4 bytes   magic
    version            uint32    FORMAT_VERSION
    header_len         uint32    length of the JSON header, padding included
    header             UTF-8 JSON {"key", "dtype", "shape", "payload_bytes"}, "codec"
                       for a coded entry and, when known and short enough,
                       "tokens" (the chunk's token ids), padded with spaces so
                       the payload starts 64-byte aligned
    payload            raw: the tensor's bytes, C order, little-endian; coded
                       ("fp8", "int8"): its codes and scales, layer after layer
                       (``codec.py``), decoding to ``dtype`` and ``shape``
    crc32              uint32    zlib.crc32 of every byte before it

The store is shared by several processes and possibly several users, so the
format is plain data: decoding never unpickles and never calls torch.load.

Checksum choice: zlib.crc32. It only has to catch accidental damage (torn
writes, truncation, bit rot), where a 32-bit CRC is plenty, and it runs at
several GB/s, several times faster than blake2b, which matters because every
disk hit checksums tens of MB (~22 ms vs ~100 ms for 64 MB here). It is
no defence against a malicious writer, but no unkeyed hash would be: such a
writer can recompute any checksum. Safety against that comes from never
executing anything found in the store; the worst a hostile entry can do is
supply wrong numbers under a key it can compute.
"""

from __future__ import annotations

import json
import math
import re
import struct
import sys
import zlib
from dataclasses import dataclass

import torch

from .codec import KV_CODECS, CodedKV, check_scales, encode_kv, layer_bytes
from .errors import CorruptEntryError
from .keys import key_codec

MAGIC = b"BLKV"
FORMAT_VERSION = 1

_PREFIX = struct.Struct("<4sII")  # magic, version, header_len
_CRC = struct.Struct("<I")
_ALIGN = 64  # payload offset alignment inside an entry
_MAX_HEADER_BYTES = 1 << 16  # real headers are ~200 bytes

# dtypes a KV cache may be stored in, by their torch attribute name.
_DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in _DTYPE_NAMES if hasattr(torch, name)}
_NAME_OF: dict[torch.dtype, str] = {dt: name for name, dt in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Canonical name of a supported dtype, e.g. ``"bfloat16"``."""
    try:
        return _NAME_OF[dtype]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {dtype}; supported: {', '.join(DTYPES)}") from None


# eq=False: the generated __eq__ would compare tensors elementwise and then
# fail in bool(); identity semantics are what a cache entry needs.
@dataclass(frozen=True, eq=False)
class ChunkKV:
    """KV cache of one chunk.

    ``kv`` has shape ``[num_layers, 2, num_kv_heads, num_tokens, head_dim]``;
    ``kv[:, 0]`` is K *before* RoPE and ``kv[:, 1]`` is V (see
    ``keys.RECIPE_VERSION``). A tensor that is not on CPU, not contiguous or
    requires grad is copied to a detached contiguous CPU tensor on
    construction, so ``kv`` always satisfies that invariant.

    In a coded store (``kv_codec``) ``kv`` is a ``CodedKV`` of that shape
    and dtype instead: ``values()`` decodes it, and the walk decodes one
    layer at a time where it computes (``CodedKV.layer``).
    """

    key: str
    kv: torch.Tensor | CodedKV
    # The chunk's token ids (what ``key`` hashes), when known: kept in the
    # entry's header so calibration can build probes from a store's chunks.
    token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key:
            raise ValueError("ChunkKV.key must be a non-empty str")
        kv = self.kv
        if not isinstance(kv, (torch.Tensor, CodedKV)):
            raise TypeError(f"ChunkKV.kv must be a torch.Tensor or a CodedKV, got {type(kv).__name__}")
        if len(kv.shape) != 5 or kv.shape[1] != 2:
            raise ValueError(
                f"ChunkKV.kv must have shape [num_layers, 2, num_kv_heads, num_tokens, head_dim], got {tuple(kv.shape)}"
            )
        dtype_name(kv.dtype)  # raises for unsupported dtypes
        if isinstance(kv, torch.Tensor) and (kv.device.type != "cpu" or not kv.is_contiguous() or kv.requires_grad):
            object.__setattr__(self, "kv", kv.detach().to("cpu").contiguous())
        if self.token_ids is not None:
            ids = tuple(int(t) for t in self.token_ids)
            if len(ids) != kv.shape[3]:
                raise ValueError(f"ChunkKV.token_ids holds {len(ids)} tokens, its kv {kv.shape[3]}")
            object.__setattr__(self, "token_ids", ids)

    @property
    def num_layers(self) -> int:
        return self.kv.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv.shape[2]

    @property
    def num_tokens(self) -> int:
        return self.kv.shape[3]

    @property
    def head_dim(self) -> int:
        return self.kv.shape[4]

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    @property
    def codec(self) -> str | None:
        """The codec ``kv`` is held in (None: raw values)."""
        return self.kv.codec if isinstance(self.kv, CodedKV) else None

    @property
    def nbytes(self) -> int:
        """Bytes ``kv`` holds (a coded entry: its codes and scales)."""
        kv = self.kv
        return kv.nbytes if isinstance(kv, CodedKV) else kv.numel() * kv.element_size()

    def values(self) -> torch.Tensor:
        """``kv`` as a tensor (a coded entry decoded on the CPU)."""
        return self.kv.decode() if isinstance(self.kv, CodedKV) else self.kv

    def __repr__(self) -> str:
        coded = f", codec={self.codec}" if self.codec else ""
        return f"ChunkKV(key={self.key[:16]!r}..., shape={tuple(self.kv.shape)}, dtype={dtype_name(self.dtype)}{coded})"


def _require_little_endian() -> None:
    # Payload bytes are the in-memory tensor bytes; only valid as
    # little-endian on a little-endian host (every platform torch ships for).
    if sys.byteorder != "little":
        raise NotImplementedError("chunk KV format requires a little-endian host")


def encode(entry: ChunkKV) -> bytes:
    """Serialise ``entry`` to the format described in the module docstring,
    in the codec its key names (``keys.coded_key``; raw for a plain key)."""
    _require_little_endian()
    kv = entry.kv
    codec = key_codec(entry.key)
    if isinstance(kv, CodedKV) and kv.codec == codec:
        payload = kv.payload.reshape(-1)
    else:
        values = entry.values()
        payload = values.reshape(-1).view(torch.uint8) if codec is None else encode_kv(values, codec).reshape(-1)
    payload_bytes = payload.numel()
    fields = {"key": entry.key, "dtype": dtype_name(kv.dtype), "shape": list(kv.shape), "payload_bytes": payload_bytes}
    if codec is not None:
        fields["codec"] = codec
    if entry.token_ids is not None:
        fields["tokens"] = list(entry.token_ids)
    header = json.dumps(fields, separators=(",", ":")).encode("utf-8")
    if "tokens" in fields and _PREFIX.size + len(header) + _ALIGN > _MAX_HEADER_BYTES:  # a very long chunk: no tokens
        del fields["tokens"]
        header = json.dumps(fields, separators=(",", ":")).encode("utf-8")
    # Pad with spaces (valid JSON whitespace) so the payload is aligned and a
    # reader can map a tensor straight onto it.
    header += b" " * (-(_PREFIX.size + len(header)) % _ALIGN)
    payload_start = _PREFIX.size + len(header)
    total = payload_start + payload_bytes + _CRC.size

    buf = bytearray(total)
    _PREFIX.pack_into(buf, 0, MAGIC, FORMAT_VERSION, len(header))
    buf[_PREFIX.size : payload_start] = header
    if payload_bytes:
        # Copy the tensor straight into the output buffer (no numpy needed).
        dst = torch.frombuffer(buf, dtype=torch.uint8, count=payload_bytes, offset=payload_start)
        dst.copy_(payload)
        del dst
    with memoryview(buf) as mv:
        crc = zlib.crc32(mv[: total - _CRC.size])
    _CRC.pack_into(buf, total - _CRC.size, crc)
    # diskcache stores only exact ``bytes`` raw; anything else it would pickle.
    return bytes(buf)


def decode(data: bytes | bytearray | memoryview, *, expected_key: str) -> ChunkKV:
    """Parse and verify one entry; raise :class:`CorruptEntryError` if it is
    damaged, of an unknown version, or stored under another key.

    The returned tensor owns its memory (one copy of the payload); ``data``
    may be discarded or modified afterwards.
    """
    return _decode(data, expected_key=expected_key, adopt=False)


@dataclass
class Layout:
    """Where an entry's parts are, read from its first bytes (``read_layout``)."""

    header: dict
    payload_start: int
    payload_bytes: int
    total: int  # the whole entry: header, payload and checksum

    @property
    def codec(self) -> str | None:
        """The entry's KV codec (None: raw); valid once ``check`` has passed."""
        return self.header.get("codec")

    def layer_bytes(self, shape: list[int]) -> int:
        """Bytes of one layer of the payload (every layer has as many)."""
        return self.payload_bytes // max(1, shape[0])

    def check(self, expected_key: str) -> tuple[str, torch.dtype, list[int]]:
        """The header's key, dtype and shape, checked (raise CorruptEntryError)."""
        header = self.header
        key = header.get("key")
        if not isinstance(key, str):
            raise CorruptEntryError(f"bad header: key={key!r}")
        codec = header.get("codec")
        if codec is not None and codec not in KV_CODECS:
            raise CorruptEntryError(
                f"unknown KV codec {codec!r}: this code reads raw entries and {', '.join(KV_CODECS)}"
            )
        name = header.get("dtype")
        dtype = DTYPES.get(name) if isinstance(name, str) else None
        if dtype is None:
            raise CorruptEntryError(f"unknown dtype {name!r}")
        shape = header.get("shape")
        if (
            not isinstance(shape, list)
            or len(shape) != 5
            or any(type(d) is not int or d < 0 for d in shape)
            or shape[1] != 2
        ):
            raise CorruptEntryError(
                f"bad shape {shape!r}; expected [num_layers, 2, num_kv_heads, num_tokens, head_dim]"
            )
        if codec is None:
            needed = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        else:
            needed = shape[0] * layer_bytes(codec, shape[2], shape[3], shape[4])
        if needed != self.payload_bytes:
            kind = name if codec is None else f"{name} coded {codec}"
            raise CorruptEntryError(
                f"shape {shape} of {kind} needs {needed} bytes but payload has {self.payload_bytes}"
            )
        if key != expected_key:
            raise CorruptEntryError(f"foreign entry: holds key {key[:16]}..., expected {expected_key[:16]}...")
        if codec != key_codec(key):
            raise CorruptEntryError(f"entry coded {codec or 'raw'} under a key for {key_codec(key) or 'raw'} entries")
        self.token_ids(shape)
        return key, dtype, shape

    def token_ids(self, shape: list[int]) -> tuple[int, ...] | None:
        """The header's token ids (None: not kept), checked against ``shape``
        (raise CorruptEntryError)."""
        tokens = self.header.get("tokens")
        if tokens is None:
            return None
        if (
            not isinstance(tokens, list)
            or len(tokens) != shape[3]
            or any(type(t) is not int or not 0 <= t < 1 << 31 for t in tokens)
        ):
            raise CorruptEntryError(f"bad header: tokens must be {shape[3]} token ids")
        return tuple(tokens)


def read_layout(head: memoryview, n: int) -> Layout:
    """Parse the prefix and JSON header from ``head`` (an entry's first bytes,
    the whole header included) of an entry of ``n`` bytes in all; raise
    CorruptEntryError if they, or ``n``, are not what the format says."""
    minimum = _PREFIX.size + _CRC.size
    if n < minimum:
        raise CorruptEntryError(f"truncated entry: {n} bytes, shorter than the {minimum}-byte minimum")
    magic, version, header_len = _PREFIX.unpack_from(head, 0)
    if magic != MAGIC:
        raise CorruptEntryError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r}); not a chunk KV entry")
    if version != FORMAT_VERSION:
        raise CorruptEntryError(f"unknown format version {version} (this code reads version {FORMAT_VERSION})")
    if header_len > _MAX_HEADER_BYTES:
        raise CorruptEntryError(f"implausible header length {header_len}")
    payload_start = _PREFIX.size + header_len
    if payload_start + _CRC.size > n:
        raise CorruptEntryError(f"truncated entry: {n} bytes, but the header alone needs {payload_start + _CRC.size}")
    try:
        header = json.loads(bytes(head[_PREFIX.size : payload_start]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptEntryError(f"bad JSON header: {e}") from None
    if not isinstance(header, dict):
        raise CorruptEntryError("bad JSON header: not an object")

    payload_bytes = header.get("payload_bytes")
    if type(payload_bytes) is not int or payload_bytes < 0:
        raise CorruptEntryError(f"bad header: payload_bytes={payload_bytes!r}")
    expected_total = payload_start + payload_bytes + _CRC.size
    if n < expected_total:
        raise CorruptEntryError(f"truncated entry: {n} bytes, expected {expected_total}")
    if n > expected_total:
        raise CorruptEntryError(f"entry has {n - expected_total} unexpected trailing bytes")
    return Layout(header, payload_start, payload_bytes, expected_total)


def geometry_mismatch(got: tuple, expect: tuple | None) -> str | None:
    """Why an entry of ``got = (num_layers, num_kv_heads, num_tokens,
    head_dim, dtype)`` doesn't match ``expect``, or None if it does (or
    nothing is expected)."""
    if expect is None or tuple(expect) == tuple(got):
        return None
    return (
        "entry does not match the expected (num_layers, num_kv_heads, num_tokens, head_dim, "
        f"dtype): got {tuple(got)}, expected {tuple(expect)}"
    )


PREFIX_BYTES = _PREFIX.size
CRC_BYTES = _CRC.size


def header_end(prefix: bytes | bytearray) -> int:
    """Where the header ends (the payload starts), from an entry's first
    ``PREFIX_BYTES``: how much a reader fetches before ``read_layout``."""
    if len(prefix) < _PREFIX.size:
        return _PREFIX.size  # too short to say; read_layout reports it
    return _PREFIX.size + min(_PREFIX.unpack_from(prefix, 0)[2], _MAX_HEADER_BYTES)


def crc_of(stored: bytes) -> int:
    """The checksum stored in an entry's last ``CRC_BYTES``."""
    return _CRC.unpack(stored)[0]


def _decode(data: bytes | bytearray | memoryview, *, expected_key: str, adopt: bool) -> ChunkKV:
    """``adopt=True`` (for buffers the caller hands over, e.g. a bytearray
    just read from a file): the tensor is a view into ``data`` instead of a
    copy, saving a full copy of the payload. Only a bytearray is adopted;
    anything else is copied."""
    _require_little_endian()
    mv = memoryview(data)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    n = len(mv)
    layout = read_layout(mv, n)
    (stored_crc,) = _CRC.unpack_from(mv, n - _CRC.size)
    actual_crc = zlib.crc32(mv[: n - _CRC.size])
    if actual_crc != stored_crc:
        raise CorruptEntryError(f"checksum mismatch (stored crc32 {stored_crc:08x}, computed {actual_crc:08x})")
    key, dtype, shape = layout.check(expected_key)
    payload_start, payload_bytes = layout.payload_start, layout.payload_bytes
    numel = math.prod(shape)
    if numel == 0:
        kv = torch.empty(shape, dtype=dtype)
    elif layout.codec is not None:
        if not (adopt and type(data) is bytearray):  # torch reads only a writable buffer without a warning
            data, payload_start = bytearray(mv[payload_start : payload_start + payload_bytes]), 0
        payload = torch.frombuffer(data, dtype=torch.uint8, count=payload_bytes, offset=payload_start)
        payload = payload.view(shape[0], -1)
        check_scales(payload, layout.codec, shape[2], shape[3], shape[4])
        kv = CodedKV(payload, layout.codec, tuple(shape), dtype)
    elif adopt and type(data) is bytearray:
        # View into the caller's buffer; the tensor keeps ``data`` alive.
        kv = torch.frombuffer(data, dtype=dtype, count=numel, offset=payload_start).view(shape)
    else:
        own = bytearray(mv[payload_start : payload_start + payload_bytes])
        kv = torch.frombuffer(own, dtype=dtype).view(shape)
    return ChunkKV(key=key, kv=kv, token_ids=layout.token_ids(shape))


# -- records ---------------------------------------------------------------
#
# A record is a small named blob kept beside the chunk entries (see
# ``ChunkStore.put_record``). Layout (integers little-endian)::
#
#     b"BLRC"            4 bytes   magic
#     version            uint32    RECORD_FORMAT_VERSION
#     name_len           uint32    length of the name
#     name               ASCII     the record's name, so a copy under another name is refused
#     payload_len        uint32    length of the payload
#     payload            the record's bytes
#     crc32              uint32    zlib.crc32 of every byte before it

RECORD_MAGIC = b"BLRC"
RECORD_FORMAT_VERSION = 1
MAX_RECORD_BYTES = 1 << 20  # largest payload
MAX_RECORD_NAME = 200
_RECORD_NAME = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_RECORD_NAME}}}")
_RECORD_PREFIX = struct.Struct("<4sII")  # magic, version, name_len
_RECORD_LEN = struct.Struct("<I")  # payload_len
# The largest well-formed record: what a reader needs to read at most.
MAX_RECORD_ENCODED = _RECORD_PREFIX.size + MAX_RECORD_NAME + _RECORD_LEN.size + MAX_RECORD_BYTES + _CRC.size


def check_record_name(name: object) -> str:
    """``name`` if it is a valid record name (a str of 1 to 200 characters
    from ``A-Z a-z 0-9 . _ : -``); raise ValueError saying why not."""
    if not isinstance(name, str):
        raise ValueError(f"record name must be a str, got {type(name).__name__}")
    if not _RECORD_NAME.fullmatch(name):
        if not name or len(name) > MAX_RECORD_NAME:
            raise ValueError(f"record name must be 1 to {MAX_RECORD_NAME} characters long, got {len(name)}")
        bad = sorted({c for c in name if not _RECORD_NAME.fullmatch(c)})
        raise ValueError(f"record name {name!r} has characters other than A-Z a-z 0-9 . _ : - ({''.join(bad)!r})")
    return name


def encode_record(name: str, data: bytes | bytearray) -> bytes:
    """Frame ``data`` as the record ``name`` (layout above). Raises
    ValueError for a bad name or a payload over ``MAX_RECORD_BYTES``,
    TypeError if ``data`` is not bytes or bytearray."""
    check_record_name(name)
    if not isinstance(data, (bytes, bytearray)):
        raise TypeError(f"record data must be bytes or bytearray, got {type(data).__name__}")
    if len(data) > MAX_RECORD_BYTES:
        raise ValueError(f"record data is {len(data)} bytes; the limit is {MAX_RECORD_BYTES} (1 MiB)")
    raw = name.encode("ascii")
    body = b"".join(
        (_RECORD_PREFIX.pack(RECORD_MAGIC, RECORD_FORMAT_VERSION, len(raw)), raw, _RECORD_LEN.pack(len(data)), data)
    )
    return body + _CRC.pack(zlib.crc32(body))


def decode_record(raw: bytes | bytearray | memoryview, expected_name: str) -> bytes:
    """The payload of a record read back; raise ``CorruptEntryError`` if it
    is truncated, has trailing bytes, a bad magic, an unknown version or a
    bad checksum, or holds another record than ``expected_name``."""
    check_record_name(expected_name)
    mv = memoryview(raw).cast("B")
    n = len(mv)
    minimum = _RECORD_PREFIX.size + _RECORD_LEN.size + _CRC.size
    if n < _RECORD_PREFIX.size:
        raise CorruptEntryError(f"truncated record: {n} bytes, shorter than the {minimum}-byte minimum")
    magic, version, name_len = _RECORD_PREFIX.unpack_from(mv, 0)
    if magic != RECORD_MAGIC:
        raise CorruptEntryError(f"bad magic {bytes(magic)!r} (expected {RECORD_MAGIC!r}); not a record")
    if version != RECORD_FORMAT_VERSION:
        raise CorruptEntryError(
            f"unknown record format version {version} (this code reads version {RECORD_FORMAT_VERSION})"
        )
    if name_len > MAX_RECORD_NAME:
        raise CorruptEntryError(f"implausible record name length {name_len}")
    len_at = _RECORD_PREFIX.size + name_len
    if n < len_at + _RECORD_LEN.size + _CRC.size:
        needs = len_at + _RECORD_LEN.size + _CRC.size
        raise CorruptEntryError(f"truncated record: {n} bytes, but an empty record named so needs {needs}")
    (payload_len,) = _RECORD_LEN.unpack_from(mv, len_at)
    if payload_len > MAX_RECORD_BYTES:
        raise CorruptEntryError(f"implausible record payload length {payload_len}")
    payload_at = len_at + _RECORD_LEN.size
    expected_total = payload_at + payload_len + _CRC.size
    if n < expected_total:
        raise CorruptEntryError(f"truncated record: {n} bytes, expected {expected_total}")
    if n > expected_total:
        raise CorruptEntryError(f"record has {n - expected_total} unexpected trailing bytes")
    (stored_crc,) = _CRC.unpack_from(mv, n - _CRC.size)
    actual_crc = zlib.crc32(mv[: n - _CRC.size])
    if actual_crc != stored_crc:
        raise CorruptEntryError(f"record checksum mismatch (stored crc32 {stored_crc:08x}, computed {actual_crc:08x})")
    name = bytes(mv[_RECORD_PREFIX.size : len_at])
    if name != expected_name.encode("ascii"):
        shown = repr(name.decode("ascii")) if name.isascii() else repr(name)
        raise CorruptEntryError(f"foreign record: holds {shown}, expected {expected_name!r}")
    return bytes(mv[payload_at : payload_at + payload_len])
