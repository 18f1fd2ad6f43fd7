"""Engines layer: what the blend connector's two sides tell each other each
step: the scheduler side's jobs for the worker (``BlendConnectorMetadata``),
and the worker's measured rates, failed passes and what each pass did
(``BlendWorkerMetadata``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from ..fusion import PrefillPlan
from .vllm_answers import PassReport


@dataclass
class BlendJob:
    req_id: str
    token_ids: list[int]  # the tokens the blend pass computes
    plan: PrefillPlan | None  # promised: the scheduler reported its usage
    block_ids: list[int]
    error: str | None = None  # the scheduler could not plan it: the worker fails it without a blend pass
    details: bool = False  # the request asked which tokens were reused and recomputed


@dataclass
class BlendConnectorMetadata(KVConnectorMetadata):
    jobs: list[BlendJob] = field(default_factory=list)


@dataclass
class BlendWorkerMetadata(KVConnectorWorkerMetadata):
    """What the worker tells the scheduler: the rates it measured, for the
    loading controller (read bandwidth per store tier in bytes/s, and
    "compute", the walk's token-layers per second; None until measured), the
    requests whose blend pass failed this step, with the cause, and what the
    passes that ran did (the same on every tensor-parallel rank). ``reasons``:
    a failed pass's ``blend_metrics.REASONS`` name, where it is not
    "blend_pass_failed" ("blend_memory": ``vllm_memory``)."""

    rates: dict[str, float | None]
    failed: dict[str, str] = field(default_factory=dict)
    reports: dict[str, PassReport] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        # The workers of one engine blend in lockstep: the slowest sets the pace.
        if not isinstance(other, BlendWorkerMetadata):
            other = BlendWorkerMetadata({})
        return BlendWorkerMetadata(
            {k: _slowest(v, other.rates.get(k)) for k, v in self.rates.items()},
            {**other.failed, **self.failed},
            {**other.reports, **self.reports},
            {**other.reasons, **self.reasons},
        )


def _slowest(mine: float | None, theirs: float | None) -> float | None:
    return None if mine is None or theirs is None else min(mine, theirs)
