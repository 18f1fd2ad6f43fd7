"""Tests for blend_integrations.store: keys, entry format, and the two-tier store.

Real diskcache directories under tmp_path, real processes; no mocks.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import multiprocessing as mp
import os
import resource
import signal
import struct
import zlib
from pathlib import Path

import diskcache
import pytest
import torch

from blend_integrations.store import (
    RECIPE_VERSION,
    ChunkKV,
    ChunkStore,
    CorruptEntryError,
    StoreStats,
    chunk_key,
    default_store_path,
    model_fingerprint,
)
from blend_integrations.store.format import decode, encode
from blend_integrations.store.keys import _window_offsets
from tests.fixtures.entries import make_entry, make_kv, same, val_files

KEY = "ab" * 32


def rewrite_header(data: bytes, **changes) -> bytes:
    """Re-encode ``data`` with header fields changed and a *valid* checksum,
    to reach the checks that come after the checksum."""
    _, version, header_len = struct.unpack_from("<4sII", data)
    header = json.loads(data[12 : 12 + header_len])
    header.update(changes)
    new_header = json.dumps(header).encode()
    new_header += b" " * (-(12 + len(new_header)) % 64)
    body = struct.pack("<4sII", b"BLKV", version, len(new_header)) + new_header + data[12 + header_len : -4]
    return body + struct.pack("<I", zlib.crc32(body))


def with_crc(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


# --------------------------------------------------------------------------
# format


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_roundtrip_bit_exact(dtype):
    kv = make_kv(1, dtype=dtype)
    kv.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-30]).to(dtype)
    entry = ChunkKV(KEY, kv)
    data = encode(entry)
    assert isinstance(data, bytes) and data[:4] == b"BLKV"
    out = decode(data, expected_key=KEY)
    assert same(out, entry)
    assert out.kv.is_contiguous() and out.kv.device.type == "cpu"
    # The decoded tensor owns its memory: writable, independent of ``data``.
    out.kv.zero_()
    assert same(decode(data, expected_key=KEY), entry)
    # memoryview and bytearray inputs work too
    assert same(decode(memoryview(data), expected_key=KEY), entry)
    assert same(decode(bytearray(data), expected_key=KEY), entry)


def test_chunkkv_properties_and_validation():
    entry = ChunkKV(KEY, make_kv(layers=3, heads=4, tokens=7, head_dim=16, dtype=torch.bfloat16))
    assert (entry.num_layers, entry.num_kv_heads, entry.num_tokens, entry.head_dim) == (3, 4, 7, 16)
    assert entry.dtype == torch.bfloat16
    assert entry.nbytes == 3 * 2 * 4 * 7 * 16 * 2
    # non-contiguous input is made contiguous
    t = make_kv().transpose(3, 4).contiguous().transpose(3, 4)
    assert not t.is_contiguous()
    assert ChunkKV(KEY, t).kv.is_contiguous()
    with pytest.raises(ValueError, match="shape"):
        ChunkKV(KEY, torch.zeros(2, 3, 2, 5, 8))
    with pytest.raises(ValueError, match="dtype"):
        ChunkKV(KEY, torch.zeros(2, 2, 2, 5, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="key"):
        ChunkKV("", make_kv())


def test_roundtrip_zero_tokens():
    entry = ChunkKV(KEY, make_kv(tokens=0))
    out = decode(encode(entry), expected_key=KEY)
    assert out.kv.shape == (2, 2, 2, 0, 8)


def test_decode_rejects_every_truncation():
    data = encode(ChunkKV(KEY, make_kv(tokens=2, head_dim=4)))
    for n in range(len(data)):
        with pytest.raises(CorruptEntryError):
            decode(data[:n], expected_key=KEY)
    with pytest.raises(CorruptEntryError, match="trailing"):
        decode(data + b"\0", expected_key=KEY)


def test_decode_errors_name_the_problem():
    data = encode(ChunkKV(KEY, make_kv()))
    cases = {
        "bad magic": b"XXXX" + data[4:],
        "unknown format version": data[:4] + struct.pack("<I", 99) + data[8:],
        "truncated": data[:-10],
        "bad JSON": with_crc(data[:12] + b"{not json" + data[21:-4]),
        "checksum mismatch": data[:-5] + bytes([data[-5] ^ 1]) + data[-4:],
        "foreign entry": encode(ChunkKV("cd" * 32, make_kv())),
        "unknown dtype": rewrite_header(data, dtype="complex32"),
        "needs": rewrite_header(data, shape=[2, 2, 2, 5, 9]),  # shape vs payload size
        "bad shape": rewrite_header(data, shape=[2, 3, 2, 5, 8]),
    }
    for expected, bad in cases.items():
        with pytest.raises(CorruptEntryError, match=expected):
            decode(bad, expected_key=KEY)
    # the crafted entries are otherwise well-formed
    assert same(decode(rewrite_header(data), expected_key=KEY), ChunkKV(KEY, make_kv()))


def test_an_entry_keeps_its_token_ids_and_they_are_checked():
    tokens = (5, 17, 0, 49151, 3)
    data = encode(ChunkKV(KEY, make_kv(), token_ids=tokens))
    assert decode(data, expected_key=KEY).token_ids == tokens
    assert decode(encode(ChunkKV(KEY, make_kv())), expected_key=KEY).token_ids is None  # not known: not kept
    for bad in ([1, 2, 3], [1, 2, 3, 4, "5"], [1, 2, 3, 4, -5], [1, 2, 3, 4, 5.0], "12345"):
        with pytest.raises(CorruptEntryError, match="tokens must be 5 token ids"):
            decode(rewrite_header(data, tokens=bad), expected_key=KEY)
    with pytest.raises(ValueError, match="token_ids holds 4 tokens, its kv 5"):
        ChunkKV(KEY, make_kv(), token_ids=(1, 2, 3, 4))
    # a chunk whose tokens would not fit the header is stored without them
    long = ChunkKV(KEY, make_kv(tokens=12000, layers=1, heads=1, head_dim=1), token_ids=range(100000, 112000))
    assert decode(encode(long), expected_key=KEY).token_ids is None


def test_the_store_lists_one_model_s_chunks_by_their_tokens(tmp_path):
    """chunk_token_ids reads the headers on disk (files and small inline
    entries), keeps those whose key the tokens give, most recently used first."""

    def keys_of(model: str):
        return lambda ids: chunk_key(fingerprint=model, dtype="float32", token_ids=ids, bos_token_id=None)

    keys_a, keys_b = keys_of("model-a"), keys_of("model-b")
    with ChunkStore(tmp_path / "s", memory_limit_bytes=0, remote="") as store:
        for i, (keys, n) in enumerate([(keys_a, 5), (keys_b, 5), (keys_a, 400), (keys_a, 5)]):
            ids = list(range(10 * i, 10 * i + n))
            store.put(ChunkKV(keys(ids), make_kv(i, tokens=n), token_ids=ids))
        store.put(ChunkKV(keys_a([7, 7]), make_kv(9, tokens=2)))  # stored without tokens: not listed
        store.put(ChunkKV(keys_a([1, 2, 3, 4, 5]), make_kv(8), token_ids=(9, 9, 9, 9, 9)))  # tokens of another key
        assert store.chunk_token_ids(keys_a) == [list(range(30, 35)), list(range(20, 420)), list(range(5))]
        assert store.chunk_token_ids(keys_b) == [list(range(10, 15))]
        assert store.chunk_token_ids(keys_a, limit=1) == [list(range(30, 35))]
        store.get(keys_a(list(range(5))))  # read: now the most recently used
        assert store.chunk_token_ids(keys_a)[0] == list(range(5))
    with ChunkStore(tmp_path / "s", remote="") as store:  # a new process's view: the disk tier
        assert len(store.chunk_token_ids(keys_a)) == 3


def test_decode_flipped_payload_byte():
    data = bytearray(encode(ChunkKV(KEY, make_kv())))
    data[len(data) // 2] ^= 0x40
    with pytest.raises(CorruptEntryError, match="checksum"):
        decode(bytes(data), expected_key=KEY)


# --------------------------------------------------------------------------
# keys

BASE = dict(fingerprint="f" * 64, dtype="float32", token_ids=[1, 2, 3], bos_token_id=1)


def test_chunk_key_stable_and_sensitive():
    k = chunk_key(**BASE)
    assert k == chunk_key(**BASE) and len(k) == 64
    assert chunk_key(**BASE, recipe=RECIPE_VERSION) == k
    variants = [
        dict(recipe="chunk-kv-v2"),
        dict(fingerprint="e" * 64),
        dict(dtype="bfloat16"),
        dict(bos_token_id=None),
        dict(bos_token_id=2),
        dict(token_ids=[1, 2]),
        dict(token_ids=[1, 2, 3, 0]),
        dict(token_ids=[3, 2, 1]),
        dict(token_ids=[1, 2, 3 + 2**32]),
        dict(token_ids=[]),
    ]
    keys = {k}
    for change in variants:
        keys.add(chunk_key(**{**BASE, **change}))
    assert len(keys) == len(variants) + 1


def test_chunk_key_normalises_inputs():
    k = chunk_key(**BASE)
    assert chunk_key(**{**BASE, "dtype": torch.float32}) == k
    assert chunk_key(**{**BASE, "dtype": "torch.float32"}) == k
    assert chunk_key(**{**BASE, "token_ids": torch.tensor([1, 2, 3])}) == k
    assert chunk_key(**{**BASE, "token_ids": (1, 2, 3)}) == k
    with pytest.raises(TypeError):
        chunk_key(**{**BASE, "token_ids": [1.0, 2.0]})
    with pytest.raises(ValueError):
        chunk_key(**{**BASE, "fingerprint": ""})


def write_model(d: Path, weights: dict[str, bytes], config: bytes = b'{"model_type": "llama"}') -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_bytes(config)
    for name, data in weights.items():
        (d / name).write_bytes(data)
    return d


def test_model_fingerprint(tmp_path):
    a = write_model(tmp_path / "a", {"model.safetensors": b"\x01" * 1000})
    b = write_model(tmp_path / "b", {"model.safetensors": b"\x01" * 1000})
    c = write_model(tmp_path / "c", {"model.safetensors": b"\x01" * 999 + b"\x02"})
    d = write_model(tmp_path / "d", {"model.safetensors": b"\x01" * 1000}, config=b"{}")
    e = write_model(tmp_path / "e", {"other.safetensors": b"\x01" * 1000})
    f = write_model(tmp_path / "f", {"model.safetensors": b"\x01" * 1000, "README.md": b"x"})
    fa = model_fingerprint(a)
    assert len(fa) == 64
    assert fa == model_fingerprint(b) == model_fingerprint(str(b)) == model_fingerprint(f)
    assert len({fa, model_fingerprint(c), model_fingerprint(d), model_fingerprint(e)}) == 4


def test_model_fingerprint_missing_files(tmp_path):
    (tmp_path / "noconfig").mkdir()
    (tmp_path / "noconfig" / "model.safetensors").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="config.json"):
        model_fingerprint(tmp_path / "noconfig")
    write_model(tmp_path / "noweights", {})
    with pytest.raises(FileNotFoundError, match="weight"):
        model_fingerprint(tmp_path / "noweights")
    with pytest.raises(FileNotFoundError):
        model_fingerprint(tmp_path / "does-not-exist")


def test_model_fingerprint_samples_large_files(tmp_path):
    size = 3 * 2**20
    blob = bytearray(os.urandom(size))
    d = write_model(tmp_path / "m", {"model-00001-of-00001.safetensors": bytes(blob)})
    fp = model_fingerprint(d)

    offsets = _window_offsets(size)
    assert len(offsets) == 64 and offsets[0] == 0 and offsets[-1] == size - 4096
    assert size > 64 * 4096  # so only part of the file is read

    def fp_with_byte_flipped(pos: int) -> str:
        changed = bytearray(blob)
        changed[pos] ^= 0xFF
        (d / "model-00001-of-00001.safetensors").write_bytes(changed)
        return model_fingerprint(d)

    # bytes inside sampled windows (start, end, a middle window) count ...
    assert fp_with_byte_flipped(0) != fp
    assert fp_with_byte_flipped(size - 1) != fp
    assert fp_with_byte_flipped(offsets[30] + 100) != fp
    # ... a byte between windows doesn't: the documented cost of sampling
    gap = offsets[30] + 4096 + 10
    assert gap < offsets[31]
    assert fp_with_byte_flipped(gap) == fp
    # size always counts
    (d / "model-00001-of-00001.safetensors").write_bytes(bytes(blob) + b"\0")
    assert model_fingerprint(d) != fp


# --------------------------------------------------------------------------
# store basics


def test_default_store_path(monkeypatch, tmp_path):
    monkeypatch.setenv("BLEND_STORE_PATH", str(tmp_path / "s"))
    assert default_store_path() == tmp_path / "s"
    monkeypatch.delenv("BLEND_STORE_PATH")
    assert default_store_path() == Path.home() / ".cache" / "blend_integrations" / "chunks"


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(size_limit_bytes=0), "size_limit_bytes"),
        (dict(size_limit_bytes=-1), "size_limit_bytes"),
        (dict(size_limit_bytes=1.5), "size_limit_bytes"),
        (dict(memory_limit_bytes=-1), "memory_limit_bytes"),
        (dict(memory_limit_bytes="1"), "memory_limit_bytes"),
        (dict(remote_retry_s=-1), "remote_retry_s"),
        (dict(remote_retry_s="5"), "remote_retry_s"),
        (dict(remote_backfill_max_keys=-1), "remote_backfill_max_keys"),
        (dict(remote_backfill_max_keys=1.5), "remote_backfill_max_keys"),
    ],
)
def test_store_validates_args(tmp_path, kwargs, name):
    with pytest.raises(ValueError, match=name):
        ChunkStore(tmp_path, **kwargs)


def test_put_get_tiers_and_stats(tmp_path):
    with ChunkStore(tmp_path / "s") as store:
        assert store.path == tmp_path / "s"
        assert isinstance(store.stats, StoreStats)
        small, big = make_entry(0), make_entry(1, nbytes=100_000)  # inline blob / file
        assert store.get(small.key) is None
        for e in (small, big):
            store.put(e)
            assert e.key in store
        assert len(store) == 2
        assert store.get(small.key) is small  # memory tier
        assert store.stats.memory_hits == 1 and store.stats.misses == 1
        assert store.stats.puts == 2 and store.stats.bytes_written > big.nbytes
        assert "ChunkStore(" in repr(store)

    # A new instance on the same path sees both entries, from disk.
    with ChunkStore(tmp_path / "s") as store2:
        assert len(store2) == 2
        for e in (small, big):
            got = store2.get(e.key, expect=(2, 2, e.num_tokens, 8, torch.float32))
            assert got is not None and same(got, e)
            got.kv.add_(1)  # decoded tensors are writable (own/adopt their buffer)
        assert store2.stats.disk_hits == 2 and store2.stats.bytes_read > big.nbytes
        assert store2.get(big.key) is not None
        assert store2.stats.memory_hits == 1  # promoted
        assert store2.stats.hits == 3 and store2.stats.corrupt == 0
        store2.clear()
        assert len(store2) == 0 and small.key not in store2
        assert val_files(tmp_path / "s") == []


def test_memory_tier_disabled(tmp_path):
    with ChunkStore(tmp_path, memory_limit_bytes=0) as store:
        e = make_entry(0)
        store.put(e)
        assert store.get(e.key) is not e and same(store.get(e.key), e)
        assert store.stats.memory_hits == 0 and store.stats.disk_hits == 2


def test_memory_lru_eviction(tmp_path):
    entries = [make_entry(i) for i in range(4)]
    size = entries[0].nbytes
    with ChunkStore(tmp_path, memory_limit_bytes=3 * size) as store:
        for e in entries[:3]:
            store.put(e)
        assert store.get(entries[0].key) is entries[0]  # 0 is now most recent
        store.put(entries[3])  # evicts 1, the least recently used
        assert store._memory.keys() == [entries[2].key, entries[0].key, entries[3].key]
        assert store._memory.nbytes == 3 * size
        hits = store.stats.memory_hits
        got = store.get(entries[1].key)  # from disk, promoted back (evicting 2)
        assert got is not entries[1] and same(got, entries[1])
        assert store.stats.memory_hits == hits and store.stats.disk_hits == 1
        assert entries[1].key in store._memory and entries[2].key not in store._memory
        # an entry larger than the whole memory tier goes to disk only
        huge = make_entry(9, nbytes=4 * size)
        store.put(huge)
        assert huge.key not in store._memory and huge.key in store
        assert store._memory.nbytes <= 3 * size
        assert same(store.get(huge.key), huge)


def test_disk_size_limit_evicts_lru(tmp_path):
    limit = 2**20
    with ChunkStore(tmp_path, size_limit_bytes=limit, memory_limit_bytes=0) as store:
        entries = [make_entry(i, nbytes=200_000) for i in range(12)]
        for n, e in enumerate(entries):
            store.put(e)
            assert store._disk.cache.volume() <= limit
            assert e.key in store  # the entry just written is never the one evicted
        present = [e.key in store for e in entries]
        k = sum(present)
        assert 3 <= k <= 5 and present == [False] * (12 - k) + [True] * k  # oldest went first
        assert len(store) == k and len(val_files(tmp_path)) == k
        # least recently *used*, not least recently written: reading the oldest
        # survivor keeps it alive while the next-oldest goes
        oldest, next_oldest = entries[12 - k], entries[12 - k + 1]
        assert same(store.get(oldest.key), oldest)
        store.put(make_entry(12, nbytes=200_000))
        assert oldest.key in store and next_oldest.key not in store
        # an entry bigger than the whole disk tier is kept in memory only
        huge = make_entry(13, nbytes=2 * limit)
        store.put(huge)
        assert oldest.key in store and huge.key not in store._disk.cache
        assert store.stats.corrupt == 0 and store.stats.errors == 0


# --------------------------------------------------------------------------
# corrupt and foreign entries


class _Evil:
    """Unpickling this creates a marker file: proves whether pickles run."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _corruptions(store: ChunkStore, tmp_path: Path, entry: ChunkKV):
    good = encode(entry)
    flipped = bytearray(good)
    flipped[len(flipped) // 2] ^= 0x01
    marker = tmp_path / "pwned"
    return {
        "flipped byte": lambda: store._disk.cache.set(entry.key, bytes(flipped)),
        "truncated": lambda: store._disk.cache.set(entry.key, good[: len(good) // 2]),
        "foreign": lambda: store._disk.cache.set(entry.key, encode(ChunkKV("ef" * 32, entry.kv))),
        "garbage": lambda: store._disk.cache.set(entry.key, b"\0" * 100),
        "plain diskcache pickle": lambda: diskcache.Cache(str(store.path)).set(entry.key, {"a": 1}),
        "malicious pickle": lambda: diskcache.Cache(str(store.path)).set(entry.key, _Evil(str(marker))),
        "big pickle": lambda: diskcache.Cache(str(store.path)).set(entry.key, [1] * 50_000),
        "int": lambda: diskcache.Cache(str(store.path)).set(entry.key, 7),
        "text": lambda: diskcache.Cache(str(store.path)).set(entry.key, "x" * 100_000),
    }


@pytest.mark.parametrize("nbytes", [None, 100_000], ids=["inline", "file"])
@pytest.mark.parametrize(
    "kind",
    [
        "flipped byte",
        "truncated",
        "foreign",
        "garbage",
        "plain diskcache pickle",
        "malicious pickle",
        "big pickle",
        "int",
        "text",
    ],
)
def test_corrupt_entry_dropped(tmp_path, caplog, kind, nbytes):
    entry = make_entry(3, nbytes=nbytes)
    with ChunkStore(tmp_path / "s") as store:
        _corruptions(store, tmp_path, entry)[kind]()
        assert entry.key in store
        with caplog.at_level(logging.WARNING, logger="blend_integrations.store"):
            assert store.get(entry.key) is None
            assert store.stats.corrupt == 1 and store.stats.misses == 1
            assert entry.key not in store and len(store) == 0
            # gone: the second get is a plain miss
            assert store.get(entry.key) is None
            assert store.stats.corrupt == 1 and store.stats.misses == 2
            # corrupt again: still dropped, but no second warning for this key
            _corruptions(store, tmp_path, entry)[kind]()
            assert store.get(entry.key) is None and store.stats.corrupt == 2
        warnings = [r for r in caplog.records if r.name == "blend_integrations.store"]
        assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
        assert entry.key[:16] in warnings[0].getMessage()
        assert not (tmp_path / "pwned").exists()
        # recompute and put: works again
        store.put(entry)
        store._memory.clear()
        assert same(store.get(entry.key), entry)
    # nothing orphaned: only the file of the final put (if it is big enough)
    assert len(val_files(tmp_path / "s")) == (0 if nbytes is None else 1)


def test_corrupt_file_on_disk(tmp_path, caplog):
    """Damage the value file diskcache wrote, as bit rot or a torn write would."""
    entry = make_entry(4, nbytes=100_000)
    with ChunkStore(tmp_path, memory_limit_bytes=0) as store:
        store.put(entry)
        (f,) = val_files(tmp_path)
        raw = bytearray(f.read_bytes())
        raw[5000] ^= 0x10
        f.write_bytes(raw)
        with caplog.at_level(logging.WARNING, logger="blend_integrations.store"):
            assert store.get(entry.key) is None
        assert "checksum" in caplog.text and store.stats.corrupt == 1
        assert val_files(tmp_path) == [] and entry.key not in store

        other = make_entry(5, nbytes=100_000)  # another key: warnings are once per key
        store.put(other)
        (f,) = val_files(tmp_path)
        f.write_bytes(f.read_bytes()[:-1000])  # truncated file
        with caplog.at_level(logging.WARNING, logger="blend_integrations.store"):
            assert store.get(other.key) is None and store.stats.corrupt == 2
        assert "truncated" in caplog.text and val_files(tmp_path) == []

        store.put(entry)
        assert same(store.get(entry.key), entry)


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_wrong_expect_is_dropped(tmp_path, tier):
    entry = make_entry(5)  # layers=2, heads=2, tokens=5, head_dim=8, float32
    right = (2, 2, 5, 8, torch.float32)
    wrongs = [
        (3, 2, 5, 8, torch.float32),
        (2, 1, 5, 8, torch.float32),
        (2, 2, 6, 8, torch.float32),
        (2, 2, 5, 16, torch.float32),
        (2, 2, 5, 8, torch.bfloat16),
    ]
    with ChunkStore(tmp_path, memory_limit_bytes=2**20 if tier == "memory" else 0) as store:
        for n, wrong in enumerate(wrongs, 1):
            store.put(entry)
            assert store.get(entry.key, expect=right) is not None
            assert store.get(entry.key, expect=wrong) is None
            assert store.stats.corrupt == n
            assert entry.key not in store and entry.key not in store._memory
        with pytest.raises(ValueError, match="expect"):
            store.get(entry.key, expect=(2, 2, 5))


# --------------------------------------------------------------------------
# disk failures


def test_disk_write_failure_is_swallowed(tmp_path, caplog):
    """A real write failure: RLIMIT_FSIZE makes writes past 512 KiB fail with
    EFBIG, as a full disk would fail them."""
    store = ChunkStore(tmp_path / "s")
    small = make_entry(0)
    store.put(small)
    big = make_entry(1, nbytes=2 * 2**20)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (512 * 1024, old_limit[1]))
        with caplog.at_level(logging.WARNING, logger="blend_integrations.store"):
            store.put(big)
            store.put(make_entry(2, nbytes=2 * 2**20))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert store.stats.errors == 2 and store.stats.puts == 3
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "disk write" in warnings[0].getMessage()
    assert store.get(big.key) is big  # memory tier still has it
    assert len(store) == 1
    assert len(val_files(tmp_path / "s")) == 0  # partial file cleaned up
    store.close()
    with ChunkStore(tmp_path / "s") as again:
        assert again.get(big.key) is None and same(again.get(small.key), small)


@pytest.fixture
def full_filesystem(tmp_path):
    """A real 8 MiB tmpfs, filled up to the last byte by a ballast file: (mount point, ballast)."""
    import subprocess

    mount = tmp_path / "small-fs"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if result.returncode != 0:  # the RLIMIT_FSIZE test above still covers failed writes
        pytest.skip(f"cannot mount a tmpfs here (needs root): {result.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(directory: Path) -> Path:
    """Write a ballast file until the filesystem is full (ENOSPC)."""
    ballast = directory / "ballast"
    with open(ballast, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
    return ballast


def test_full_disk_requests_complete_and_the_store_recovers(full_filesystem, model_dirs, docs, caplog):
    """Chunks cannot be written to a full filesystem (a real ENOSPC, on the
    store's files and its sqlite index): requests still answer as full prefill
    does, the failure is logged once, and once space is freed the store works again."""
    from blend_integrations import BlendPrompt, load_engine

    store = ChunkStore(full_filesystem / "store", memory_limit_bytes=0)  # only the disk tier
    ballast = fill(full_filesystem)
    engine = load_engine(model_dirs("llama"), store=store, device="cpu")
    prompt = BlendPrompt("Read.", docs, "Question: which city is named in the documents? Answer:")
    full = engine.generate(prompt, max_tokens=8, mode="full")
    with caplog.at_level(logging.WARNING, logger="blend_integrations.store"):
        for _ in range(2):
            blend = engine.generate(prompt, max_tokens=8, recompute_ratio=1.0)
            assert blend.token_ids == full.token_ids
            assert (blend.usage.chunks_hit, blend.usage.chunks_missed) == (0, len(docs))
    assert store.stats.errors >= len(docs)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "disk write" in warnings[0], warnings
    assert len(store) == 0

    ballast.unlink()  # space again: the next request stores its chunks, the one after hits them all
    engine.generate(prompt, max_tokens=8, recompute_ratio=1.0)
    again = engine.generate(prompt, max_tokens=8, recompute_ratio=1.0)
    assert again.token_ids == full.token_ids and again.usage.chunks_hit == len(docs)
    store.close()


# --------------------------------------------------------------------------
# several processes


def _writer_reader(path: str, worker: int, n_keys: int, rounds: int, start, out) -> None:
    """Write all keys (in a worker-specific order), then read them back through
    a fresh store with no memory tier, several rounds."""
    store = ChunkStore(path, memory_limit_bytes=0)
    start.wait(60)
    wrong = 0
    g = torch.Generator().manual_seed(worker)
    for _ in range(rounds):
        order = torch.randperm(n_keys, generator=g).tolist()
        for i in order:
            store.put(make_entry(i, nbytes=60_000 + 1_000 * i))
        for i in order:
            got = store.get(make_entry(i).key)
            if got is None or not same(got, make_entry(i, nbytes=60_000 + 1_000 * i)):
                wrong += 1
    out.put((worker, wrong, store.stats.corrupt, store.stats.errors, store.stats.disk_hits))
    store.close()


def test_two_processes_same_path(tmp_path):
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    n_keys, rounds = 12, 3
    procs = [ctx.Process(target=_writer_reader, args=(str(tmp_path), w, n_keys, rounds, start, out)) for w in range(2)]
    for p in procs:
        p.start()
    start.set()
    results = sorted(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for worker, wrong, corrupt, errors, disk_hits in results:
        assert (wrong, corrupt, errors) == (0, 0, 0), results
        assert disk_hits == n_keys * rounds
    with ChunkStore(tmp_path) as store:
        assert len(store) == n_keys
        assert len(val_files(tmp_path)) == n_keys  # no orphaned files
        for i in range(n_keys):
            assert same(store.get(make_entry(i).key), make_entry(i, nbytes=60_000 + 1_000 * i))


def _read_in_child(path: str, keys: list[str], out) -> None:
    with ChunkStore(path) as store:
        out.put([None if (e := store.get(k)) is None else encode(e) for k in keys])


def test_new_process_sees_entries(tmp_path):
    entries = [make_entry(0), make_entry(1, nbytes=100_000, dtype=torch.bfloat16)]
    with ChunkStore(tmp_path) as store:
        for e in entries:
            store.put(e)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_read_in_child, args=(str(tmp_path), [e.key for e in entries], out))
    p.start()
    got = out.get(timeout=120)
    p.join(60)
    assert p.exitcode == 0
    assert all(g is not None and same(decode(g, expected_key=e.key), e) for g, e in zip(got, entries))


def test_threads_share_one_store(tmp_path):
    import threading

    entries = [make_entry(i, nbytes=20_000 + 5_000 * i) for i in range(16)]
    store = ChunkStore(tmp_path, memory_limit_bytes=3 * entries[-1].nbytes)
    failures: list[str] = []

    def run(t: int) -> None:
        g = torch.Generator().manual_seed(t)
        for _ in range(60):
            e = entries[int(torch.randint(len(entries), (1,), generator=g))]
            if int(torch.randint(2, (1,), generator=g)):
                store.put(e)
            else:
                got = store.get(e.key)
                if got is not None and not same(got, e):
                    failures.append(e.key)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == [] and store.stats.corrupt == 0 and store.stats.errors == 0
    held = store._memory.keys()
    assert store._memory.nbytes == sum(e.nbytes for e in entries if e.key in held)
    assert store._memory.nbytes <= store.memory_limit_bytes
    store.close()


def _use_after_fork(store: ChunkStore, key: str, out) -> None:
    got = store.get(key)
    store.put(make_entry(8))
    out.put((got is not None, len(store)))


def test_store_usable_after_fork(tmp_path):
    store = ChunkStore(tmp_path)
    e = make_entry(7)
    store.put(e)
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    with contextlib.ExitStack() as held:  # every lock held by the parent at fork time: the child must not deadlock
        for lock in [store._report._lock] + [tier._lock for tier in store._tiers]:
            held.enter_context(lock)
        p = ctx.Process(target=_use_after_fork, args=(store, e.key, out))
        p.start()
    assert out.get(timeout=60) == (True, 2)
    p.join(60)
    assert p.exitcode == 0
    assert make_entry(8).key in store
    store.close()
