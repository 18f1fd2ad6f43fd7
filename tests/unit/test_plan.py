"""The prefill plan (fusion/plan.py): what happens to each chunk, decided once,
and a Blender carrying a plan out."""

from __future__ import annotations

import pytest
import torch

from blend_integrations import BlendConfig, BlendPrompt, ChunkStore
from blend_integrations.fusion import Blender, ChunkKeys, KVCache, Planner, PrefillPlan
from blend_integrations.fusion.plan import COMPUTE, LOAD, MISS, measured_rates
from blend_integrations.store import ChunkKV, chunk_key

KEYS = ChunkKeys("fingerprint-1", torch.float32, None)
SPANS = [(2, 12), (13, 23), (24, 34)]
TOKENS = list(range(40))


def stored(store: ChunkStore, *spans: tuple[int, int]) -> None:
    """Put entries under the keys of ``spans`` (their shapes do not matter to the plan)."""
    for a, b in spans:
        store.put(ChunkKV(KEYS(TOKENS[a:b]), torch.zeros(2, 2, 1, b - a, 4)))


def plan(store, mode="blend", *, config=None, rates=None, ratio=None, promise=False) -> PrefillPlan:
    planner = Planner(config or BlendConfig(check_layers=(0,)), KEYS, num_layers=2)
    rates = rates or measured_rates(store, None)
    return planner.plan(TOKENS, SPANS, mode=mode, ratio=ratio, store=store, rates=rates, promise=promise)


def test_chunk_keys_are_the_stores_keys():
    ids = [5, 6, 7]
    assert KEYS(ids) == chunk_key(fingerprint="fingerprint-1", dtype="float32", token_ids=ids, bos_token_id=None)
    assert ChunkKeys("fingerprint-1", "float32", None)(ids) == KEYS(ids)  # a dtype or its name: one key
    assert ChunkKeys("fingerprint-1", torch.float32, 1)(ids) != KEYS(ids)  # the BOS is part of the recipe


def test_full_mode_plans_nothing(tmp_path):
    with ChunkStore(tmp_path) as store:
        stored(store, *SPANS)
        p = plan(store, "full", promise=True)
    assert p.chunks == () and p.loading is None
    assert p.usage() == dict(
        cached_tokens=0,
        recomputed_tokens=0,
        chunks_hit=0,
        chunks_missed=0,
        chunks_computed=0,
        recompute_ratio=None,
        ratio_source=None,
        calibration_dtype=None,
    )


def test_an_unpromised_plan_loads_every_chunk_without_looking(tmp_path):
    with ChunkStore(tmp_path) as store:  # empty, yet every chunk is planned to load: found or not when read
        p = plan(store, "reuse")
    assert [(c.start, c.end, c.action) for c in p.chunks] == [(a, b, LOAD) for a, b in SPANS]
    assert [c.key for c in p.chunks] == [KEYS(TOKENS[a:b]) for a, b in SPANS]


def test_a_promised_plan_looks_chunks_up_and_its_usage_counts_them(tmp_path):
    config = BlendConfig(check_layers=(0,), sink_tokens=2, recompute_ratio=0.25)
    with ChunkStore(tmp_path) as store:
        stored(store, SPANS[0], SPANS[2])
        p = plan(store, config=config, promise=True)
        reuse = plan(store, "reuse", config=config, promise=True)
    assert [c.action for c in p.chunks] == [LOAD, MISS, LOAD] and p.promised and p.ratio == 0.25
    # two chunks of 10 tokens, 2 sink tokens each computed fresh: 16 cached, a quarter of them recomputed
    assert p.usage() == dict(
        cached_tokens=16,
        recomputed_tokens=4,
        chunks_hit=2,
        chunks_missed=1,
        chunks_computed=0,
        recompute_ratio=0.25,
        ratio_source="config",
        calibration_dtype=None,
    )
    assert reuse.usage()["recomputed_tokens"] == 0 and reuse.usage()["cached_tokens"] == 16
    assert reuse.usage()["recompute_ratio"] is None
    by_request = plan(store, config=config, ratio=1.0, promise=True).usage()
    assert by_request["recomputed_tokens"] == 16 and by_request["ratio_source"] == "request"


def test_auto_without_a_calibration_plans_the_fallback_ratio(tmp_path):
    from blend_integrations.config import FALLBACK_RATIO

    with ChunkStore(tmp_path) as store:
        stored(store, *SPANS)
        p = plan(store, config=BlendConfig(check_layers=(0,)), promise=True)  # "auto", the default
        explicit = plan(store, config=BlendConfig(check_layers=(0,)), ratio="auto", promise=True)
    assert BlendConfig().recompute_ratio == "auto"
    assert (p.ratio, p.ratio_source, p.guard) == (FALLBACK_RATIO, "fallback", None)
    assert p.usage()["recompute_ratio"] == FALLBACK_RATIO and explicit.ratio_source == "fallback"


def test_the_loading_controller_computes_a_chunk_slower_to_load(tmp_path):
    config = BlendConfig(check_layers=(0,), loading_controller=True, recompute_ratio=0.15)
    with ChunkStore(tmp_path) as store:
        stored(store, *SPANS)
        # Disk reads at 1 byte/s and a fast walk: every chunk is cheaper to compute than to load.
        slow = plan(store, config=config, rates={"memory": 1.0, "disk": 1.0, "remote": 1.0, "compute": 1e9})
        # The walk's speed not yet measured: everything found is loaded, at the floor.
        unmeasured = plan(store, config=config)
    assert [c.action for c in slow.chunks] == [COMPUTE] * 3
    assert slow.usage() == dict(
        cached_tokens=0,
        recomputed_tokens=0,
        chunks_hit=0,
        chunks_missed=0,
        chunks_computed=3,
        recompute_ratio=slow.ratio,
        ratio_source="config",
        calibration_dtype=None,
    )
    assert slow.loading.chunks_computed == 3 and slow.loading.ratio_floor == 0.15
    assert [c.action for c in unmeasured.chunks] == [LOAD] * 3 and unmeasured.ratio == 0.15
    assert unmeasured.loading.est_compute_ms is None


@pytest.mark.parametrize("promise", [True, False])
def test_a_chunk_gone_from_the_store_keeps_a_promise_or_becomes_a_miss(engine, docs, tmp_path, promise):
    """A promised plan's usage was reported before it ran: a chunk planned to load
    that is gone by then is computed standalone and used as loaded. An unpromised
    one counts it as a miss."""
    tp = engine.tokenize(BlendPrompt("Read.", docs, "Which?"))
    with ChunkStore(tmp_path / "before") as before, ChunkStore(tmp_path / "after") as after:
        blender = Blender(
            engine.layers,
            before,
            BlendConfig(),
            fingerprint=engine.fingerprint,
            bos_token_id=engine.blender.keys.bos_token_id,
        )
        for a, b in tp.chunk_spans:
            blender.ensure(tp.token_ids[a:b])
        rates = measured_rates(before, None)
        p = blender.planner.plan(
            tp.token_ids, tp.chunk_spans, mode="blend", ratio=None, store=before, rates=rates, promise=promise
        )
        assert [c.action for c in p.chunks] == [LOAD] * len(docs)
        blender.store = after  # every chunk leaves the store between plan and run
        _, stats = blender.prefill(KVCache.allocate(engine.layers, len(tp)), tp.token_ids, p, logits=False)
        if promise:
            assert (stats.chunks_hit, stats.chunks_missed) == (len(docs), 0)
            assert (stats.cached_tokens, stats.recomputed_tokens) == (
                p.usage()["cached_tokens"],
                p.usage()["recomputed_tokens"],
            )
            assert all(c.key in after for c in p.chunks)  # computed standalone, and saved
        else:
            assert (stats.chunks_hit, stats.chunks_missed, stats.cached_tokens) == (0, len(docs), 0)
            assert sorted(stats.missed) == sorted(c.key for c in p.chunks)
