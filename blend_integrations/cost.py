"""The cost model of a prefill: one for the loading controller, calibration and the benchmarks.

A prefill's work is counted in token-layers (one token through one layer), exactly as the walk
counts it (``WalkStats.token_layers``): every token in the layers before the first check layer,
then the fresh tokens plus each check layer's share of the reused ones. A selection by the query
first runs a reuse pass (the fresh tokens through every layer), which leaves the final KV of the
tokens before the first reused one, so its blend walk skips them. Its time is a cost per
token-layer plus a fixed cost per pass (on a CPU mostly reading every layer's weights once; the
token-layers do not count it), and for that reuse pass the scoring of the query's attention at
every layer, all measured where the model is used (``Speed``, ``WalkSpeed``).
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


def scoring_passes(walk_passes: int) -> int:
    """Of a walk's passes, those that score the query's attention: a second pass is only ever a
    query selection's reuse pass, which does."""
    return walk_passes - 1


@dataclass(frozen=True)
class Speed:
    """What a walk's time is made of: ``token_layer_s`` per token-layer, ``pass_s`` per pass (its
    fixed cost), and ``scoring_s`` more for a pass that scores the query's attention at every layer
    (a query selection's reuse pass). Its units cancel in a ratio: ``Speed(1.0)`` counts
    token-layers alone."""

    token_layer_s: float
    pass_s: float = 0.0
    scoring_s: float = 0.0

    def seconds(self, token_layers: float, passes: int) -> float:
        return self.token_layer_s * token_layers + self.pass_s * passes + self.scoring_s * scoring_passes(passes)

    @property
    def throughput(self) -> float:
        """Token-layers per second."""
        return 1.0 / self.token_layer_s


TOKEN_LAYERS = Speed(1.0)  # a walk's token-layers alone, no fixed costs


def full_token_layers(shape: Shape, num_layers: int) -> float:
    """Full prefill's token-layers: every token through every layer, in one pass."""
    return float(num_layers * shape.tokens)


def policy_cost(
    shapes: Sequence[Shape],
    num_layers: int,
    check_layers: Sequence[int],
    ratios: Sequence[float],
    query_pass: bool,
    speed: Speed = TOKEN_LAYERS,
) -> float:
    """What a blend policy costs against full prefill on ``shapes``, each at its own ratio
    (``ratios``; 1.0 runs full prefill itself): its walks' time at ``speed`` (token-layers, passes
    and scoring) over full prefill's."""
    spent = whole = 0.0
    for shape, ratio in zip(shapes, ratios, strict=True):
        full = speed.seconds(full_token_layers(shape, num_layers), 1)
        whole += full
        if ratio >= 1.0:
            spent += full
        else:
            schedule = check_schedule(tuple(check_layers), ratio)
            spent += speed.seconds(token_layers(shape, num_layers, schedule, query_pass), passes(schedule, query_pass))
    return spent / whole


def _regressors(token_layers: float, passes: int) -> tuple[float, float, float]:
    """A walk's terms in ``Speed``'s order: token-layers, passes, scoring passes."""
    return float(token_layers), float(passes), float(scoring_passes(passes))


class WalkSpeed:
    """The walk's speed on one engine, measured on its real walks: ``Speed`` fitted to
    ``seconds = token_layer_s * token_layers + pass_s * passes + scoring_s * scoring passes`` by
    least squares over exponentially weighted sums (recent walks weigh more). A fixed cost is
    fitted only once walks that differ in it separate it (different sizes; query selections beside
    others); until then it is 0 and the others carry its seconds. No cost is ever negative."""

    def __init__(self, *, weight: float = 0.25) -> None:
        self.weight = weight
        self.samples = 0
        self._xx = [[0.0] * 3 for _ in range(3)]  # means of each pair of terms' products
        self._xy = [0.0] * 3  # means of each term times the seconds
        self._lock = threading.Lock()

    def add(self, token_layers: float, passes: int, seconds: float) -> None:
        if token_layers <= 0 or passes <= 0 or seconds <= 0:
            return  # nothing measured
        x = _regressors(token_layers, passes)
        with self._lock:
            w = 1.0 if self.samples == 0 else self.weight
            for i in range(3):
                self._xy[i] += w * (x[i] * seconds - self._xy[i])
                for j in range(3):
                    self._xx[i][j] += w * (x[i] * x[j] - self._xx[i][j])
            self.samples += 1

    def fitted(self) -> Speed | None:
        """None before any walk."""
        with self._lock:
            return _solve(self._xx, self._xy) if self.samples else None

    def __repr__(self) -> str:
        fit = self.fitted()
        if fit is None:
            return "WalkSpeed(unknown)"
        return (
            f"WalkSpeed({fit.throughput:.4g} token-layers/s, pass {1000 * fit.pass_s:.3g} ms, "
            f"scoring {1000 * fit.scoring_s:.3g} ms, samples={self.samples})"
        )


def fit_speed(runs: Sequence[tuple[float, int, float]]) -> Speed | None:
    """``Speed`` fitted to ``runs`` of (token-layers, passes, seconds), each weighing the same, as
    ``WalkSpeed`` fits; None without a run."""
    kept = [(_regressors(x, k), y) for x, k, y in runs if x > 0 and k > 0 and y > 0]
    if not kept:
        return None
    xx = [[statistics.fmean(r[i] * r[j] for r, _ in kept) for j in range(3)] for i in range(3)]
    xy = [statistics.fmean(r[i] * y for r, y in kept) for i in range(3)]
    return _solve(xx, xy)


# Which terms a fit tries, in turn: all three, then without the scoring pass's, then token-layers alone.
_MODELS = ((0, 1, 2), (0, 1), (0,))


def _solve(xx: list[list[float]], xy: list[float]) -> Speed:
    """Least squares of the seconds on the terms, from the means of their products: the first of
    ``_MODELS`` whose terms the walks separate (the normalised determinant is not near 0) and whose
    costs come out positive; token-layers alone, through the origin, otherwise."""
    for terms in _MODELS[:-1]:
        a = [[xx[i][j] for j in terms] for i in terms]
        scale = [a[i][i] ** 0.5 for i in range(len(terms))]
        if min(scale) == 0.0:
            continue  # a term no walk had (no query selection: no scoring pass)
        if _det([[a[i][j] / (scale[i] * scale[j]) for j in range(len(a))] for i in range(len(a))]) <= 0.01:
            continue  # walks too alike to tell these costs apart
        coefficients = _linear_solve(a, [xy[i] for i in terms])
        if coefficients[0] > 0 and min(coefficients) >= 0:
            costs = dict(zip(terms, coefficients, strict=True))
            return Speed(costs[0], costs.get(1, 0.0), costs.get(2, 0.0))
    return Speed(xy[0] / xx[0][0])  # one rate for everything: least squares through the origin


def _det(a: list[list[float]]) -> float:
    if len(a) == 1:
        return a[0][0]
    return sum((-1) ** j * a[0][j] * _det([row[:j] + row[j + 1 :] for row in a[1:]]) for j in range(len(a)))


def _linear_solve(a: list[list[float]], b: list[float]) -> list[float]:
    """``a x = b`` for a small, well-conditioned ``a`` (Cramer's rule)."""
    det = _det(a)
    return [_det([row[:j] + [b[i]] + row[j + 1 :] for i, row in enumerate(a)]) / det for j in range(len(a))]
