"""The cost model of a prefill: one for the loading controller, calibration and the benchmarks.

A prefill's work is counted in token-layers (one token through one layer), exactly as the walk
counts it (``WalkStats.token_layers``): every token in the layers before the first check layer,
then the fresh tokens plus each check layer's share of the reused ones. A selection by the query
first runs a reuse pass (the fresh tokens through every layer), which leaves the final KV of the
tokens before the first reused one, so its blend walk skips them. Its time is a cost per
token-layer plus a fixed cost per pass (on a CPU mostly reading every layer's weights once; the
token-layers do not count it), both measured where the model is used (``WalkSpeed``).
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from .config import check_schedule

Schedule = list[tuple[int, float]]  # (check layer, share of the reused tokens kept), as config.check_schedule


@dataclass(frozen=True)
class Shape:
    """A prompt as the walk sees it: ``tokens`` in all, ``reused`` of them with stored KV, and the
    ``prefix`` tokens before the first reused one (the system prompt, a chunk's sink tokens)."""

    tokens: int
    reused: int = 0
    prefix: int = 0

    @classmethod
    def of(cls, token_count: int, chunk_spans: Sequence[tuple[int, int]], sink_tokens: int = 0) -> Shape:
        """A prompt of ``token_count`` tokens whose chunks are ``chunk_spans``; each chunk's first
        ``sink_tokens`` are computed fresh."""
        reused = sum(max(0, b - a - sink_tokens) for a, b in chunk_spans)
        prefix = chunk_spans[0][0] + sink_tokens if chunk_spans else token_count
        return cls(token_count, reused, min(prefix, token_count))


def token_layers(shape: Shape, num_layers: int, schedule: Schedule | None, query_pass: bool = False) -> float:
    """The token-layers a walk computes for ``shape``: a blend by ``schedule`` (None: reuse, the
    fresh tokens only). ``query_pass``: a selection by the query, which runs a reuse pass first."""
    fresh = shape.tokens - shape.reused
    if schedule is None:
        return float(num_layers * fresh)
    skipped = shape.prefix if query_pass else 0
    bounds = [layer for layer, _ in schedule] + [num_layers]
    total = float(bounds[0] * (shape.tokens - skipped)) + (num_layers * fresh if query_pass else 0)
    for (layer, share), end in zip(schedule, bounds[1:]):
        total += (end - layer) * (fresh - skipped + share * shape.reused)
    return total


def passes(schedule: Schedule | None, query_pass: bool = False) -> int:
    """Walk passes: one, and a query selection's reuse pass before it."""
    return 2 if schedule is not None and query_pass else 1


def full_token_layers(shape: Shape, num_layers: int) -> float:
    """Full prefill's token-layers: every token through every layer, in one pass."""
    return float(num_layers * shape.tokens)


def policy_cost(
    shapes: Sequence[Shape],
    num_layers: int,
    check_layers: Sequence[int],
    ratios: Sequence[float],
    query_pass: bool,
    pass_token_layers: float = 0.0,
) -> float:
    """What a blend policy costs against full prefill on ``shapes``, each at its own ratio
    (``ratios``; 1.0 runs full prefill itself): the token-layers it computes plus
    ``pass_token_layers`` per pass (a pass's fixed cost in token-layers), over full prefill's."""
    spent = whole = 0.0
    for shape, ratio in zip(shapes, ratios, strict=True):
        full = full_token_layers(shape, num_layers) + pass_token_layers
        whole += full
        if ratio >= 1.0:
            spent += full
        else:
            schedule = check_schedule(tuple(check_layers), ratio)
            walk = token_layers(shape, num_layers, schedule, query_pass)
            spent += walk + passes(schedule, query_pass) * pass_token_layers
    return spent / whole


class WalkSpeed:
    """The walk's speed on one engine, measured on its real walks: seconds per token-layer and a
    pass's fixed cost, fitted to ``seconds = pass_s * passes + token_layer_s * token_layers`` by
    least squares over exponentially weighted sums (recent walks weigh more). Until walks of
    different sizes separate the two, the fixed cost is 0 and every second is the token-layers'
    (the mean rate); neither is ever negative."""

    def __init__(self, *, weight: float = 0.25) -> None:
        self.weight = weight
        self.samples = 0
        self._sums = [0.0] * 5  # means of k*k, k*x, x*x, k*y, x*y (k passes, x token-layers, y seconds)
        self._lock = threading.Lock()

    def add(self, token_layers: float, passes: int, seconds: float) -> None:
        if token_layers <= 0 or passes <= 0 or seconds <= 0:
            return  # nothing measured
        k, x, y = float(passes), float(token_layers), seconds
        with self._lock:
            w = 1.0 if self.samples == 0 else self.weight
            for i, v in enumerate((k * k, k * x, x * x, k * y, x * y)):
                self._sums[i] += w * (v - self._sums[i])
            self.samples += 1

    def fitted(self) -> tuple[float, float] | None:
        """(token_layer_s, pass_s), or None before any walk."""
        with self._lock:
            return _solve(*self._sums) if self.samples else None

    @property
    def throughput(self) -> float | None:
        """Token-layers per second, beside ``pass_s``; None before any walk."""
        fit = self.fitted()
        return None if fit is None else 1.0 / fit[0]

    @property
    def pass_s(self) -> float:
        fit = self.fitted()
        return 0.0 if fit is None else fit[1]

    def __repr__(self) -> str:
        fit = self.fitted()
        if fit is None:
            return "WalkSpeed(unknown)"
        return f"WalkSpeed({1 / fit[0]:.4g} token-layers/s, pass {1000 * fit[1]:.3g} ms, samples={self.samples})"


def fit_speed(runs: Sequence[tuple[float, int, float]]) -> tuple[float, float] | None:
    """(token_layer_s, pass_s) fitted to ``runs`` of (token-layers, passes, seconds), each weighing
    the same, as ``WalkSpeed`` fits; None without a run."""
    kept = [(float(k), float(x), y) for x, k, y in runs if x > 0 and k > 0 and y > 0]
    if not kept:
        return None
    terms = zip(*((k * k, k * x, x * x, k * y, x * y) for k, x, y in kept))
    return _solve(*(statistics.fmean(t) for t in terms))


def _solve(kk: float, kx: float, xx: float, ky: float, xy: float) -> tuple[float, float]:
    """Least squares of ``y = pass_s * k + token_layer_s * x`` from the means of the products."""
    det = kk * xx - kx * kx
    if det > 0.01 * kk * xx:  # runs of different enough sizes: both costs are seen
        pass_s, token_layer_s = (ky * xx - kx * xy) / det, (kk * xy - kx * ky) / det
        if pass_s >= 0 and token_layer_s > 0:
            return token_layer_s, pass_s
    return xy / xx, 0.0  # one rate for everything: least squares through the origin
