"""The loading controller and pipelined loading in the vLLM engine: vLLM's real
CPU engine with the blend connector, a small local model, a real store on disk
and a real Redis on loopback.

The connector's scheduler side decides (so usage is exact when a request ends,
even in its prefill step), from the rates the worker measured and sends back
after each step. A tier is made slow by the read bandwidth the store assumes
until the worker has read from it (``ChunkStore(read_bandwidth=...)``, passed to
vLLM's processes with the store's other settings)."""

from __future__ import annotations

import dataclasses

import pytest
from test_pipelined_loading import damage

from blend_integrations import BlendConfig, BlendPrompt, ChunkStore, load_engine
from tests.fixtures.exactness import chosen

QUESTION = "Question: which city is named in the documents? Answer:"
CONTROLLED = BlendConfig(loading_controller=True, pipelined_loading=True)


def tokens_of(engine, docs):
    return sum(len(engine.tokenizer.encode(d, add_special_tokens=False)) for d in docs)


def keys_of(engine, docs):
    return [engine.chunk_key(engine.tokenizer.encode(d, add_special_tokens=False)) for d in docs]


def consistent(g):
    """The controller's decisions in the stats agree with the usage."""
    lo, u = g.loading, g.usage
    assert g.stats()["loading"] == dataclasses.asdict(lo)
    assert u.chunks_computed == lo.chunks_computed
    assert u.chunks_hit + u.chunks_computed == lo.chunks_memory + lo.chunks_disk + lo.chunks_remote
    assert u.recomputed_tokens == round(lo.recompute_ratio * u.cached_tokens)
    assert lo.recompute_ratio >= lo.ratio_floor


@pytest.fixture(scope="module")
def controlled(model_dirs, tmp_path_factory, redis_server):
    """One vLLM engine with the controller and pipelined loading for the module (~40 s to start).
    Its Redis tier is assumed to read 1 kB/s until the worker reads from it: a chunk there alone
    takes seconds to load, far longer than computing it."""
    store = ChunkStore(
        tmp_path_factory.mktemp("vllm-controlled"), remote=redis_server.url(), read_bandwidth={"remote": 1000.0}
    )
    engine = load_engine(
        model_dirs("llama"), backend="vllm", store=store, config=CONTROLLED, max_model_len=2048, kv_cache_gib=1
    )
    yield engine
    engine.close()


def test_fresh_engine_loads_everything_at_the_floor_and_ratio_one_equals_full_prefill(controlled, docs):
    # First in this module: the engine has not blended yet, so the scheduler
    # knows no compute throughput (warming measures it in the worker, which
    # sends it after its next step) and loads every stored chunk at the floor.
    controlled.warm(docs)
    prompt = BlendPrompt("You answer questions.", docs[::-1], QUESTION)
    first = controlled.generate(prompt, max_tokens=12, recompute_ratio=1.0, logprobs=2)
    lo = first.loading
    assert lo.est_compute_ms is None and lo.est_load_ms > 0
    # the scheduler's view of the store is the shared tiers: the worker's memory copies count as disk
    assert (lo.chunks_memory, lo.chunks_disk, lo.chunks_remote, lo.chunks_computed) == (0, len(docs), 0, 0)
    assert lo.recompute_ratio == lo.ratio_floor == 1.0
    assert (first.usage.chunks_hit, first.usage.chunks_missed, first.usage.chunks_computed) == (len(docs), 0, 0)
    consistent(first)

    full = controlled.generate(prompt, max_tokens=12, mode="full", logprobs=2)
    assert full.loading is None and "loading" not in full.stats()
    assert first.token_ids == full.token_ids
    assert chosen(first) == pytest.approx(chosen(full), abs=1e-3)

    # now the worker's measured throughput has reached the scheduler
    again = controlled.generate(prompt, max_tokens=12, recompute_ratio=1.0, logprobs=2)
    assert again.loading.est_compute_ms > 0
    consistent(again)
    assert again.token_ids == full.token_ids
    assert chosen(again) == pytest.approx(chosen(full), abs=1e-3)


def test_decisions_agree_with_usage(controlled, docs):
    controlled.warm(docs)
    prompt = BlendPrompt("Read.", docs[::-1], QUESTION)
    controlled.generate(prompt, max_tokens=1)  # the walk's throughput reaches the scheduler
    g = controlled.generate(prompt, max_tokens=8)
    consistent(g)
    lo, u = g.loading, g.usage
    assert lo.ratio_floor == 0.15 and lo.est_compute_ms > 0
    # chunks on this machine's disk load in far less time than the walk: all loaded
    assert (lo.chunks_disk, lo.chunks_computed) == (len(docs), 0)
    assert (u.chunks_hit, u.chunks_missed, u.chunks_computed) == (len(docs), 0, 0)
    assert u.cached_tokens == tokens_of(controlled, docs)


def test_a_chunk_slower_to_load_than_to_compute_is_computed(controlled, model_dirs, docs, tmp_path, redis_url):
    here, away = docs[:2], docs[2:]
    controlled.warm(here)
    # another machine puts the other two in Redis: only there for this engine, read at 1 kB/s
    writer = load_engine(model_dirs("llama"), store=ChunkStore(tmp_path / "elsewhere", remote=redis_url), device="cpu")
    assert writer.warm(away) == len(away)
    controlled.generate(
        BlendPrompt("Read.", here, QUESTION), max_tokens=1
    )  # the walk's throughput reaches the scheduler

    prompt = BlendPrompt("Read.", [away[0], here[0], away[1], here[1]], QUESTION)
    full = controlled.generate(prompt, max_tokens=8, mode="full", logprobs=1)
    g = controlled.generate(prompt, max_tokens=8, recompute_ratio=1.0, logprobs=1)
    lo, u = g.loading, g.usage
    assert (lo.chunks_memory, lo.chunks_disk, lo.chunks_remote, lo.chunks_computed) == (0, 2, 2, 2)
    assert lo.recompute_ratio == lo.ratio_floor == 1.0
    assert (u.chunks_hit, u.chunks_missed, u.chunks_computed) == (2, 0, 2)
    assert u.cached_tokens == u.recomputed_tokens == tokens_of(controlled, here)
    consistent(g)
    assert g.token_ids == full.token_ids
    assert chosen(g) == pytest.approx(chosen(full), abs=1e-3)

    # A request that ends in its prefill step reports the same decisions: the
    # scheduler took them, before the worker ran.
    one = controlled.generate(prompt, max_tokens=1)
    assert one.usage.completion_tokens == 1
    assert (one.usage.chunks_hit, one.usage.chunks_missed, one.usage.chunks_computed) == (2, 0, 2)
    assert one.usage.cached_tokens == tokens_of(controlled, here)
    assert one.stats()["loading"]["chunks_computed"] == 2
    consistent(one)

    # the slow chunks were never read from Redis, nor stored again by the worker
    local = ChunkStore(controlled.store.path, memory_limit_bytes=0, remote="")
    assert not any(k in local for k in keys_of(controlled, away))
    assert all(k in local for k in keys_of(controlled, here))


def test_a_damaged_chunk_planned_to_load_is_computed_and_usage_stays_true(controlled, model_dirs, docs):
    """The scheduler plans to load a chunk whose entry on disk is damaged: the
    worker finds it out while reading it layer by layer, computes it with the
    standalone recipe instead and uses that, so the answer at ratio 1.0 is full
    prefill's and the usage reported (a hit) is what was used."""
    # written to this engine's directory by another process: on disk, not in the worker's memory
    writer = load_engine(model_dirs("llama"), store=ChunkStore(controlled.store.path, remote=""), device="cpu")
    assert writer.warm(docs) == len(docs)
    bad = keys_of(controlled, docs)[1]
    damage(controlled.store.path, bad, "flip")
    prompt = BlendPrompt("Read.", docs[::-1], QUESTION)
    full = controlled.generate(prompt, max_tokens=8, mode="full", logprobs=1)
    g = controlled.generate(prompt, max_tokens=8, recompute_ratio=1.0, logprobs=1)
    assert (g.loading.chunks_disk, g.loading.chunks_computed) == (len(docs), 0)
    assert (g.usage.chunks_hit, g.usage.chunks_missed, g.usage.chunks_computed) == (len(docs), 0, 0)
    consistent(g)
    assert g.token_ids == full.token_ids
    assert chosen(g) == pytest.approx(chosen(full), abs=1e-3)
    assert ChunkStore(controlled.store.path, memory_limit_bytes=0, remote="").get(bad) is not None  # stored again
