"""The blend counts: each finished request's connector answer counted once, by
outcome, and the same numbers on Prometheus series and in ``stats()``."""

from __future__ import annotations

import collections
import functools

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from blend_integrations.engines.blend_metrics import REASONS, BlendCounters, store_reads
from blend_integrations.engines.vllm_contract import blend_results, not_blended
from blend_integrations.fusion.plan import PrefillPlan


def blended(cached: int, recomputed: int, ratio: float, source: str = "request", hit: int = 2) -> dict:
    usage = {
        "cached_tokens": cached,
        "recomputed_tokens": recomputed,
        "chunks_hit": hit,
        "chunks_missed": 1,
        "chunks_computed": 0,
        "recompute_ratio": ratio,
        "ratio_source": source,
    }
    blend_results({"blend": usage})  # a valid answer, as the connector sends it
    return {"blend": usage}


ANSWERS = [
    blended(400, 60, 0.15),
    blended(300, 90, 0.3, source="guard"),
    {"blend": {**blended(500, 0, 0.0)["blend"], "recompute_ratio": None, "ratio_source": None}},  # mode reuse
    not_blended("kv_transfer_params.blend.ratio must be ...", "invalid_params"),
    not_blended("planning the blend pass failed: ...", "planning_failed"),
    {"blend": PrefillPlan("full", 1.0, (), 0, ratio_source="calibrated").usage()},  # the calibration chose full
    None,  # a plain request
]


def test_each_answer_is_counted_once_by_outcome():
    counters = BlendCounters()
    for answer in ANSWERS:
        counters.add(answer)
    assert counters.requests == {
        "blend/": 2,
        "reuse/": 1,
        "full/invalid_params": 1,
        "full/planning_failed": 1,
        "full/calibrated": 1,
        "full/not_requested": 1,
    }
    assert counters.counts["cached_tokens"] == 1200 and counters.counts["recomputed_tokens"] == 150
    assert counters.counts["chunks_hit"] == 6 and counters.counts["chunks_missed"] == 3
    assert counters.ratios == [0.15, 0.3] and counters.guard_raised == 1
    summary = counters.summary()
    assert summary["requests_blend"] == 2 and summary["requests_full_calibrated"] == 1
    assert summary["mean_recompute_ratio"] == pytest.approx(0.225)


def test_counts_survive_vllms_transport_and_merge():
    a, b = BlendCounters(), BlendCounters()
    for answer in ANSWERS[:3]:
        a.add(answer)
    for answer in ANSWERS[3:]:
        b.add(answer)
    whole = BlendCounters()
    for answer in ANSWERS:
        whole.add(answer)
    merged = BlendCounters.of(a.data()).merge(BlendCounters.of(b.data()))
    assert merged.data() == whole.data()
    assert not BlendCounters() and not BlendCounters.of(None)


def test_prometheus_series_equal_the_counts():
    vllm_connector = pytest.importorskip("blend_integrations.engines.vllm_connector")
    registry = CollectorRegistry()
    types = {kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}

    class Config:
        kv_transfer_config = None

    metrics = vllm_connector.BlendConnector.build_prom_metrics(
        Config(), types, ["model_name", "engine"], {0: ["m", "0"]}
    )
    counters = BlendCounters(
        tiers=collections.Counter({"memory/hits": 3, "memory/bytes": 300, "disk/hits": 1, "disk/seconds": 0.5})
    )
    for answer in ANSWERS:
        counters.add(answer)
    stats = vllm_connector.BlendConnector.build_kv_connector_stats(counters.data())
    assert not stats.is_empty() and stats.reduce() == counters.summary()
    metrics.observe(stats.data, 0)
    metrics.observe(stats.data, 0)  # a second interval with the same requests

    def value(name, **labels):
        return registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})

    assert value("vllm:blend_requests_total", outcome="blend", reason="") == 4
    for reason in ("invalid_params", "planning_failed", "calibrated", "not_requested"):
        assert value("vllm:blend_requests_total", outcome="full", reason=reason) == 2
    assert reason in REASONS
    assert value("vllm:blend_cached_tokens_total") == 2400
    assert value("vllm:blend_recomputed_tokens_total") == 300
    assert value("vllm:blend_guard_raised_total") == 2
    assert value("vllm:blend_recompute_ratio_count") == 4
    assert value("vllm:blend_recompute_ratio_bucket", le="0.15") == 2
    assert (
        value("vllm:blend_store_hits_total", tier="memory") == 6
        and value("vllm:blend_store_hits_total", tier="disk") == 2
    )
    assert value("vllm:blend_store_read_bytes_total", tier="memory") == 600
    assert value("vllm:blend_store_read_seconds_total", tier="disk") == 1.0
    # series nothing moved exist at 0, so rates and alerts over them work from the start
    assert value("vllm:blend_requests_total", outcome="full", reason="blend_pass_failed") == 0
    assert value("vllm:blend_store_hits_total", tier="remote") == value("vllm:blend_chunks_computed_total") == 0


def test_store_reads_count_each_tier_with_its_bytes_and_time(tmp_path):
    """The store series' source: a real store's reads, by the tier that answered."""
    from blend_integrations.store import ChunkStore
    from tests.fixtures.entries import make_entry

    entries = [make_entry(i) for i in range(3)]
    with ChunkStore(tmp_path / "store", memory_limit_bytes=0) as writer:
        for entry in entries:
            writer.put(entry)
    with ChunkStore(tmp_path / "store") as store:
        assert not +store_reads(store.stats)  # nothing read yet
        for entry in entries:
            assert store.get(entry.key) is not None  # from disk, copied into memory
        assert store.get(entries[0].key) is not None  # from memory
        assert store.get("ff" * 32) is None  # a miss is no read
        reads = store_reads(store.stats)
    nbytes = sum(e.nbytes for e in entries)
    assert reads["disk/hits"] == 3 and reads["disk/bytes"] >= nbytes and reads["disk/seconds"] > 0
    assert reads["memory/hits"] == 1 and reads["memory/bytes"] == entries[0].nbytes and reads["memory/seconds"] > 0
    assert reads["remote/hits"] == 0
    counters = BlendCounters(tiers=reads)
    assert counters and counters.summary()["store_disk_hits"] == 3
    assert BlendCounters.of(counters.data()).tiers == +reads
