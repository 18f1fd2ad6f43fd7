"""The loading controller: where chunks are, how fast tiers read and the engine
computes, and what it decides from that. Real stores (disk, Redis on loopback)
and a real small model; a tier is made slow by the read bandwidth the store
assumes before it has measured one (``ChunkStore(read_bandwidth=...)``), which
is what the controller sees for a tier it has not read from yet."""

from __future__ import annotations

import pytest

from blend_integrations import BlendConfig, BlendPrompt, ChunkStore, load_engine
from blend_integrations.cost import Shape, Speed, passes, token_layers
from blend_integrations.fusion.controller import plan
from blend_integrations.store import DEFAULT_READ_BANDWIDTH
from blend_integrations.store.format import encode
from blend_integrations.store.rate import Rate
from tests.fixtures.entries import make_entry
from tests.fixtures.exactness import chosen

QUESTION = "Question: which city is named in the documents? Answer:"
CONTROLLED = BlendConfig(loading_controller=True, pipelined_loading=True)


# -- the store: where a key is, and how fast each tier reads ------------------


def test_locate_reports_tier_and_size_without_reading(tmp_path, redis_url):
    entry = make_entry(1)
    with ChunkStore(tmp_path / "a", remote=redis_url) as a:
        a.put(entry)
        assert a.locate(entry.key) == ("memory", entry.nbytes)
    encoded = len(encode(entry))
    with ChunkStore(tmp_path / "a", remote=redis_url) as on_disk:  # a new process: empty memory tier
        assert on_disk.locate(entry.key) == ("disk", encoded)
        assert on_disk.locate("nowhere").tier is None and "nowhere" not in on_disk
    with ChunkStore(tmp_path / "b", remote=redis_url) as b:
        assert b.locate(entry.key) == ("remote", encoded)
        assert entry.key in b
        s = b.stats
        assert (s.memory_hits, s.disk_hits, s.remote_hits, s.misses) == (0, 0, 0, 0)  # nothing read
        assert b.read_rates["remote"].samples == 0
        assert b.get(entry.key) is not None
        assert b.read_rates["remote"].samples == 1
        assert b.locate(entry.key) == ("memory", entry.nbytes)  # a hit is copied up


def test_reads_measure_each_tiers_bandwidth(tmp_path, redis_url):
    entries = [make_entry(i, nbytes=64 * 1024) for i in range(3)]
    with ChunkStore(tmp_path / "a", remote=redis_url) as a:
        for e in entries:
            a.put(e)
    with ChunkStore(tmp_path / "a", remote=redis_url) as disk, ChunkStore(tmp_path / "b", remote=redis_url) as remote:
        for e in entries:
            assert disk.get(e.key) is not None and remote.get(e.key) is not None
            assert disk.get(e.key) is not None  # now from memory
        for store, tier in ((disk, "disk"), (remote, "remote"), (disk, "memory")):
            rate = store.read_rates[tier]
            assert rate.samples == 3
            assert rate.value != DEFAULT_READ_BANDWIDTH[tier] and rate.value > 0
        assert disk.read_rates["remote"].samples == 0  # never read there
        assert disk.read_rates["remote"].value == DEFAULT_READ_BANDWIDTH["remote"]
        # load time estimates come from the measured bandwidth
        where = remote.locate(entries[0].key)
        assert remote.load_seconds(where) == pytest.approx(where.nbytes / remote.read_rates["memory"].value)


def test_rate_is_a_weighted_mean_of_amounts_over_seconds():
    rate = Rate(1000.0, weight=0.25)
    assert rate.value == 1000.0 and rate.samples == 0
    rate.add(100, 1.0)  # the first measurement replaces the initial guess
    assert rate.value == 100.0
    rate.add(500, 1.0)  # amounts: 100 + 0.25 * 400 = 200, seconds 1
    assert rate.value == pytest.approx(200.0)
    rate.add(200, 3.0)  # amounts 200, seconds 1 + 0.25 * 2 = 1.5
    assert rate.value == pytest.approx(200.0 / 1.5)
    rate.add(0, 1.0)  # nothing measured
    assert rate.samples == 3
    assert Rate().value is None


def test_bad_settings_are_named(tmp_path):
    with pytest.raises(ValueError, match="read_bandwidth: unknown tier 'tape'"):
        ChunkStore(tmp_path, read_bandwidth={"tape": 1e6})
    with pytest.raises(ValueError, match=r"read_bandwidth\['disk'\] must be a positive number"):
        ChunkStore(tmp_path, read_bandwidth={"disk": 0})
    with pytest.raises(ValueError, match="loading_controller must be True or False"):
        BlendConfig(loading_controller="yes")
    with pytest.raises(ValueError, match="pipelined_loading must be True or False"):
        BlendConfig(pipelined_loading=1)


def test_vllm_engine_args_carry_the_controller_and_the_assumed_bandwidths(tmp_path):
    """Both options reach the vLLM connector (tests/integration/test_vllm_controller.py runs them), and so does
    what the store assumes of each tier until the worker has measured it."""
    from blend_integrations.engines.vllm_contract import blend_engine_args, connector_store_args

    store = ChunkStore(tmp_path, read_bandwidth={"remote": 1000.0})
    args = blend_engine_args(store=store, config=CONTROLLED, max_model_len=512, on_gpu=False)
    extra = args["kv_transfer_config"]["kv_connector_extra_config"]
    assert extra["blend_config"]["loading_controller"] is extra["blend_config"]["pipelined_loading"] is True
    assert connector_store_args(extra)["read_bandwidth"] == {**DEFAULT_READ_BANDWIDTH, "remote": 1000.0}


# -- the decision logic, on numbers worked out by hand ------------------------


def schedule_of(check_layers):
    return BlendConfig(check_layers=check_layers).check_schedule


def decide(load_s, *, tokens=(40, 40), overlapped=True, floor=0.25):
    # 100 tokens, 4 layers, check layer 1, 100 token-layers/s: compute(r) = (100 + 3 * (20 + 80 r)) / 100 s
    return plan(
        list(tokens),
        list(load_s),
        num_tokens=100,
        num_layers=4,
        schedule=schedule_of((1,)),
        floor=floor,
        speed=Speed(0.01),
        overlapped=overlapped,
    )


def test_loads_hidden_under_compute_keep_the_floor():
    p = decide([0.5, 0.5])  # load 1 s < compute at the floor, 2.2 s
    assert p.load == [True, True] and p.ratio == 0.25
    assert p.load_s == 1.0 and p.compute_s == pytest.approx(2.2)


def test_ratio_rises_until_compute_equals_loads():
    p = decide([1.4, 1.4])  # load 2.8 s: compute(r) = 1.6 + 2.4 r = 2.8 at r = 0.5
    assert p.load == [True, True]
    assert p.ratio == pytest.approx(0.5) and p.compute_s == pytest.approx(2.8)
    assert decide([1.4, 1.4], floor=0.75).ratio == 0.75  # never below the floor
    # Loads of 5 s are longer than the whole prompt's compute (4 s): one chunk
    # is computed instead (3.1 s), and the other's 2.5 s load then hides under that.
    p = decide([2.5, 2.5])
    assert p.load == [False, True] and p.ratio == 0.25 and p.compute_s == pytest.approx(3.1)


def test_a_chunk_slower_to_load_than_to_compute_is_computed():
    # Chunk 0 takes 9 s; computing its 40 tokens instead adds 3 * 40 * 0.75 / 100 = 0.9 s.
    p = decide([9.0, 0.1])
    assert p.load == [False, True]
    assert p.load_s == pytest.approx(0.1)
    assert p.ratio == 0.25 and p.compute_s == pytest.approx((100 + 3 * (60 + 10)) / 100)
    # Without overlap the time is load + compute: a chunk is loaded only when
    # reading it is cheaper than computing it, and the ratio stays at the floor.
    p = decide([0.8, 1.0], overlapped=False)
    assert p.load == [True, False] and p.ratio == 0.25
    # With overlap, a load that hides under the compute is kept even if it is
    # slower than computing that one chunk.
    assert decide([1.0, 1.0]).load == [True, True]
    # a chunk with no reusable tokens (all sink tokens) is never worth reading
    assert decide([0.01, 0.1], tokens=(0, 40)).load == [False, True]


def test_unknown_throughput_loads_everything_at_the_floor():
    p = plan(
        [40],
        [9.0],
        num_tokens=100,
        num_layers=4,
        schedule=schedule_of((1,)),
        floor=0.2,
        speed=None,
        overlapped=True,
    )
    assert p.load == [True] and p.ratio == 0.2 and p.compute_s is None


# -- the engine: real prefills with the decisions in the stats -----------------


@pytest.fixture
def controlled(model_dirs, tmp_path):
    return load_engine(model_dirs("llama"), store=ChunkStore(tmp_path / "warm"), device="cpu", config=CONTROLLED)


def warm_everywhere(engine, docs, tmp_path, redis_url):
    """Warm ``docs`` into a store with Redis; return the prompt and a function
    opening a new store over Redis alone (another machine) with options."""
    engine.store = ChunkStore(tmp_path / "warm", remote=redis_url)
    engine.warm(docs)
    engine.generate(BlendPrompt("Read.", docs, QUESTION), max_tokens=1)  # measures the walk on a prefill too
    n = iter(range(100))
    return BlendPrompt("Read.", docs[::-1], QUESTION), lambda **kw: ChunkStore(
        tmp_path / f"s{next(n)}", remote=redis_url, **kw
    )


def test_chunks_in_memory_are_loaded_at_the_floor_as_without_controller(controlled, engines, docs):
    plain = engines("llama")  # the session store, controller off
    plain.warm(docs)
    controlled.store = plain.store
    prompt = BlendPrompt("Read.", docs[::-1], QUESTION)
    controlled.generate(prompt, max_tokens=1)  # a first prefill measures the walk
    g = controlled.generate(prompt, max_tokens=8, logprobs=1)
    ref = plain.generate(prompt, max_tokens=8, logprobs=1)
    assert ref.loading is None and "loading" not in ref.stats()
    lo = g.loading
    assert (lo.chunks_memory, lo.chunks_disk, lo.chunks_remote, lo.chunks_computed) == (len(docs), 0, 0, 0)
    assert lo.recompute_ratio == lo.ratio_floor == 0.15  # nothing to hide compute under
    assert lo.est_compute_ms > 0 and lo.est_load_ms < lo.est_compute_ms
    assert g.usage == ref.usage
    assert g.token_ids == ref.token_ids and chosen(g) == chosen(ref)
    assert g.stats()["loading"]["recompute_ratio"] == 0.15


def test_slow_tier_chunks_are_computed_not_loaded(controlled, docs, tmp_path, redis_url):
    prompt, machine = warm_everywhere(controlled, docs, tmp_path, redis_url)
    full = controlled.generate(prompt, max_tokens=8, mode="full", logprobs=1)
    slow = machine(read_bandwidth={"remote": 1000.0})  # 1 kB/s: seconds per chunk
    controlled.store = slow
    g = controlled.generate(prompt, max_tokens=8, logprobs=1)
    u = g.usage
    assert (u.chunks_hit, u.chunks_missed, u.chunks_computed) == (0, 0, len(docs))
    assert u.cached_tokens == u.recomputed_tokens == 0  # neither cached nor recomputed: fresh
    assert (g.loading.chunks_remote, g.loading.chunks_computed, g.loading.est_load_ms) == (len(docs), len(docs), 0)
    assert slow.stats.remote_hits == 0 and slow.stats.puts == 0  # never read, and not stored again
    # every token computed at every layer: full prefill's answer
    assert g.token_ids == full.token_ids
    assert chosen(g) == pytest.approx(chosen(full), abs=1e-6)


def test_ratio_rises_above_the_floor_to_hide_compute_under_slow_loads(controlled, docs, tmp_path, redis_url):
    prompt, machine = warm_everywhere(controlled, docs, tmp_path, redis_url)
    tp = controlled.tokenize(prompt)
    keys = [controlled.chunk_key(tp.token_ids[a:b]) for a, b in tp.chunk_spans]
    tokens = [b - a for a, b in tp.chunk_spans]
    probe = machine()
    sizes = [probe.locate(k).nbytes for k in keys]
    assert all(probe.locate(k).tier == "remote" for k in keys)
    # Pick the Redis bandwidth from the measured throughput so that the loads
    # take longer than the walk at the floor, but every chunk is still worth
    # loading (the loads minus any one chunk still take longer than the walk
    # with that chunk computed).
    N, L, floor, schedule = len(tp), controlled.layers.num_layers, 0.15, CONTROLLED.check_schedule
    speed = controlled.blender.walk_speed
    fitted = speed.fitted()
    walk = schedule(floor)
    compute = lambda reused: fitted.seconds(token_layers(Shape(N, reused), L, walk), passes(walk))  # noqa: E731
    U = sum(tokens)
    least_saving = min(compute(U - t) - compute(U) for t in tokens)
    bandwidth = sum(sizes) / (compute(U) + least_saving / 2)
    controlled.store = machine(read_bandwidth={"remote": bandwidth})

    expected = plan(
        tokens,
        [s / bandwidth for s in sizes],
        num_tokens=N,
        num_layers=L,
        schedule=schedule,
        floor=floor,
        speed=fitted,
        overlapped=True,
    )
    assert expected.load == [True] * len(docs) and floor < expected.ratio < 1.0
    g = controlled.generate(prompt, max_tokens=4)
    lo = g.loading
    assert lo.recompute_ratio == pytest.approx(expected.ratio) and lo.ratio_floor == floor
    assert lo.est_load_ms == pytest.approx(1000 * expected.load_s)
    assert lo.est_compute_ms == pytest.approx(1000 * expected.compute_s)
    assert lo.est_compute_ms == pytest.approx(lo.est_load_ms)  # recompute hides under the loads
    assert (lo.chunks_remote, lo.chunks_computed) == (len(docs), 0)
    assert g.usage.chunks_hit == len(docs) and g.usage.cached_tokens == U
    assert g.usage.recomputed_tokens == round(lo.recompute_ratio * U) > round(floor * U)
    # the loads were measured: the next request sees Redis's real bandwidth
    assert controlled.store.read_rates["remote"].samples == len(docs)


def test_mixed_tiers_at_ratio_one_equal_full_prefill(controlled, docs, tmp_path, redis_url):
    prompt, machine = warm_everywhere(controlled, docs, tmp_path, redis_url)
    full = controlled.generate(prompt, max_tokens=8, mode="full", logprobs=1)
    here = machine(memory_limit_bytes=0, read_bandwidth={"remote": 1000.0})
    for d in docs[:2]:  # two chunks on this machine's disk, two in a slow Redis only
        key = controlled.chunk_key(controlled.tokenizer.encode(d, add_special_tokens=False))
        here.put(controlled.store.get(key))
    controlled.store = here
    g = controlled.generate(prompt, max_tokens=8, recompute_ratio=1.0, logprobs=1)
    lo = g.loading
    assert (lo.chunks_memory, lo.chunks_disk, lo.chunks_remote, lo.chunks_computed) == (0, 2, 2, 2)
    assert lo.recompute_ratio == lo.ratio_floor == 1.0
    assert (g.usage.chunks_hit, g.usage.chunks_missed, g.usage.chunks_computed) == (2, 0, 2)
    assert g.usage.cached_tokens == g.usage.recomputed_tokens > 0
    assert g.token_ids == full.token_ids
    assert chosen(g) == pytest.approx(chosen(full), abs=1e-5)
