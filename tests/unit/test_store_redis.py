"""Tests for the Redis tier of ChunkStore, against a real redis-server (see
conftest.py: ``redis_server``, ``redis_url``, ``private_redis_server``); no mocks."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import sys
import time

import pytest
import torch

from blend_integrations.store import ChunkStore
from blend_integrations.store.format import decode, encode
from blend_integrations.store.redis_tier import LRU, SIZES, TOTAL, VALUE_PREFIX
from tests.fixtures.entries import make_entry, same

LOGGER = "blend_integrations.store"


def store_logs(caplog, level=logging.WARNING) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == level]


def consistent(r) -> dict[str, int]:
    """Check the store's Redis bookkeeping against the values really there;
    return {key: size} of the stored entries."""
    sizes = {k.decode(): int(v) for k, v in r.hgetall(SIZES).items()}
    values = {name.decode()[len(VALUE_PREFIX) :] for name in r.scan_iter(match=VALUE_PREFIX + "*")}
    assert values == set(sizes) == {m.decode() for m in r.zrange(LRU, 0, -1)}
    assert all(r.strlen(VALUE_PREFIX + k) == n for k, n in sizes.items())
    assert int(r.get(TOTAL) or 0) == sum(sizes.values())
    return sizes


def counted_gets(stats) -> int:
    return stats.memory_hits + stats.disk_hits + stats.remote_hits + stats.misses


def wait_for(condition, timeout: float = 10.0) -> None:
    """Poll ``condition`` (e.g. for a background thread's work) until it holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# --------------------------------------------------------------------------
# configuration


@pytest.mark.parametrize("url", ["http://127.0.0.1:6379/0", "127.0.0.1:6379", "redis//127.0.0.1"])
def test_bad_url_is_a_value_error_naming_it(tmp_path, url):
    with pytest.raises(ValueError, match="remote must be a redis://") as info:
        ChunkStore(tmp_path, remote=url)
    assert repr(url) in str(info.value)


def test_bad_remote_settings(tmp_path):
    with pytest.raises(ValueError, match=r"'http://user:\*\*\*@127\.0\.0\.1/0'") as info:
        ChunkStore(tmp_path, remote="http://user:hunter2@127.0.0.1/0")
    assert "hunter2" not in str(info.value)  # the password is not shown
    with pytest.raises(ValueError, match="bad Redis URL.*database number"):
        ChunkStore(tmp_path, remote="redis://127.0.0.1:6379/not-a-db")
    with pytest.raises(ValueError, match="bad Redis URL.*Port"):
        ChunkStore(tmp_path, remote="redis://127.0.0.1:abc/0")
    with pytest.raises(ValueError, match="remote_size_limit_bytes"):
        ChunkStore(tmp_path, remote="redis://127.0.0.1/0", remote_size_limit_bytes=0)
    with pytest.raises(ValueError, match="remote_timeout_s"):
        ChunkStore(tmp_path, remote="redis://127.0.0.1/0", remote_timeout_s=0)


@pytest.mark.parametrize(
    "url, shown",
    [
        ("redis://user:hunter2@127.0.0.1:1/0", "redis://user:***@127.0.0.1:1/0"),
        ("rediss://:hunter2@cache-host/2", "rediss://:***@cache-host/2"),
        ("unix:///run/redis.sock?db=1&password=hunter2&x=y", "unix:///run/redis.sock?db=1&password=***&x=y"),
        ("redis://127.0.0.1:1/0", "redis://127.0.0.1:1/0"),
    ],
)
def test_the_password_is_never_shown(tmp_path, url, shown):
    from blend_integrations.store.redis_tier import redact

    assert redact(url) == shown
    with ChunkStore(tmp_path, remote=url) as store:
        assert f"remote={shown!r}" in repr(store)


def test_remote_defaults_to_the_environment(tmp_path, monkeypatch, redis_url):
    monkeypatch.setenv("BLEND_STORE_REMOTE", redis_url)
    with ChunkStore(tmp_path / "a") as store:
        assert store.remote == redis_url
        store.put(make_entry(0))
    with ChunkStore(tmp_path / "b", remote="") as local_only:  # "": no Redis tier, whatever the environment says
        assert local_only.remote is None and make_entry(0).key not in local_only
    with ChunkStore(tmp_path / "c") as other:
        assert other.get(make_entry(0).key) is not None and other.stats.remote_hits == 1
    monkeypatch.setenv("BLEND_STORE_REMOTE", "cache-host:6379")
    with pytest.raises(ValueError, match=r"\$BLEND_STORE_REMOTE: remote must be a redis://.*'cache-host:6379'"):
        ChunkStore(tmp_path / "c")
    for unset in ("", None):
        if unset is None:
            monkeypatch.delenv("BLEND_STORE_REMOTE")
        else:
            monkeypatch.setenv("BLEND_STORE_REMOTE", unset)
        with ChunkStore(tmp_path / "c") as store:
            assert store.remote is None and "remote=" not in repr(store)


def test_missing_redis_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)  # what `import redis` sees when it is not installed
    with pytest.raises(ImportError, match=r"pip install 'blend_integrations\[redis\]'"):
        ChunkStore(tmp_path, remote="redis://127.0.0.1:6379/0")
    ChunkStore(tmp_path).close()  # without remote, redis is never imported


# --------------------------------------------------------------------------
# tiers


def test_write_through_lands_in_all_three_tiers(tmp_path, redis_server, redis_url):
    r = redis_server.client()
    with ChunkStore(tmp_path, remote=redis_url) as store:
        assert redis_url in repr(store)
        small, big = make_entry(0), make_entry(1, nbytes=100_000)
        for e in (small, big):
            store.put(e)
            assert e.key in store._memory and e.key in store._disk.cache
            assert r.get(VALUE_PREFIX + e.key) == encode(e)  # the same bytes as on disk
        sizes = consistent(r)
        assert sizes == {e.key: len(encode(e)) for e in (small, big)}
        assert store.stats.remote_bytes_written == store.stats.bytes_written == sum(sizes.values())
        assert store.stats.errors == 0
    bookkeeping = {LRU, SIZES, TOTAL, "blend:clock"}
    assert {k.decode() for k in r.keys()} == bookkeeping | {VALUE_PREFIX + e.key for e in (small, big)}


def test_read_through_promotes_to_disk_and_memory(tmp_path, redis_url):
    entries = [make_entry(0), make_entry(1, nbytes=100_000, dtype=torch.bfloat16)]
    with ChunkStore(tmp_path / "a", remote=redis_url) as writer:
        for e in entries:
            writer.put(e)

    with ChunkStore(tmp_path / "b", remote=redis_url) as reader:  # another machine: empty disk
        assert len(reader) == 0 and all(e.key in reader for e in entries)  # `in` asks Redis too
        for e in entries:
            got = reader.get(e.key, expect=(2, 2, e.num_tokens, 8, e.dtype))
            assert got is not None and same(got, e)
            assert e.key in reader._disk.cache and e.key in reader._memory  # promoted
        s = reader.stats
        assert s.remote_hits == 2 and s.remote_bytes_read == sum(len(encode(e)) for e in entries)
        assert s.disk_hits == s.memory_hits == s.misses == s.corrupt == s.errors == 0
        assert s.bytes_written == s.remote_bytes_read  # the disk copies
        assert same(reader.get(entries[1].key), entries[1]) and s.memory_hits == 1
        assert reader.get("no-such-key") is None and s.misses == 1
        assert s.hits == 3 and counted_gets(s) == 4

    # the promoted copy is a real disk entry: a store on that directory reads it without Redis
    with ChunkStore(tmp_path / "b", memory_limit_bytes=0) as local:
        assert same(local.get(entries[1].key), entries[1]) and local.stats.disk_hits == 1


def test_remote_eviction_is_lru_and_bounded(tmp_path, redis_server, redis_url, caplog):
    r = redis_server.client()
    entries = [make_entry(i, nbytes=100_000) for i in range(8)]
    size = len(encode(entries[0]))
    limit = int(3.5 * size)
    store = ChunkStore(tmp_path / "a", memory_limit_bytes=0, remote=redis_url, remote_size_limit_bytes=limit)
    for e in entries[:6]:
        store.put(e)
        sizes = consistent(r)
        assert sum(sizes.values()) <= limit and e.key in sizes  # the entry just written stays
    assert set(consistent(r)) == {e.key for e in entries[3:6]}  # oldest went first

    # least recently *used*: a read (here from another machine) keeps 3 alive, 4 goes
    with ChunkStore(tmp_path / "b", memory_limit_bytes=0, remote=redis_url) as reader:
        assert same(reader.get(entries[3].key), entries[3]) and reader.stats.remote_hits == 1
    store.put(entries[6])
    assert set(consistent(r)) == {entries[3].key, entries[5].key, entries[6].key}

    # an entry larger than the whole limit is not written to Redis (logged once), only locally
    huge = make_entry(9, nbytes=4 * size)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        store.put(huge)
        store.put(huge)
    (warning,) = store_logs(caplog)
    assert "remote_size_limit_bytes" in warning.getMessage() and huge.key[:16] in warning.getMessage()
    assert huge.key in store._disk.cache and huge.key not in consistent(r)
    assert store.stats.errors == 0 and store.stats.corrupt == 0
    store.close()


def test_clear_removes_only_the_stores_keys(tmp_path, redis_server, redis_url):
    r = redis_server.client()
    r.set("someone-else", b"x")
    r.set("blend-not-ours", b"y")
    with ChunkStore(tmp_path, remote=redis_url) as store:
        for i in range(3):
            store.put(make_entry(i))
        r.set(VALUE_PREFIX + "stray", b"z")  # a value the index does not know
        store.clear()
        assert sorted(r.keys()) == [b"blend-not-ours", b"someone-else"]
        assert store.get(make_entry(0).key) is None and len(store) == 0
        store.put(make_entry(0))  # usable afterwards, bookkeeping from zero
        assert consistent(r) == {make_entry(0).key: len(encode(make_entry(0)))}


# --------------------------------------------------------------------------
# corrupt entries in Redis


def _bad_values(entry):
    good = encode(entry)
    flipped = bytearray(good)
    flipped[len(flipped) // 2] ^= 0x01
    return {
        "garbage": b"\0" * 100,
        "truncated": good[: len(good) // 2],
        "flipped byte": bytes(flipped),
        "foreign": encode(make_entry(7, nbytes=100_000)),  # a valid entry of another key
        "empty": b"",
    }


@pytest.mark.parametrize("kind", ["garbage", "truncated", "flipped byte", "foreign", "empty"])
def test_corrupt_remote_entry_is_a_miss_deleted_and_logged_once(tmp_path, redis_server, redis_url, caplog, kind):
    r = redis_server.client()
    entry = make_entry(3, nbytes=100_000)
    with ChunkStore(tmp_path / "a", remote=redis_url) as writer:
        writer.put(entry)
    bad = _bad_values(entry)[kind]
    r.set(VALUE_PREFIX + entry.key, bad)  # damaged behind the store's back

    reader = ChunkStore(tmp_path / "b", remote=redis_url)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert reader.get(entry.key) is None
        assert reader.stats.corrupt == 1 and reader.stats.misses == 1 and reader.stats.remote_hits == 0
        assert not r.exists(VALUE_PREFIX + entry.key) and consistent(r) == {}  # deleted, count right
        assert entry.key not in reader._disk.cache and entry.key not in reader._memory  # not promoted
        assert reader.get(entry.key) is None and reader.stats.corrupt == 1  # now a plain miss
        r.set(VALUE_PREFIX + entry.key, bad)  # damaged again: dropped again, no second warning
        assert reader.get(entry.key) is None and reader.stats.corrupt == 2
    (warning,) = store_logs(caplog)
    assert entry.key[:16] in warning.getMessage() and "dropped corrupt entry from Redis" in warning.getMessage()
    assert reader.stats.errors == 0 and counted_gets(reader.stats) == 3

    reader.put(entry)  # recompute and put: works again, for everyone
    reader.close()
    with ChunkStore(tmp_path / "c", remote=redis_url) as third:
        assert same(third.get(entry.key), entry) and third.stats.remote_hits == 1


# --------------------------------------------------------------------------
# Redis down, slow, or back


def test_unreachable_redis_at_construction(tmp_path, caplog):
    url = "redis://user:hunter2@127.0.0.1:1/0"  # nothing listens on port 1
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        store = ChunkStore(tmp_path, remote=url, remote_timeout_s=0.5)
        assert "hunter2" not in repr(store) and "user:***@127.0.0.1:1" in repr(store)
        e = make_entry(0)
        store.put(e)
        assert store.get(e.key) is e and store.get("other") is None
    assert e.key in store._disk.cache and store.stats.errors == 1  # then it backs off: one error
    (warning,) = store_logs(caplog)
    msg = warning.getMessage()
    assert "Redis redis://user:***@127.0.0.1:1/0" in msg and "hunter2" not in msg
    assert "write failed" in msg and "ConnectionError" in msg and "local tiers only" in msg
    store.close()


def test_redis_killed_mid_use_then_restarted(tmp_path, private_redis_server, caplog):
    server = private_redis_server
    # the default back-off is 5 s
    store = ChunkStore(tmp_path, memory_limit_bytes=0, remote=server.url(), remote_timeout_s=0.5, remote_retry_s=1.0)
    before = make_entry(0)
    store.put(before)
    assert store.stats.remote_bytes_written > 0

    server.kill()
    entries = [make_entry(i) for i in range(1, 4)]
    with caplog.at_level(logging.INFO, logger=LOGGER):
        t0 = time.monotonic()
        for e in entries:
            store.put(e)  # the first notices Redis is gone; the others don't try it
            assert same(store.get(e.key), e)  # from disk
        assert store.get("never-stored") is None
        assert time.monotonic() - t0 < 5
        assert store.stats.errors == 1
        assert store.stats.remote_bytes_written == len(encode(before))
        (warning,) = store_logs(caplog)
        assert server.url() in warning.getMessage()

        server.start()  # same port, empty (no persistence)
        time.sleep(1.2)  # past the back-off
        after = make_entry(5)
        store.put(after)
        assert store.stats.errors == 1
        assert server.client().get(VALUE_PREFIX + after.key) == encode(after)  # Redis is used again
    assert len(store_logs(caplog)) == 1  # still the one warning
    (back,) = store_logs(caplog, logging.INFO)
    assert "answers again" in back.getMessage()
    store.close()


def test_entries_put_while_redis_was_down_reach_it_when_it_answers_again(tmp_path, private_redis_server, caplog):
    server = private_redis_server
    store = ChunkStore(
        tmp_path / "a",
        memory_limit_bytes=0,
        remote=server.url(),
        remote_timeout_s=0.5,
        remote_size_limit_bytes=200_000,
        remote_retry_s=0.5,  # the default back-off is 5 s
        remote_backfill_max_keys=4,
    )  # the default bound is 4096
    entries = [make_entry(i, nbytes=20_000) for i in range(6)]
    huge = make_entry(9, nbytes=300_000)  # over remote_size_limit_bytes
    server.kill()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for e in entries + [huge]:
            store.put(e)  # on disk; the first Redis write fails, the others are skipped
        assert store.stats.errors == 1 and store.stats.remote_bytes_written == 0
        assert store._remote.backfill_keys == [e.key for e in entries[2:]]  # the newest 4; never huge
        store._disk.cache.delete(entries[2].key)  # evicted from disk before the backfill

        server.start()  # same port, empty
        server.client().config_set("maxmemory", 1)  # answers, but refuses writes (OOM error replies)
        time.sleep(0.55)  # past the back-off
        assert store.get("never-stored") is None  # Redis answers: the backfill starts, its first write fails
        wait_for(lambda: store.stats.errors == 2 and not store._remote.backfilling)
        assert store._remote.backfill_keys == [e.key for e in entries[3:]]  # entries[2] forgotten, the rest kept
        assert store.stats.remote_backfilled == 0 and consistent(server.client()) == {}

        server.client().config_set("maxmemory", 0)
        time.sleep(0.55)  # past the back-off again
        assert store.get("never-stored") is None  # the backfill starts again
        wait_for(lambda: store.stats.remote_backfilled == 3)
    assert store.stats.errors == 2
    redis_down, too_big = (r.getMessage() for r in store_logs(caplog))  # still the one Redis warning
    assert "write failed (ConnectionError" in redis_down and "exceeds remote_size_limit_bytes" in too_big
    first, second = (r.getMessage() for r in store_logs(caplog, logging.INFO))
    assert first.endswith("answers again; writing the 4 entries put meanwhile to it")
    assert second.endswith("answers again; writing the 3 entries put meanwhile to it")
    backfilled = entries[3:]
    assert consistent(server.client()) == {e.key: len(encode(e)) for e in backfilled}
    assert store.stats.remote_bytes_written == sum(len(encode(e)) for e in backfilled)
    store.close()

    with ChunkStore(tmp_path / "b", remote=server.url()) as other:  # another machine: empty disk
        for e in backfilled:
            assert same(other.get(e.key), e)
        assert other.stats.remote_hits == len(backfilled)
        for e in entries[:3] + [huge]:  # beyond the bound, evicted from disk, too big for Redis
            assert other.get(e.key) is None
        assert other.stats.misses == 4 and other.stats.errors == other.stats.corrupt == 0


def test_slow_redis_costs_one_timeout(tmp_path, redis_server, redis_url):
    e = make_entry(0)
    with ChunkStore(tmp_path / "a", remote=redis_url) as writer:
        writer.put(e)
    reader = ChunkStore(tmp_path / "b", remote=redis_url, remote_timeout_s=0.5, remote_retry_s=1.0)
    admin = redis_server.client()
    admin.execute_command("CLIENT", "PAUSE", 3000, "ALL")  # every command waits 3 s
    t0 = time.monotonic()
    assert reader.get(e.key) is None  # a miss after the timeout, not after 3 s
    assert reader.get(e.key) is None  # backing off: no second timeout
    took = time.monotonic() - t0
    assert 0.4 < took < 2.5, took
    assert reader.stats.errors == 1 and reader.stats.misses == 2
    admin.ping()  # answered when the pause is over
    time.sleep(max(0.0, t0 + 1.1 - time.monotonic()))  # and the back-off too
    assert same(reader.get(e.key), e) and reader.stats.remote_hits == 1  # Redis is used again
    reader.close()


# --------------------------------------------------------------------------
# several processes


ENTRY_BYTES = 60_000


def _writer(url: str, path: str, worker: int, n_keys: int, rounds: int, limit, start, out) -> None:
    """Write every key, in a worker-specific order, several rounds."""
    store = ChunkStore(path, memory_limit_bytes=0, remote=url, remote_size_limit_bytes=limit)
    start.wait(60)
    g = torch.Generator().manual_seed(worker)
    for _ in range(rounds):
        for i in torch.randperm(n_keys, generator=g).tolist():
            store.put(make_entry(i, nbytes=ENTRY_BYTES + 1_000 * i))
    out.put((worker, store.stats.errors, store.stats.remote_bytes_written))
    store.close()


@pytest.mark.parametrize("limited", [False, True], ids=["unlimited", "evicting"])
def test_two_processes_write_the_same_keys(tmp_path, redis_server, redis_url, limited):
    n_keys, rounds = 12, 3
    expected = {make_entry(i).key: make_entry(i, nbytes=ENTRY_BYTES + 1_000 * i) for i in range(n_keys)}
    limit = 5 * len(encode(expected[make_entry(0).key])) if limited else None
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_writer, args=(redis_url, str(tmp_path / f"w{w}"), w, n_keys, rounds, limit, start, out))
        for w in range(2)
    ]
    for p in procs:
        p.start()
    start.set()
    results = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert all(errors == 0 and written > 0 for _, errors, written in results), results

    sizes = consistent(redis_server.client())
    if limited:
        assert 0 < sum(sizes.values()) <= limit
    else:
        assert set(sizes) == set(expected)
    with ChunkStore(tmp_path / "reader", memory_limit_bytes=0, remote=redis_url) as reader:
        for key in sizes:
            got = reader.get(key)
            assert got is not None and same(got, expected[key])
        assert reader.stats.remote_hits == len(sizes) and reader.stats.corrupt == 0


def _endless_writer(url: str, path: str, ready) -> None:
    store = ChunkStore(path, memory_limit_bytes=0, size_limit_bytes=2**25, remote=url, remote_size_limit_bytes=None)
    i = 0
    while True:
        store.put(make_entry(i, nbytes=4 * 2**20))
        i += 1
        if i == 3:
            ready.set()


def test_writer_killed_mid_write_leaves_nothing_corrupt(tmp_path, redis_server, redis_url):
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=_endless_writer, args=(redis_url, str(tmp_path / "w"), ready))
    p.start()
    try:
        assert ready.wait(120)
        time.sleep(0.3)  # well into some later write
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.join(60)
    r = redis_server.client()
    sizes = consistent(r)
    assert len(sizes) >= 3
    for key in sizes:  # every value there is whole
        assert decode(r.get(VALUE_PREFIX + key), expected_key=key).num_tokens > 0
    with ChunkStore(tmp_path / "reader", memory_limit_bytes=0, remote=redis_url) as reader:
        assert all(reader.get(key) is not None for key in sizes) and reader.stats.corrupt == 0


def _use_after_fork(store: ChunkStore, key: str, out) -> None:
    got = store.get(key)  # only in Redis for this store
    store.put(make_entry(8))
    out.put((got is not None and same(got, make_entry(1)), store.stats.errors))


def test_store_usable_after_fork(tmp_path, redis_server, redis_url):
    with ChunkStore(tmp_path / "other", remote=redis_url) as other:
        other.put(make_entry(1))
    store = ChunkStore(tmp_path / "s", remote=redis_url)
    store.put(make_entry(0))  # the parent's connection is open
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    p = ctx.Process(target=_use_after_fork, args=(store, make_entry(1).key, out))
    p.start()
    assert out.get(timeout=60) == (True, 0)
    p.join(60)
    assert p.exitcode == 0
    # the parent's connection was not disturbed by the child's
    assert redis_server.client().exists(VALUE_PREFIX + make_entry(8).key)
    store.put(make_entry(2))
    assert make_entry(1).key in store and store.stats.errors == 0
    store.close()


# --------------------------------------------------------------------------
# engines in two processes


def _engine_first_request(model_dir: str, store_path: str, url: str, docs: list[str], out) -> None:
    """A new process's first request on ``docs``, blended at ratio 1, and the same prompt with full prefill."""
    from blend_integrations import BlendPrompt, load_engine

    store = ChunkStore(store_path, remote=url)
    engine = load_engine(model_dir, store=store, device="cpu")
    prompt = BlendPrompt("Read.", docs, "Question: which city is named in the documents? Answer:")
    blend = engine.generate(prompt, max_tokens=10, recompute_ratio=1.0)
    full = engine.generate(prompt, max_tokens=10, mode="full")
    out.put((blend.usage, store.stats, blend.token_ids, full.token_ids))
    store.close()


def test_two_engine_processes_share_chunks_through_redis(tmp_path, model_dirs, redis_url, docs):
    """Two transformers engines in two processes, each with its own empty directory: the second
    process's first request, on the same documents in another order, hits every chunk in Redis."""
    ctx = mp.get_context("spawn")
    results = []
    for name, order in (("a", docs), ("b", [docs[2], docs[0], docs[3], docs[1]])):
        out = ctx.Queue()
        p = ctx.Process(
            target=_engine_first_request, args=(model_dirs("llama"), str(tmp_path / name), redis_url, order, out)
        )
        p.start()
        results.append(out.get(timeout=300))
        p.join(60)
        assert p.exitcode == 0
    (usage_a, stats_a, _, _), (usage_b, stats_b, blend_b, full_b) = results
    n = len(docs)
    assert (usage_a.chunks_hit, usage_a.chunks_missed) == (0, n) and stats_a.remote_bytes_written > 0
    assert (usage_b.chunks_hit, usage_b.chunks_missed) == (n, 0)
    assert stats_b.remote_hits == n and stats_b.disk_hits == stats_b.memory_hits == 0 and stats_b.errors == 0
    assert blend_b == full_b
