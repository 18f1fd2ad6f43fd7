"""Plan layer: the loading controller (CacheBlend section 5): per request, load or compute
each stored chunk, and pick the recompute ratio.

Inputs are estimates the engine keeps up to date: each chunk's load time
(its size over its tier's measured read bandwidth) and the engine's compute
throughput in token-layers per second. The walk computes every token in the
layers before the first check layer and, after each check layer, the fresh
tokens plus that layer's share of the reused ones, so its cost is linear in
the ratio, plus a fixed cost per pass (``blend_integrations.cost``).

- A chunk is computed as fresh tokens instead of loaded when that lowers the
  estimated time to first token (or when all its tokens are sink tokens): loading it costs its load time and saves
  the compute of its tokens after the check layer (but the recomputed share).
  Slowest chunks per token are considered first.
- With loads overlapping compute (pipelined loading) the estimated time is
  ``max(load, compute)``: the ratio is then raised from the floor (the
  configured ratio) until the compute equals the loads, since recomputing
  more costs nothing while the walk waits for KV anyway. Without overlap the
  time is ``load + compute`` and the ratio stays at the floor.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..cost import Shape, Speed, passes, token_layers

Schedule = Callable[[float], list[tuple[int, float]]]  # ratio -> [(check layer, share)], as BlendConfig.check_schedule


@dataclass
class LoadingStats:
    """What the controller chose for one prefill (``Generation.loading``)."""

    recompute_ratio: float  # the ratio the walk used
    ratio_floor: float  # the configured (or the call's) ratio: never less
    chunks_memory: int  # stored chunks by the tier they were found in
    chunks_disk: int
    chunks_remote: int
    chunks_computed: int  # of those, computed as fresh tokens instead of loaded
    est_load_ms: float  # estimated time to read the loaded chunks
    est_compute_ms: float | None  # estimated time of the walk at the chosen ratio; None: throughput not measured yet

    @property
    def chunks_recomputed(self) -> int:
        """Deprecated name of ``chunks_computed`` (0.x)."""
        warnings.warn(
            "LoadingStats.chunks_recomputed is deprecated: use chunks_computed", DeprecationWarning, stacklevel=2
        )
        return self.chunks_computed


@dataclass(frozen=True)
class Plan:
    ratio: float
    load: list[bool]  # per chunk: load it, or compute it as fresh tokens
    load_s: float  # estimated seconds reading the loaded chunks
    compute_s: float | None  # estimated seconds of the walk at ``ratio``


def plan(
    tokens: Sequence[int],
    load_s: Sequence[float],
    *,
    num_tokens: int,
    num_layers: int,
    schedule: Schedule,
    floor: float,
    speed: Speed | None,
    overlapped: bool,
    query_pass: bool = False,
    prefix: int = 0,
) -> Plan:
    """Decide for chunks with ``tokens[i]`` reusable tokens and estimated
    ``load_s[i]`` seconds to read, in a prompt of ``num_tokens`` new tokens,
    at the walk's measured ``speed`` (the cost model of ``blend_integrations.cost``; None: not
    measured yet, so every chunk is loaded at the floor). ``query_pass``: a selection by the query, whose
    reuse pass skips the ``prefix`` tokens before the first reused one in its blend walk."""
    load = [t > 0 for t in tokens]  # a chunk of sink tokens only has nothing to reuse
    if speed is None:
        return Plan(floor, load, sum(t for t, kept in zip(load_s, load) if kept), None)

    def compute(reused: int, ratio: float) -> float:
        walk = schedule(ratio)
        shape = Shape(num_tokens, reused, prefix)
        return speed.seconds(token_layers(shape, num_layers, walk, query_pass), passes(walk, query_pass))

    def ttft(load_time: float, compute_time: float) -> float:
        return max(load_time, compute_time) if overlapped else load_time + compute_time

    total_load = sum(t for t, kept in zip(load_s, load) if kept)
    reused = sum(tokens)
    for i in sorted((i for i in range(len(tokens)) if load[i]), key=lambda i: load_s[i] / tokens[i], reverse=True):
        without = ttft(total_load - load_s[i], compute(reused - tokens[i], floor))
        if without < ttft(total_load, compute(reused, floor)):
            load[i] = False
            total_load -= load_s[i]
            reused -= tokens[i]

    total_load = sum(t for t, kept in zip(load_s, load) if kept)  # exact, not a running difference
    ratio = floor
    if overlapped and reused:
        # compute(r) is linear in r: solve compute(r) = total_load.
        at0, at1 = compute(reused, 0.0), compute(reused, 1.0)
        if at1 > at0:
            ratio = min(1.0, max(floor, (total_load - at0) / (at1 - at0)))
    return Plan(ratio, load, total_load, compute(reused, ratio))


def decide(
    tiers: Sequence[str], tokens: Sequence[int], load_s: Sequence[float], *, floor: float, **options
) -> tuple[Plan, LoadingStats]:
    """``plan`` for stored chunks found in ``tiers`` (see ``plan`` for the rest),
    and its decisions as the ``LoadingStats`` a generation reports. Both
    engines decide through here: the transformers engine's ``Blender`` and
    the vLLM connector's scheduler side."""
    p = plan(tokens, load_s, floor=floor, **options)
    found = Counter(tiers)
    return p, LoadingStats(
        recompute_ratio=p.ratio,
        ratio_floor=floor,
        chunks_memory=found["memory"],
        chunks_disk=found["disk"],
        chunks_remote=found["remote"],
        chunks_computed=p.load.count(False),
        est_load_ms=1000 * p.load_s,
        est_compute_ms=None if p.compute_s is None else 1000 * p.compute_s,
    )
