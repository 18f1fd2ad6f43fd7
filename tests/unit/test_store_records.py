"""Tests for the ChunkStore's records (``put_record``/``get_record``/
``delete_record``) and their framing (``format.encode_record``/
``decode_record``): real disk stores in tmp_path and a real redis-server (see
conftest.py: ``redis_server``, ``redis_url``); no mocks."""

from __future__ import annotations

import logging
import multiprocessing as mp
import struct
import time
import zlib

import pytest

from blend_integrations.store import ChunkStore, CorruptEntryError
from blend_integrations.store.format import (
    MAX_RECORD_BYTES,
    MAX_RECORD_ENCODED,
    RECORD_FORMAT_VERSION,
    decode_record,
    encode_record,
)
from blend_integrations.store.redis_tier import LRU, RECORD_PREFIX, SIZES, TOTAL
from tests.fixtures.entries import make_entry, same, val_files
from tests.fixtures.redis_server import free_port

LOGGER = "blend_integrations.store"
NAME = "calibration:model-abc.v1"
NAME_BYTES = NAME.encode()
DATA = b'{"layers": [0.12, 0.5, 0.99], "ratio": 0.15}'


def store_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def record_file(store: ChunkStore, name: str = NAME):
    return store.path / "records" / f"{name}.rec"


def flip(raw: bytes, at: int) -> bytes:
    damaged = bytearray(raw)
    damaged[at] ^= 0x01
    return bytes(damaged)


# --------------------------------------------------------------------------
# framing


def test_encode_decode_roundtrip():
    for data in (DATA, b"", bytearray(b"\x00\xff" * 100), b"x" * MAX_RECORD_BYTES):
        raw = encode_record(NAME, data)
        assert type(raw) is bytes and raw[:4] == b"BLRC"
        assert struct.unpack_from("<I", raw, 4)[0] == RECORD_FORMAT_VERSION
        assert raw[12 : 12 + len(NAME)] == NAME.encode()  # length-prefixed name
        assert struct.unpack_from("<I", raw, len(raw) - 4)[0] == zlib.crc32(raw[:-4])
        assert len(raw) <= MAX_RECORD_ENCODED
        got = decode_record(raw, NAME)
        assert got == data and type(got) is bytes
        assert decode_record(bytearray(raw), NAME) == data == decode_record(memoryview(raw), NAME)


def _with_crc(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


def _framed(
    *, magic=b"BLRC", version=RECORD_FORMAT_VERSION, name=NAME_BYTES, name_len=None, payload=DATA, payload_len=None
):
    """A record built field by field, with a valid checksum."""
    return _with_crc(
        struct.pack("<4sII", magic, version, len(name) if name_len is None else name_len)
        + name
        + struct.pack("<I", len(payload) if payload_len is None else payload_len)
        + payload
    )


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"", r"truncated record: 0 bytes"),
        (b"BLR", r"truncated record: 3 bytes"),
        (_framed(magic=b"BLKV"), r"bad magic b'BLKV' \(expected b'BLRC'\); not a record"),
        (_framed(version=2), r"unknown record format version 2 \(this code reads version 1\)"),
        (_framed(name_len=201), r"implausible record name length 201"),
        (encode_record(NAME, DATA)[:14], r"truncated record: 14 bytes, but an empty record named so needs"),
        (encode_record(NAME, DATA)[:-1], r"truncated record: \d+ bytes, expected \d+"),
        (encode_record(NAME, DATA)[:-10], r"truncated record: \d+ bytes, expected \d+"),
        (_framed(payload_len=MAX_RECORD_BYTES + 1), r"implausible record payload length 1048577"),
        (encode_record(NAME, DATA) + b"\0\0", r"record has 2 unexpected trailing bytes"),
        (flip(encode_record(NAME, DATA), 40), r"record checksum mismatch \(stored crc32 [0-9a-f]{8}, computed"),
        (flip(encode_record(NAME, DATA), 14), r"record checksum mismatch"),  # damage in the name is damage
        (
            encode_record("calibration:other", DATA),
            r"foreign record: holds 'calibration:other', expected " + repr(NAME),
        ),
        (_framed(name=b"\xff\xfe"), r"foreign record: holds b'\\xff\\xfe', expected"),
    ],
    ids=[
        "empty",
        "shorter than the prefix",
        "bad magic",
        "unknown version",
        "implausible name length",
        "truncated header",
        "truncated crc",
        "truncated payload",
        "implausible payload length",
        "trailing bytes",
        "flipped payload byte",
        "flipped name byte",
        "wrong name",
        "non-ascii name",
    ],
)
def test_decode_record_says_what_is_wrong(raw, message):
    with pytest.raises(CorruptEntryError, match=message):
        decode_record(raw, NAME)


BAD_NAMES = [
    ("", "1 to 200 characters long, got 0"),
    ("x" * 201, "1 to 200 characters long, got 201"),
    ("a/b", r"characters other than .*'/'"),
    ("../etc", r"characters other than .*'/'"),
    ("with space", r"characters other than .*' '"),
    ("tab\tname", r"characters other than"),
    ("name\n", r"characters other than .*'\\n'"),  # $ would have matched before a final newline
    ("é", r"characters other than"),
    (b"bytes", "record name must be a str, got bytes"),
    (None, "record name must be a str, got NoneType"),
]


@pytest.mark.parametrize("name, message", BAD_NAMES)
def test_bad_record_names(tmp_path, name, message):
    with pytest.raises(ValueError, match=message):
        encode_record(name, DATA)
    with pytest.raises(ValueError, match=message):
        decode_record(encode_record(NAME, DATA), name)
    with ChunkStore(tmp_path) as store:
        for call in (
            lambda: store.put_record(name, DATA),
            lambda: store.get_record(name),
            lambda: store.delete_record(name),
        ):
            with pytest.raises(ValueError, match=message):
                call()
        assert not (tmp_path / "records").exists() or not list((tmp_path / "records").iterdir())


def test_good_names_of_every_allowed_character(tmp_path):
    with ChunkStore(tmp_path) as store:
        for name in ("a", ".", "..", "-", "x" * 200, "A-Z.a_z:0-9", ".hidden", "x.rec", "x.tmp"):
            store.put_record(name, name.encode())
        for name in ("a", ".", "..", "-", "x" * 200, "A-Z.a_z:0-9", ".hidden", "x.rec", "x.tmp"):
            assert store.get_record(name) == name.encode()


def test_data_must_be_bytes_of_at_most_one_mib(tmp_path):
    with ChunkStore(tmp_path) as store:
        for data in ("text", memoryview(b"x"), None, 3, [1, 2]):
            with pytest.raises(TypeError, match="record data must be bytes or bytearray"):
                store.put_record(NAME, data)
        with pytest.raises(ValueError, match=r"record data is 1048577 bytes; the limit is 1048576 \(1 MiB\)"):
            store.put_record(NAME, b"x" * (MAX_RECORD_BYTES + 1))
        assert store.get_record(NAME) is None
        store.put_record(NAME, bytearray(b"y" * MAX_RECORD_BYTES))  # exactly the limit is fine
        assert store.get_record(NAME) == b"y" * MAX_RECORD_BYTES


# --------------------------------------------------------------------------
# the disk tier


def test_roundtrip_overwrite_and_delete(tmp_path):
    with ChunkStore(tmp_path) as store:
        assert store.get_record(NAME) is None
        store.put_record(NAME, DATA)
        assert store.get_record(NAME) == DATA
        assert record_file(store).read_bytes() == encode_record(NAME, DATA)
        store.put_record(NAME, b"v2")  # replaced
        assert store.get_record(NAME) == b"v2"
        store.put_record("other", b"")
        assert store.get_record("other") == b""  # an empty record is not a missing one
        store.delete_record(NAME)
        assert store.get_record(NAME) is None and not record_file(store).exists()
        store.delete_record(NAME)  # deleting what is not there is fine
        assert store.get_record("other") == b""
        assert sorted(p.name for p in (tmp_path / "records").iterdir()) == ["other.rec"]  # no temporary file left
        assert store.stats.corrupt == store.stats.errors == 0


def test_a_second_store_on_the_same_path_reads_it(tmp_path):
    with ChunkStore(tmp_path) as writer:
        writer.put_record(NAME, DATA)
    with ChunkStore(tmp_path) as reader:
        assert reader.get_record(NAME) == DATA


def test_records_are_not_entries(tmp_path):
    with ChunkStore(tmp_path) as store:
        store.put_record(NAME, DATA)
        assert len(store) == 0
        assert store.get(NAME) is None and NAME not in store and store.locate(NAME).tier is None
        volume = store._disk.cache.volume()
        store.put_record("another", b"x" * 100_000)
        assert store._disk.cache.volume() == volume  # not in the diskcache, nor in its size
        store.put(make_entry(0))
        assert len(store) == 1
        assert store.get_record(NAME) == DATA
        assert store.stats.misses == 1 and store.stats.hits == 0  # the get above; record reads count in neither
        assert NAME not in store._disk.cache


def test_records_survive_chunk_eviction(tmp_path):
    limit = 2**20
    with ChunkStore(tmp_path, size_limit_bytes=limit, memory_limit_bytes=0) as store:
        store.put_record(NAME, DATA)
        store.put_record("big", b"z" * MAX_RECORD_BYTES)  # a record as large as the whole disk tier
        entries = [make_entry(i, nbytes=200_000) for i in range(30)]
        for e in entries:
            store.put(e)
            assert store._disk.cache.volume() <= limit
        kept = sum(e.key in store for e in entries)
        assert 3 <= kept <= 5 and len(store) == kept == len(val_files(tmp_path))  # chunks were evicted
        assert store.get_record(NAME) == DATA and store.get_record("big") == b"z" * MAX_RECORD_BYTES
        assert same(store.get(entries[-1].key), entries[-1])
        assert store.stats.corrupt == store.stats.errors == 0


def test_clear_removes_records_from_disk(tmp_path):
    with ChunkStore(tmp_path) as store:
        store.put(make_entry(0))
        store.put_record(NAME, DATA)
        store.put_record("b", DATA)
        (tmp_path / "records" / ".b.123.deadbeef.tmp").write_bytes(b"half")  # left by a killed writer
        store.clear()
        assert len(store) == 0 and store.get_record(NAME) is None and store.get_record("b") is None
        assert list((tmp_path / "records").iterdir()) == []
        store.put_record(NAME, b"again")  # usable afterwards
        assert store.get_record(NAME) == b"again"


def test_record_damaged_on_disk_is_refused_counted_warned_and_deleted(tmp_path, caplog):
    with ChunkStore(tmp_path) as store:
        store.put_record(NAME, DATA)
        path = record_file(store)
        path.write_bytes(flip(path.read_bytes(), 30))
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert store.get_record(NAME) is None
            assert not path.exists()
            assert store.stats.corrupt == 1 and store.stats.errors == 0
            assert store.get_record(NAME) is None  # now simply absent
            path.write_bytes(b"garbage")  # damaged again: counted and deleted again, but warned about once
            assert store.get_record(NAME) is None and not path.exists()
        assert store.stats.corrupt == 2 and store.stats.misses == 0
        (warning,) = store_warnings(caplog)
        assert f"record {NAME!r}: dropped corrupt record from disk: record checksum mismatch" in warning
        assert str(tmp_path) in warning


def test_record_copied_under_another_name_is_refused(tmp_path, redis_server, redis_url):
    with ChunkStore(tmp_path, remote=redis_url) as store:
        store.put_record(NAME, DATA)
        record_file(store, "copy").write_bytes(record_file(store).read_bytes())
        redis_server.client().set(RECORD_PREFIX + "copy", encode_record(NAME, DATA))
        assert store.get_record("copy") is None
        assert store.stats.corrupt == 2  # the disk copy and the Redis copy
        assert not record_file(store, "copy").exists() and redis_server.client().get(RECORD_PREFIX + "copy") is None
        assert store.get_record(NAME) == DATA  # the original is untouched


def test_oversized_file_is_refused_without_reading_it_whole(tmp_path):
    with ChunkStore(tmp_path) as store:
        store.put_record(NAME, DATA)
        with open(record_file(store), "ab") as f:
            f.write(b"\0" * (2 * MAX_RECORD_ENCODED))
        assert (
            store._disk.read_record(NAME) is not None and len(store._disk.read_record(NAME)) == MAX_RECORD_ENCODED + 1
        )
        assert store.get_record(NAME) is None and store.stats.corrupt == 1


def test_damaged_copy_is_only_deleted_if_unchanged(tmp_path, redis_server, redis_url):
    """A good record written meanwhile by another process survives the drop of the damaged copy read before."""
    with ChunkStore(tmp_path, remote=redis_url) as store:
        store.put_record(NAME, b"rewritten")
        r = redis_server.client()
        for tier in (store._disk, store._remote):
            tier.delete_record(NAME, only=b"the damaged bytes read earlier")
        assert record_file(store).exists() and r.get(RECORD_PREFIX + NAME) == encode_record(NAME, b"rewritten")
        for tier in (store._disk, store._remote):
            tier.delete_record(NAME, only=encode_record(NAME, b"rewritten"))
        assert not record_file(store).exists() and r.get(RECORD_PREFIX + NAME) is None


def test_disk_failures_are_logged_never_raised(tmp_path, redis_url, caplog):
    with ChunkStore(tmp_path / "a", remote=redis_url) as store, caplog.at_level(logging.WARNING, logger=LOGGER):
        record_file(store).parent.mkdir()
        record_file(store).mkdir()  # reading, replacing or deleting the record file fails
        store.put_record(NAME, DATA)  # the disk write fails; Redis gets it
        assert store.stats.errors == 1
        assert store.get_record(NAME) == DATA  # the disk read fails, then from Redis (its copy to disk fails)
        assert store.stats.errors == 3
        store.delete_record(NAME)
        assert store.stats.errors == 4 and store.get_record(NAME) is None  # gone from Redis all the same
        messages = store_warnings(caplog)
        assert any(f"disk write of record {NAME!r} failed (IsADirectoryError" in m for m in messages)
        assert any(f"record {NAME!r}: disk read failed (IsADirectoryError" in m for m in messages)
        assert any(f"record {NAME!r}: deleting it from disk failed (IsADirectoryError" in m for m in messages)
    with ChunkStore(tmp_path / "b") as store:
        (tmp_path / "b" / "records").write_bytes(b"not a folder")
        store.put_record(NAME, DATA)  # logged, not raised
        assert store.get_record(NAME) is None and store.stats.errors == 2  # the write and the read
        store.clear()  # the chunks are cleared whatever the records folder is
        assert store.stats.corrupt == 0


# --------------------------------------------------------------------------
# Redis


def test_write_through_to_redis_plain_value_outside_the_bookkeeping(tmp_path, redis_server, redis_url):
    with ChunkStore(tmp_path, remote=redis_url, remote_size_limit_bytes=10_000) as store:
        store.put_record(NAME, DATA)
        store.put_record("big", b"b" * 100_000)  # records are outside the size limit and eviction
        r = redis_server.client()
        assert r.type(RECORD_PREFIX + NAME) == b"string" and r.ttl(RECORD_PREFIX + NAME) == -1
        assert r.get(RECORD_PREFIX + NAME) == encode_record(NAME, DATA) == record_file(store).read_bytes()
        assert r.get(RECORD_PREFIX + "big") == encode_record("big", b"b" * 100_000)
        assert r.zcard(LRU) == r.hlen(SIZES) == 0 and int(r.get(TOTAL) or 0) == 0
        for i in range(5):
            store.put(make_entry(i, nbytes=4_000))  # chunk eviction in Redis leaves the records alone
        assert r.get(RECORD_PREFIX + NAME) == encode_record(NAME, DATA) and r.exists(RECORD_PREFIX + "big")
        assert 0 < int(r.get(TOTAL)) <= 10_000
        store.delete_record(NAME)
        assert r.get(RECORD_PREFIX + NAME) is None and not record_file(store).exists()


def test_another_machine_reads_it_from_redis_then_from_its_own_disk(tmp_path, redis_server, redis_url):
    with ChunkStore(tmp_path / "a", remote=redis_url) as writer:
        writer.put_record(NAME, DATA)
    with ChunkStore(tmp_path / "b", remote=redis_url) as other:
        assert not record_file(other).exists()
        assert other.get_record(NAME) == DATA
        assert record_file(other).read_bytes() == encode_record(NAME, DATA)  # copied to its disk
        assert other.stats.remote_hits == other.stats.misses == 0  # record reads are not chunk reads
    redis_server.client().delete(RECORD_PREFIX + NAME)
    with ChunkStore(tmp_path / "b", remote=redis_url) as again:
        assert again.get_record(NAME) == DATA  # from its own disk
    with ChunkStore(tmp_path / "c", remote=redis_url) as third:
        assert third.get_record(NAME) is None


def test_a_record_rewritten_on_another_machine_replaces_the_old_disk_copy(tmp_path, redis_url):
    with ChunkStore(tmp_path / "a", remote=redis_url) as a, ChunkStore(tmp_path / "b", remote=redis_url) as b:
        a.put_record(NAME, b"first")
        assert b.get_record(NAME) == b"first" and record_file(b).exists()
        a.put_record(NAME, b"second")  # a new calibration on machine a
        assert b.get_record(NAME) == b"second"  # Redis first: not b's old disk copy
        assert record_file(b).read_bytes() == encode_record(NAME, b"second")
        mtime = record_file(b).stat().st_mtime_ns
        assert b.get_record(NAME) == b"second" and record_file(b).stat().st_mtime_ns == mtime  # not rewritten


def test_damaged_on_disk_then_a_good_redis_copy_is_used(tmp_path, redis_server, redis_url, caplog):
    with ChunkStore(tmp_path, remote=redis_url) as store, caplog.at_level(logging.WARNING, logger=LOGGER):
        store.put_record(NAME, DATA)
        path = record_file(store)
        path.write_bytes(flip(path.read_bytes(), len(path.read_bytes()) - 3))
        assert store.get_record(NAME) == DATA  # from Redis, read first
        assert path.read_bytes() == encode_record(NAME, DATA)  # the damaged disk copy was replaced by Redis's
        assert redis_server.client().get(RECORD_PREFIX + NAME) == encode_record(NAME, DATA)  # Redis's kept
        assert store.stats.errors == 0
        redis_server.client().delete(RECORD_PREFIX + NAME)  # now only the disk copy, damaged
        path.write_bytes(flip(path.read_bytes(), len(path.read_bytes()) - 3))
        assert store.get_record(NAME) is None and not path.exists()
        assert store.stats.corrupt == 1
        (warning,) = store_warnings(caplog)
        assert f"record {NAME!r}: dropped corrupt record from disk: record checksum mismatch" in warning


@pytest.mark.parametrize(
    "bad",
    [b"", b"garbage", encode_record(NAME, DATA)[:-5], flip(encode_record(NAME, DATA), 20), encode_record("x", DATA)],
    ids=["empty", "garbage", "truncated", "flipped byte", "foreign"],
)
def test_damaged_in_redis_is_refused_and_deleted(tmp_path, redis_server, redis_url, caplog, bad):
    r = redis_server.client()
    r.set(RECORD_PREFIX + NAME, bad)
    with ChunkStore(tmp_path, remote=redis_url) as store, caplog.at_level(logging.WARNING, logger=LOGGER):
        assert store.get_record(NAME) is None
        assert r.get(RECORD_PREFIX + NAME) is None and not record_file(store).exists()  # never copied to disk
        assert store.stats.corrupt == 1 and store.stats.errors == 0
        (warning,) = store_warnings(caplog)
        assert f"record {NAME!r}: dropped corrupt record from Redis {redis_url}: " in warning


def test_clear_removes_records_from_redis_and_disk(tmp_path, redis_server, redis_url):
    r = redis_server.client()
    r.set("someone-else", b"x")
    r.set("blend-not-ours", b"y")
    with ChunkStore(tmp_path, remote=redis_url) as store:
        store.put(make_entry(0))
        for i in range(1500):  # more than one batch of the clear's SCAN
            store._remote.client.put_record(f"r{i}", encode_record(f"r{i}", b"v"))
        store.put_record(NAME, DATA)
        store.clear()
        assert sorted(r.keys()) == [b"blend-not-ours", b"someone-else"]
        assert store.get_record(NAME) is None and store.get_record("r7") is None
        assert list((tmp_path / "records").iterdir()) == []


def test_put_record_with_redis_down_still_writes_disk(tmp_path, caplog):
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        store = ChunkStore(tmp_path, remote=url, remote_timeout_s=0.3)
        t0 = time.monotonic()
        store.put_record(NAME, DATA)  # no raise
        assert store.get_record(NAME) == DATA  # from disk, Redis not asked
        assert store.get_record("absent") is None  # Redis skipped while backing off
        store.delete_record(NAME)
        assert time.monotonic() - t0 < 2
    assert store.get_record(NAME) is None
    assert store.stats.errors == 1
    (warning,) = store_warnings(caplog)
    assert f"Redis {url}: record write failed (ConnectionError" in warning and "local tiers only" in warning
    store.close()


# --------------------------------------------------------------------------
# several processes

PAYLOADS = (b"A" * 3000, b"B" * 5000)


def _record_writer(path: str, url: str, worker: int, rounds: int, start, out) -> None:
    store = ChunkStore(path, remote=url)
    start.wait(60)
    for _ in range(rounds):
        store.put_record(NAME, PAYLOADS[worker])
    out.put((worker, store.stats.errors))
    store.close()


def test_two_processes_write_the_same_record_concurrently(tmp_path, redis_server, redis_url):
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_record_writer, args=(str(tmp_path), redis_url, w, 50, start, out)) for w in range(2)]
    for p in procs:
        p.start()
    reader = ChunkStore(tmp_path)  # reads while they write: only ever one whole record
    seen = set()
    start.set()
    while any(p.is_alive() for p in procs):
        got = reader.get_record(NAME)
        if got is not None:
            seen.add(got)
    results = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert results == [(0, 0), (1, 0)]
    assert seen <= set(PAYLOADS) and reader.stats.corrupt == reader.stats.errors == 0
    assert decode_record(record_file(reader).read_bytes(), NAME) in PAYLOADS
    assert decode_record(redis_server.client().get(RECORD_PREFIX + NAME), NAME) in PAYLOADS
    assert reader.get_record(NAME) in PAYLOADS
    assert [p.name for p in (tmp_path / "records").iterdir()] == [f"{NAME}.rec"]  # no temporary file left
    reader.close()
