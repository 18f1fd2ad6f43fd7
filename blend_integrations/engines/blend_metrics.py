"""Engines layer: counts of what blending did, for operators.

``BlendCounters`` turns each finished request's answer from the blend connector
(the ``kv_transfer_params`` it returns, see ``vllm_contract``) into counts:
requests by outcome, reused and recomputed tokens, chunks hit, missed and
computed, the ratios used, guard firings. The connector's scheduler side keeps
one and hands vLLM each step's increments (``get_kv_connector_stats``); vLLM's
API server adds them to Prometheus series on ``/metrics``
(``build_prom_metrics``). The embedded engine keeps one for ``stats()``. A
request is counted once, on the scheduler side, however many ranks compute it.
The worker side adds its chunk store's reads by tier (``store_reads``): rank
0's only, since every tensor-parallel rank reads the same entries.

Labels have few values: a request's ``outcome`` is "blend", "reuse" or "full",
and a full prefill's ``reason`` one of ``REASONS``, never a message's text.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..config import CALIBRATION_SOURCES
from ..store.defaults import TIERS
from ..store.stats import StoreStats

# Why a request was computed in full instead of blended.
REASONS = (
    "not_requested",  # no blend parameters, or mode "full"
    "calibrated",  # the model's calibration (the user's or the packaged one) chose full prefill
    "invalid_params",  # its blend parameters broke a rule (the connector's check)
    "planning_failed",  # the scheduler could not plan the blend pass
    "prompt_logprobs",  # prompt logprobs were asked for: vLLM computes every prompt token
    "blend_pass_failed",  # the worker's blend pass failed; vLLM recomputed the prompt
    "blend_memory",  # the blend pass would not fit in free memory (vllm_memory); vLLM computed the prompt
)
# Histogram buckets of the recompute ratio.
RATIO_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0)
COUNTS = ("cached_tokens", "recomputed_tokens", "chunks_hit", "chunks_missed", "chunks_computed")


def store_reads(stats: StoreStats) -> Counter:
    """A store's reads so far, per tier: ``"<tier>/hits"`` (entries read),
    ``"<tier>/bytes"`` (their bytes) and ``"<tier>/seconds"`` (time reading them)."""
    reads: Counter = Counter()
    for tier in TIERS:
        reads[f"{tier}/hits"] = getattr(stats, f"{tier}_hits")
        reads[f"{tier}/bytes"] = getattr(stats, "bytes_read" if tier == "disk" else f"{tier}_bytes_read")
        reads[f"{tier}/seconds"] = getattr(stats, f"{tier}_read_s")
    return reads


@dataclass
class BlendCounters:
    """Running counts; ``data()`` is their plain-dict form (what crosses vLLM's processes)."""

    requests: Counter = field(default_factory=Counter)  # "outcome/reason" -> requests
    counts: Counter = field(default_factory=Counter)  # COUNTS -> sum over requests
    ratios: list[float] = field(default_factory=list)  # each blended request's ratio
    guard_raised: int = 0
    tiers: Counter = field(default_factory=Counter)  # store reads, as ``store_reads`` names them

    def add(self, answer: dict[str, Any] | None) -> None:
        """One finished request: ``answer`` is what the connector returned in its
        ``kv_transfer_params`` (None: not a blend request)."""
        answer = answer or {}
        usage = answer.get("blend")
        if "blend_fallback" in answer:
            reason = answer.get("blend_fallback_reason")
            self.requests[f"full/{reason if reason in REASONS else 'blend_pass_failed'}"] += 1
            return
        if not usage:
            self.requests["full/not_requested"] += 1
            return
        ratio = usage.get("recompute_ratio")
        if usage.get("ratio_source") in CALIBRATION_SOURCES and ratio is not None and ratio >= 1.0:
            self.requests["full/calibrated"] += 1  # the calibration chose full prefill (``plan.in_full``)
            return
        self.requests["blend/" if ratio is not None else "reuse/"] += 1
        for name in COUNTS:
            if usage.get(name):  # no zero entries: a Counter's sum drops them
                self.counts[name] += int(usage[name])
        if ratio is not None:
            self.ratios.append(float(ratio))
        if usage.get("ratio_source") == "guard":
            self.guard_raised += 1

    def data(self) -> dict[str, Any]:
        return {
            "requests": dict(self.requests),
            "counts": dict(self.counts),
            "ratios": list(self.ratios),
            "guard_raised": self.guard_raised,
            "tiers": dict(self.tiers),
        }

    @classmethod
    def of(cls, data: dict[str, Any] | None) -> BlendCounters:
        data = data or {}
        return cls(
            Counter(data.get("requests") or {}),
            Counter(data.get("counts") or {}),
            list(data.get("ratios") or ()),
            int(data.get("guard_raised") or 0),
            Counter(data.get("tiers") or {}),
        )

    def merge(self, other: BlendCounters) -> BlendCounters:
        return BlendCounters(
            self.requests + other.requests,
            self.counts + other.counts,
            self.ratios + other.ratios,
            self.guard_raised + other.guard_raised,
            self.tiers + other.tiers,
        )

    def summary(self) -> dict[str, int | float]:
        """Flat totals (``stats()``, and vLLM's periodic log line)."""
        out: dict[str, int | float] = {
            f"requests_{k.rstrip('/').replace('/', '_')}": v for k, v in self.requests.items()
        }
        out.update(self.counts)
        if self.ratios:
            out["mean_recompute_ratio"] = sum(self.ratios) / len(self.ratios)
        out["guard_raised"] = self.guard_raised
        out.update({f"store_{k.replace('/', '_')}": v for k, v in self.tiers.items()})
        return out

    def __bool__(self) -> bool:
        return bool(self.requests or self.tiers)
