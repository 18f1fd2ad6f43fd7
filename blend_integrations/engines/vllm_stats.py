"""Engines layer: the blend connector's counts as vLLM carries them, per interval
(``BlendConnectorStats``) to its API server, and as series on ``/metrics``
(``BlendPromMetrics``); the counting itself is ``blend_metrics.BlendCounters``."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from .blend_metrics import RATIO_BUCKETS, REASONS, TIERS, BlendCounters


class BlendConnectorStats(KVConnectorStats):
    """One interval's ``BlendCounters``, as vLLM carries connector stats to its API server."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> BlendConnectorStats:
        merged = BlendCounters.of(self.data).merge(BlendCounters.of(getattr(other, "data", None)))
        return BlendConnectorStats(data=merged.data())

    def reduce(self) -> dict[str, int | float]:
        return BlendCounters.of(self.data).summary()

    def is_empty(self) -> bool:
        return not BlendCounters.of(self.data)


class BlendPromMetrics(KVConnectorPromMetrics):
    """The blend series on vLLM's ``/metrics``, one set per engine."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str], per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._labelvalues = per_engine_labelvalues
        self._requests = self._counter_cls(
            name="vllm:blend_requests",
            documentation="Finished requests by outcome (blend, reuse, full) and, for full prefill, the reason.",
            labelnames=[*labelnames, "outcome", "reason"],
        )
        self._counts = {
            name: self._counter_cls(name=f"vllm:blend_{name}", documentation=doc, labelnames=labelnames)
            for name, doc in (
                ("cached_tokens", "Prompt tokens whose KV was read from the chunk store."),
                ("recomputed_tokens", "Of those, tokens recomputed by the blend pass."),
                ("chunks_hit", "Chunks found in the store and loaded."),
                ("chunks_missed", "Chunks not in the store (computed, then saved)."),
                ("chunks_computed", "Stored chunks the loading controller computed instead of loading."),
            )
        }
        self._store = {
            count: self._counter_cls(
                name=f"vllm:blend_store_{name}", documentation=doc, labelnames=[*labelnames, "tier"]
            )
            for count, name, doc in (
                ("hits", "hits", "Chunk entries read from the store, by tier (tensor-parallel rank 0's reads)."),
                ("bytes", "read_bytes", "Bytes of the entries read from the store, by tier."),
                ("seconds", "read_seconds", "Seconds spent reading entries from the store, by tier."),
            )
        }
        self._guard = self._counter_cls(
            name="vllm:blend_guard_raised",
            documentation="Requests whose ratio the calibration's guard raised.",
            labelnames=labelnames,
        )
        self._ratio = self._histogram_cls(
            name="vllm:blend_recompute_ratio",
            documentation="The recompute ratio of each blended request.",
            labelnames=labelnames,
            buckets=list(RATIO_BUCKETS),
        )

        # Every series exists from the start, at 0: a rate or an alert over one never incremented still works.
        for labels in per_engine_labelvalues.values():
            for outcome, reason in (("blend", ""), ("reuse", ""), *(("full", r) for r in REASONS)):
                self._requests.labels(*labels, outcome, reason)
            for metric in (*self._counts.values(), self._guard, self._ratio):
                metric.labels(*labels)
            for metric in self._store.values():
                for tier in TIERS:
                    metric.labels(*labels, tier)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self._labelvalues[engine_idx]
        counters = BlendCounters.of(transfer_stats_data)
        for key, n in counters.requests.items():
            outcome, _, reason = key.partition("/")  # BlendCounters.add keeps reasons to REASONS
            self._requests.labels(*labels, outcome, reason).inc(n)
        for name, metric in self._counts.items():
            if counters.counts.get(name):
                metric.labels(*labels).inc(counters.counts[name])
        for key, amount in counters.tiers.items():
            tier, _, count = key.partition("/")
            if count in self._store:
                self._store[count].labels(*labels, tier).inc(amount)
        if counters.guard_raised:
            self._guard.labels(*labels).inc(counters.guard_raised)
        histogram = self._ratio.labels(*labels)
        for ratio in counters.ratios:
            histogram.observe(ratio)
