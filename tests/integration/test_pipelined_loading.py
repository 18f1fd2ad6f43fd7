"""Layer-wise loading pipelined with the walk (BlendConfig(pipelined_loading=True)):
the same answers as loading whole entries, from disk and from Redis, and a
damaged entry found after its bytes were used never reaches the answer.
Real stores (disk, Redis on loopback) and a real small model."""

from __future__ import annotations

import logging
import threading

import diskcache
import pytest

from blend_integrations import BlendConfig, BlendPrompt, ChunkStore, load_engine
from blend_integrations.fusion import Blender, KVCache, blender
from blend_integrations.store.format import encode
from blend_integrations.store.layered import LayerReader, ReadFailed
from blend_integrations.store.redis_tier import VALUE_PREFIX
from tests.fixtures.exactness import chosen

QUESTION = "Question: which city is named in the documents? Answer:"


@pytest.fixture
def engines_pair(model_dirs, tmp_path):
    """(plain, pipelined): one model loaded twice, each engine with its own config."""
    model = model_dirs("llama")
    plain = load_engine(model, store=ChunkStore(tmp_path / "warm"), device="cpu")
    pipelined = load_engine(model, store=plain.store, device="cpu", config=BlendConfig(pipelined_loading=True))
    return plain, pipelined


def keys_of(engine, docs):
    return [engine.chunk_key(engine.tokenizer.encode(d, add_special_tokens=False)) for d in docs]


@pytest.mark.parametrize("threads", [1, 2])
def test_pipelined_equals_whole_entries_from_disk(engines_pair, docs, tmp_path, monkeypatch, threads):
    """With one reading thread, and with two (the package's on a CPU, each reading every other chunk)."""
    monkeypatch.setitem(blender.LAYER_READ_THREADS, "cpu", threads)
    plain, pipelined = engines_pair
    plain.warm(docs)
    prompt = BlendPrompt("Read.", docs[::-1], QUESTION)
    results = {}
    for name, engine in (("plain", plain), ("pipelined", pipelined)):
        engine.store = ChunkStore(tmp_path / "warm", memory_limit_bytes=0)  # every chunk from disk
        results[name] = engine.generate(prompt, max_tokens=8, logprobs=2)
        assert engine.store.stats.disk_hits == len(docs) and engine.store.stats.corrupt == 0
        assert engine.store.read_rates["disk"].samples == len(docs)
    # entries this size are files: the pipelined store read them layer by layer
    assert all(
        isinstance(ChunkStore(tmp_path / "warm", memory_limit_bytes=0).open_layers(k), LayerReader)
        for k in keys_of(plain, docs)
    )
    a, b = results["plain"], results["pipelined"]
    assert a.usage == b.usage and a.usage.recomputed_tokens < a.usage.cached_tokens  # the loaded KV is used
    assert a.token_ids == b.token_ids
    assert a.logprobs == b.logprobs  # bit for bit


def test_pipelined_equals_whole_entries_from_redis(engines_pair, docs, tmp_path, redis_url):
    plain, pipelined = engines_pair
    plain.store = ChunkStore(tmp_path / "warm", remote=redis_url)
    plain.warm(docs)
    prompt = BlendPrompt("Read.", docs[::-1], QUESTION)
    results = {}
    for name, engine in (("plain", plain), ("pipelined", pipelined)):
        engine.store = ChunkStore(tmp_path / name, remote=redis_url)  # another machine: Redis only
        results[name] = engine.generate(prompt, max_tokens=8, logprobs=2, recompute_ratio=0.3)
        s = engine.store.stats
        assert (s.remote_hits, s.disk_hits, s.corrupt) == (len(docs), 0, 0)
        assert engine.store.read_rates["remote"].samples == len(docs)
    a, b = results["plain"], results["pipelined"]
    assert a.usage == b.usage
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    # a Redis hit read in parts is copied to the local disk, as a whole read is
    local = ChunkStore(tmp_path / "pipelined", memory_limit_bytes=0)
    assert all(local.locate(k).tier == "disk" and local.get(k) is not None for k in keys_of(plain, docs))


def damage(store_path, key, how):
    """Damage the entry of ``key`` in the disk tier at ``store_path``."""
    with diskcache.Cache(str(store_path)) as raw:
        data = bytearray(raw[key])
        if how == "flip":  # in the last layer: only the checksum, once every layer is read, tells
            data[-100] ^= 0xFF
        else:
            data = data[: len(data) // 2]
        raw[key] = bytes(data)


@pytest.mark.parametrize("how,threads", [("flip", 1), ("truncate", 1), ("flip", 2)])
def test_damaged_entry_is_dropped_and_never_used(engines_pair, docs, tmp_path, caplog, monkeypatch, how, threads):
    """A flipped byte is found after the walk has used the entry's layers (the
    walk stops there, or ends, and runs again without it); a truncated file
    before the walk, from its size. Either way the answer is full prefill's,
    with one reading thread or two."""
    monkeypatch.setitem(blender.LAYER_READ_THREADS, "cpu", threads)
    plain, pipelined = engines_pair
    plain.warm(docs)
    prompt = BlendPrompt("Read.", docs[::-1], QUESTION)
    full = plain.generate(prompt, max_tokens=8, mode="full", logprobs=1)
    bad = keys_of(plain, docs)[1]
    damage(tmp_path / "warm", bad, how)

    pipelined.store = store = ChunkStore(tmp_path / "warm", memory_limit_bytes=0)
    with caplog.at_level(logging.WARNING, logger="blend_integrations.store"):
        g = pipelined.generate(prompt, max_tokens=8, recompute_ratio=1.0, logprobs=1)
    assert g.token_ids == full.token_ids
    assert chosen(g) == pytest.approx(chosen(full), abs=1e-5)
    assert (g.usage.chunks_hit, g.usage.chunks_missed) == (len(docs) - 1, 1)
    assert store.stats.corrupt == 1
    dropped = [r for r in caplog.records if "dropped corrupt entry" in r.getMessage()]
    assert len(dropped) == 1 and ("checksum mismatch" if how == "flip" else "truncated") in dropped[0].getMessage()
    # the chunk was computed again after the answer and stored: the next request hits
    assert ChunkStore(tmp_path / "warm", memory_limit_bytes=0).get(bad) is not None
    assert pipelined.generate(prompt, max_tokens=1).usage.chunks_hit == len(docs)


def test_damaged_entry_at_the_floor_answers_as_a_miss(engines_pair, docs, tmp_path):
    """At a ratio below 1 the stored KV shapes the answer: the damaged chunk's
    bytes must not, so the answer is the one with that chunk computed fresh."""
    plain, pipelined = engines_pair
    plain.warm(docs)
    prompt = BlendPrompt("Read.", docs[::-1], QUESTION)
    bad = keys_of(plain, docs)[2]
    results = {}
    for name, engine in (("plain", plain), ("pipelined", pipelined)):
        path = tmp_path / f"copy-{name}"
        with diskcache.Cache(str(tmp_path / "warm")) as src, diskcache.Cache(str(path)) as dst:
            for k in keys_of(plain, docs):
                dst[k] = bytes(src[k])
        damage(path, bad, "flip")
        engine.store = ChunkStore(path, memory_limit_bytes=0)
        results[name] = engine.generate(prompt, max_tokens=8, logprobs=2)
        assert engine.store.stats.corrupt == 1
    a, b = results["plain"], results["pipelined"]
    assert a.usage == b.usage and a.usage.chunks_missed == 1
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_damaged_redis_entry_is_dropped_there(engines_pair, docs, tmp_path, redis_url, redis_server):
    plain, pipelined = engines_pair
    plain.store = ChunkStore(tmp_path / "warm", remote=redis_url)
    plain.warm(docs)
    prompt = BlendPrompt("Read.", docs[::-1], QUESTION)
    full = plain.generate(prompt, max_tokens=8, mode="full")
    bad = keys_of(plain, docs)[0]
    r = redis_server.client()
    good = r.get(VALUE_PREFIX + bad)
    r.setrange(VALUE_PREFIX + bad, len(good) - 100, bytes([good[-100] ^ 0xFF]))
    pipelined.store = store = ChunkStore(tmp_path / "other", remote=redis_url)
    g = pipelined.generate(prompt, max_tokens=8, recompute_ratio=1.0)
    assert g.token_ids == full.token_ids
    assert (g.usage.chunks_hit, g.usage.chunks_missed) == (len(docs) - 1, 1)
    assert (store.stats.corrupt, store.stats.remote_hits) == (1, len(docs) - 1)
    assert r.get(VALUE_PREFIX + bad) == good  # dropped, then the recomputed chunk was written back


def test_loads_overlap_the_walk(engines_pair, docs, tmp_path):
    """The walk computes layer 0 (which needs no stored KV) while the chunks
    are still being read. Checked without timing: the loader is held before
    its second layer until layer 0 has computed; without overlap it would
    wait in vain (for 60 s) and the check fails."""
    plain, _ = engines_pair
    plain.warm(docs)
    store = ChunkStore(tmp_path / "warm", memory_limit_bytes=0)
    layer0_done = threading.Event()
    readers, held, seen = [], [], []
    open_layers = store.open_layers

    def gated_open(key, **kw):  # the store's reader, held back before its second layer
        reader = open_layers(key, **kw)
        read_layer = reader.read_layer

        def gated_read_layer():
            if reader.layers_read == 1:
                held.append(layer0_done.wait(timeout=60))
            read_layer()

        reader.read_layer = gated_read_layer
        readers.append(reader)
        return reader

    store.open_layers = gated_open
    model = plain.layers

    class Watched:  # the engine's model, noting how far loading had got when layer 0 ran
        def __getattr__(self, name):
            return getattr(model, name)

        def qkv(self, layer, hidden, queries=True):
            if layer == 0:
                seen.append(sum(r.layers_read for r in readers))
                layer0_done.set()
            return model.qkv(layer, hidden, queries)

    blender = Blender(
        Watched(),
        store,
        BlendConfig(pipelined_loading=True),
        fingerprint=plain.fingerprint,
        bos_token_id=plain.blender.keys.bos_token_id,
    )
    tp = plain.tokenize(BlendPrompt("Read.", docs[::-1], QUESTION))
    plan = blender.plan(tp.token_ids, tp.chunk_spans, mode="blend")
    _, stats = blender.prefill(KVCache.allocate(model, len(tp)), tp.token_ids, plan)
    assert stats.chunks_hit == len(docs) and len(readers) == len(docs)
    assert all(isinstance(r, LayerReader) and r.verified for r in readers)
    assert held == [True] * len(docs)  # each reader waited for layer 0 to compute, and it did
    assert seen[0] <= len(docs) < len(docs) * model.num_layers  # at most layer 0 of each chunk was in


# -- the store's layer readers -------------------------------------------------


def read_through(reader):
    for _ in range(reader.num_layers):
        reader.read_layer()
    reader.verify()


def test_layer_readers_per_tier(tmp_path, redis_url):
    from tests.fixtures.entries import bits, make_entry

    small, large = make_entry(1), make_entry(2, nbytes=256 * 1024)
    with ChunkStore(tmp_path / "a", remote=redis_url) as a:
        a.put(small)
        a.put(large)
        assert a.open_layers(large.key) is a.get(large.key)  # memory: the entry itself
    with ChunkStore(tmp_path / "a", memory_limit_bytes=0) as disk:
        whole = disk.open_layers(small.key)  # small entries live in the database: read whole
        assert not isinstance(whole, LayerReader) and bits(whole.kv).equal(bits(small.kv))
        geometry = (large.num_layers, large.num_kv_heads, large.num_tokens, large.head_dim, large.dtype)
        reader = disk.open_layers(large.key, expect=geometry)
        assert isinstance(reader, LayerReader) and reader.tier == "disk" and reader.layers_read == 0
        read_through(reader)
        entry = disk.finish_layers(reader)
        assert bits(entry.kv).equal(bits(large.kv))
        s = disk.stats
        assert (s.disk_hits, s.misses, s.bytes_read) == (2, 0, len(encode(small)) + len(encode(large)))
        assert disk.read_rates["disk"].samples == 2
        assert disk.open_layers("nowhere") is None and disk.stats.misses == 1
    with ChunkStore(tmp_path / "b", remote=redis_url) as b:
        reader = b.open_layers(large.key)
        assert reader.tier == "remote"
        read_through(reader)
        assert bits(b.finish_layers(reader).kv).equal(bits(large.kv))
        assert b.stats.remote_hits == 1 and b.locate(large.key).tier == "memory"
    with ChunkStore(tmp_path / "b", memory_limit_bytes=0) as b_disk:  # the Redis hit was copied to disk
        assert b_disk.get(large.key) is not None


def test_layer_reader_of_a_redis_entry_gone_midway_is_a_miss_not_damage(tmp_path, redis_url, redis_server):
    from tests.fixtures.entries import make_entry

    entry = make_entry(3, nbytes=256 * 1024)
    with ChunkStore(tmp_path / "a", remote=redis_url) as a:
        a.put(entry)
    with ChunkStore(tmp_path / "b", remote=redis_url) as b:
        reader = b.open_layers(entry.key, expect=None)
        reader.read_layer()
        redis_server.client().delete(VALUE_PREFIX + entry.key)  # evicted by another machine
        with pytest.raises(ReadFailed) as info:
            reader.read_layer()
        assert b.finish_layers(reader, info.value) is None
        assert (b.stats.corrupt, b.stats.misses, b.stats.remote_hits) == (0, 1, 0)
    with ChunkStore(tmp_path / "a", memory_limit_bytes=0) as a:
        assert a.get(entry.key) is not None  # the other copies are left alone
