"""Tests of the chunk store's tiers on their own (store layer): MemoryTier,
DiskTier and RemoteTier without a ChunkStore in front. Real diskcache
directories under tmp_path and a real redis-server (see conftest.py); no mocks."""

from __future__ import annotations

import logging
import time

import diskcache
import pytest
import torch

from blend_integrations.store.disk_tier import DiskTier
from blend_integrations.store.format import CorruptEntryError, encode
from blend_integrations.store.layered import LayerReader
from blend_integrations.store.memory_tier import MemoryTier
from blend_integrations.store.rate import Rate
from blend_integrations.store.redis_tier import VALUE_PREFIX, RedisClient
from blend_integrations.store.remote_tier import RemoteTier
from blend_integrations.store.stats import Report
from tests.fixtures.entries import make_entry, same, val_files

LOGGER = "blend_integrations.store"
EXPECT = (2, 2, 5, 8, torch.float32)  # make_entry(i) without nbytes


def memory_tier(limit_bytes: int) -> MemoryTier:
    return MemoryTier(limit_bytes, report=Report("test"), rate=Rate(1e9))


def disk_tier(path, size_limit_bytes: int = 2**30) -> DiskTier:
    return DiskTier(path, size_limit_bytes, report=Report(path), rate=Rate(1e9))


def read_layers(reader: LayerReader):
    for _ in range(reader.num_layers):
        reader.read_layer()
    reader.verify()
    return reader.kv


# --------------------------------------------------------------------------
# memory


def test_memory_tier_evicts_least_recently_used():
    entries = [make_entry(i) for i in range(4)]
    size = entries[0].nbytes
    tier = memory_tier(3 * size)
    for e in entries[:3]:
        tier.put(e)
    assert tier.locate(entries[0].key) == size  # locate is not a use ...
    assert tier.read(entries[1].key, None).entry is entries[1]  # ... a read is
    tier.put(entries[3])
    assert tier.keys() == [entries[2].key, entries[1].key, entries[3].key] and tier.nbytes == 3 * size
    assert tier.read(entries[0].key, None) is None and tier.locate(entries[0].key) is None
    tier.put(make_entry(9, nbytes=4 * size))  # bigger than the whole tier: not kept, nothing evicted
    assert len(tier) == 3 and tier.nbytes == 3 * size
    tier.delete(entries[2].key)
    assert tier.keys() == [entries[1].key, entries[3].key] and tier.nbytes == 2 * size
    tier.clear()
    assert len(tier) == 0 and tier.nbytes == 0


def test_memory_tier_checks_geometry_and_counts_hits():
    e = make_entry(0)
    tier = memory_tier(2**20)
    tier.put(e)
    hit = tier.read(e.key, EXPECT)
    assert hit.entry is e and hit.nbytes == e.nbytes and hit.data is None
    with pytest.raises(CorruptEntryError, match="expected"):
        tier.read(e.key, (2, 2, 6, 8, torch.float32))
    tier.hit(hit.nbytes, 0.001)
    assert tier.report.stats.memory_hits == 1 and tier.rate.samples == 1
    nothing = memory_tier(0)
    nothing.put(e)
    assert nothing.read(e.key, None) is None and len(nothing) == 0  # 0: keeps nothing


# --------------------------------------------------------------------------
# disk


def test_disk_tier_round_trip(tmp_path):
    small, big = make_entry(0), make_entry(1, nbytes=100_000)  # inline blob / file
    tier = disk_tier(tmp_path)
    for e in (small, big):
        tier.put(e, encode(e))
        assert tier.locate(e.key) == len(encode(e)) and tier.read_bytes(e.key) == encode(e)
        hit = tier.read(e.key, (2, 2, e.num_tokens, 8, torch.float32))
        assert same(hit.entry, e) and hit.nbytes == len(encode(e))
    assert len(tier) == 2 and len(val_files(tmp_path)) == 1
    assert tier.report.stats.bytes_written == len(encode(small)) + len(encode(big))
    assert same(tier.read(small.key, None, layered=True).entry, small)  # inline: whole even when layered
    reader = tier.read(big.key, None, layered=True)
    assert isinstance(reader, LayerReader) and reader.tier == "disk"
    assert torch.equal(read_layers(reader), big.kv)
    assert tier.read("absent", None) is None and tier.locate("absent") is None and tier.read_bytes("absent") is None
    assert tier.delete(small.key) is None and tier.locate(small.key) is None
    tier.clear()
    assert len(tier) == 0 and val_files(tmp_path) == []
    tier.close()


def test_disk_tier_damaged_file_raises_and_is_left_for_the_store(tmp_path):
    e = make_entry(2, nbytes=100_000)
    tier = disk_tier(tmp_path)
    tier.put(e, encode(e))
    (f,) = val_files(tmp_path)
    raw = bytearray(f.read_bytes())
    raw[5000] ^= 0x10
    f.write_bytes(raw)
    with pytest.raises(CorruptEntryError, match="checksum"):
        tier.read(e.key, None)
    assert tier.locate(e.key) is not None  # dropping it is the store's job
    diskcache.Cache(str(tmp_path)).set(e.key, {"a": 1})  # a pickle: refused, never unpickled
    with pytest.raises(CorruptEntryError, match="pickle"):
        tier.read(e.key, None)
    assert tier.read_bytes(e.key) is None  # the backfill skips it
    assert tier.report.stats.errors == 0


def test_disk_tier_evicts_to_its_limit_and_skips_too_big(tmp_path):
    limit = 2**20
    tier = disk_tier(tmp_path, limit)
    entries = [make_entry(i, nbytes=200_000) for i in range(8)]
    for e in entries:
        tier.put(e, encode(e))
        assert tier.cache.volume() <= limit and tier.locate(e.key) is not None
    present = [tier.locate(e.key) is not None for e in entries]
    k = sum(present)
    assert present == [False] * (8 - k) + [True] * k  # oldest went first
    huge = make_entry(9, nbytes=2 * limit)
    assert tier.too_big(len(encode(huge))) == f"size_limit_bytes={limit} (not written to disk)"
    assert tier.too_big(len(encode(entries[0]))) is None
    tier.put(huge, encode(huge))
    assert tier.locate(huge.key) is None and len(tier) == k


def test_disk_tier_read_failure_is_a_logged_miss(tmp_path, caplog):
    e = make_entry(3, nbytes=100_000)
    tier = disk_tier(tmp_path)
    tier.put(e, encode(e))
    reader = tier.read(e.key, None, layered=True)
    reader.close()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        tier.finish(e.key, OSError("I/O error"))
        tier.finish(e.key, OSError("I/O error"))  # once per key
    (warning,) = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert "disk tier read failed (OSError: I/O error)" in warning and e.key[:16] in warning
    assert tier.report.stats.errors == 2


# --------------------------------------------------------------------------
# Redis


def remote_tier(url: str, source=None, **kwargs) -> RemoteTier:
    client = RedisClient(url, size_limit_bytes=kwargs.pop("size_limit_bytes", None), timeout_s=0.5)
    return RemoteTier(client, backfill_source=(source or {}).get, report=Report("test"), rate=Rate(1e9), **kwargs)


def test_remote_tier_round_trip(redis_server, redis_url):
    small, big = make_entry(0), make_entry(1, nbytes=100_000)
    tier = remote_tier(redis_url, size_limit_bytes=200_000)
    for e in (small, big):
        tier.put(e, encode(e))
        assert tier.locate(e.key) == len(encode(e))
        hit = tier.read(e.key, (2, 2, e.num_tokens, 8, torch.float32))
        assert same(hit.entry, e) and hit.data == encode(e)
    assert tier.report.stats.remote_bytes_written == len(encode(small)) + len(encode(big))
    reader = tier.read(big.key, None, layered=True)
    assert isinstance(reader, LayerReader) and reader.tier == "remote"
    assert torch.equal(read_layers(reader), big.kv)
    assert tier.too_big(300_000) == "remote_size_limit_bytes=200000 (not written to Redis)"
    redis_server.client().set(VALUE_PREFIX + small.key, b"\0" * 100)
    with pytest.raises(CorruptEntryError):
        tier.read(small.key, None)
    tier.delete(small.key)
    assert tier.locate(small.key) is None and tier.read(small.key, None) is None
    tier.clear()
    assert tier.locate(big.key) is None and tier.report.stats.errors == 0
    tier.close()


def test_remote_tier_backs_off_then_backfills(private_redis_server, caplog):
    server = private_redis_server
    entries = [make_entry(i) for i in range(4)]
    on_disk = {e.key: encode(e) for e in entries}
    tier = remote_tier(server.url(), on_disk, retry_s=0.5, backfill_max_keys=3)
    server.kill()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        t0 = time.monotonic()
        for e in entries:
            tier.put(e, encode(e))  # the first fails (one timeout at most), the others are skipped
        assert tier.read(entries[0].key, None) is None and tier.locate(entries[0].key) is None
        assert time.monotonic() - t0 < 0.5 + 0.4
        assert tier.report.stats.errors == 1 and tier.backfill_keys == [e.key for e in entries[1:]]
        server.start()  # empty
        time.sleep(0.55)  # past the back-off
        assert tier.read("never-stored", None) is None  # answers: the backfill starts
        deadline = time.monotonic() + 10
        while tier.report.stats.remote_backfilled < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert tier.backfill_keys == [] and tier.report.stats.errors == 1
    assert all(tier.locate(e.key) == len(encode(e)) for e in entries[1:]) and tier.locate(entries[0].key) is None
    warning, back = (r.getMessage() for r in caplog.records if r.name == LOGGER)
    assert "Redis" in warning and "write failed" in warning and "trying Redis again in 0.5 s" in warning
    assert back.endswith("answers again; writing the 3 entries put meanwhile to it")
    tier.close()
