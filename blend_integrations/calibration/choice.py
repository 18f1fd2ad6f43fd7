"""Calibration, measurement: the policies calibration measures, what each costs, and the
choice among the measured ones (``choose``)."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import NormalDist

from ..config import BlendConfig, check_schedule
from ..cost import TOKEN_LAYERS, Shape, Speed, fit_speed, full_token_layers, passes, policy_cost, token_layers
from ..prompt import TokenizedPrompt
from .records import CalibrationRecord, Guard, max_misses, wilson_lower


@dataclass(frozen=True)
class Policy:
    """A candidate: one ratio for every request (``kind="ratio"``), or the
    guard from base ``ratio`` at ``threshold``; ``rungs``: the ratio each
    probe runs at under it (1.0: full prefill, nothing to run)."""

    kind: str
    settings: int  # index into the settings tried
    ratio: float
    threshold: float | None
    rungs: tuple[float, ...]
    cost: float


def default_variants(config: BlendConfig, num_layers: int | None) -> list[dict]:
    """The blend settings calibration tries besides the engine's own: gradual
    filtering over two check layers, the other selections (mixed: on
    Qwen2.5-Coder-0.5B it kept the most at 0.15), the other deviation, and
    sink tokens (each one change from ``config``). The query-aware
    selections are tried as ProphetKV runs them, at check layer 0: they rank
    by a reuse pass, so no layer need compute every token (on
    Qwen2.5-Coder-1.5B "query" agreed as often as at layer 1, sooner:
    docs/results/oracle-*.md); a deviation selection needs a check layer past
    0, where deviation is zero."""
    first = config.check_layers[0]
    variants: list[dict] = []
    if len(config.check_layers) == 1 and first > 0 and (num_layers is None or first + 1 < num_layers):
        variants.append({"check_layers": [first, first + 1]})
    if config.selection != "deviation":
        variants.append({"selection": "deviation", **({"check_layers": [1]} if first == 0 else {})})
    for selection in ("query", "query-tail"):
        if config.selection != selection:
            variants.append({"selection": selection, **({"check_layers": [0]} if first != 0 else {})})
    if config.selection != "mixed":  # its deviation half needs a check layer past 0
        variants.append({"selection": "mixed", **({"check_layers": [1]} if first == 0 else {})})
    variants.append({"deviation": "k" if config.deviation == "v" else "v"})
    if config.sink_tokens == 0:
        variants.append({"sink_tokens": 2})
    return variants


@dataclass(frozen=True)
class Costs:
    """What each policy costs on the probes, by the cost model of ``blend_integrations.cost``: its
    walks' time on each probe's own shape at that probe's ratio at ``speed`` (token-layers, and the
    fixed costs of a pass and of a query selection's scoring, fitted to the probes' measured times:
    ``Costs.fitted``), over full prefill's."""

    prompts: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]  # each probe's (tokens, chunk spans)
    num_layers: int
    speed: Speed = TOKEN_LAYERS

    @classmethod
    def of(cls, probes: Sequence[TokenizedPrompt], num_layers: int) -> Costs:
        prompts = tuple((len(p.token_ids), tuple(map(tuple, p.chunk_spans))) for p in probes)
        return cls(prompts, num_layers)  # type: ignore[arg-type]

    def shapes(self, settings: dict) -> list[Shape]:
        return [Shape.of(n, spans, settings["sink_tokens"]) for n, spans in self.prompts]

    def __call__(self, settings: dict, rungs: Sequence[float]) -> float:
        query_pass = settings["selection"] != "deviation"
        return policy_cost(
            self.shapes(settings), self.num_layers, settings["check_layers"], rungs, query_pass, self.speed
        )

    def fitted(self, runs: Sequence[tuple[int, dict | None, float, float]]) -> Costs:
        """These costs at the speed fitted to ``runs`` of (probe, settings, ratio, seconds): a
        measured time to first token, full prefill's with settings None."""
        measured = []
        for j, settings, ratio, seconds in runs:
            n, spans = self.prompts[j]
            if settings is None:
                measured.append((full_token_layers(Shape(n), self.num_layers), 1, seconds))
                continue
            schedule = check_schedule(tuple(settings["check_layers"]), ratio)
            query_pass = settings["selection"] != "deviation"
            shape = Shape.of(n, spans, settings["sink_tokens"])
            measured.append(
                (token_layers(shape, self.num_layers, schedule, query_pass), passes(schedule, query_pass), seconds)
            )
        speed = fit_speed(measured)
        return self if speed is None else dataclasses.replace(self, speed=speed)


def _prompts_needed(target: float, confidence: float) -> int | None:
    """The fewest prompts that, all agreeing, show ``target`` (None: no number does, as for 1.0)."""
    if target >= 1.0:
        return None
    z = NormalDist().inv_cdf(confidence)
    n = max(1, math.ceil(target * z * z / (1 - target)))  # all agreeing, the Wilson bound is n / (n + z^2)
    while wilson_lower(n, n, confidence) < target:  # float rounding at the boundary
        n += 1
    return n


# The most thresholds a guard is tried at from one base ratio: every share the probes hold there,
# or where they are more, that many spread evenly over them (with 96 probes every share gave
# 3,286 policies and a record of 1.4 MB, over the store's 1 MiB for a record).
GUARD_THRESHOLDS = 12


def guard_thresholds(shares: Sequence[float]) -> list[float]:
    """The thresholds a guard is tried at, given each probe's share at its base ratio: the shares
    above the lowest (a threshold at the lowest raises no probe), at most ``GUARD_THRESHOLDS``."""
    levels = sorted({round(s, 3) for s in shares})[1:]
    if len(levels) <= GUARD_THRESHOLDS:
        return levels
    return sorted({levels[round(k * (len(levels) - 1) / (GUARD_THRESHOLDS - 1))] for k in range(GUARD_THRESHOLDS)})


def candidates(
    shares: dict[int, list[Callable[[float], float]]], ladder: list[float], tried: list[dict], costs: Costs
) -> list[Policy]:
    """Every policy, cheapest first: each setting at each ratio, and for each
    setting in ``shares`` (its probes' ``ranking_share``, where the engine
    reports them) the guard from each base ratio at each threshold the
    probes' shares at that base suggest (``guard_thresholds``). A setting's shares come from its
    probes' cheapest runs: a share does not depend on the ratio a walk ran at."""
    n = len(costs.prompts)
    policies = [
        Policy("ratio", i, r, None, (r,) * n, costs(settings, (r,) * n))
        for i, settings in enumerate(tried)
        for r in ladder
    ]
    for i, of_probes in shares.items():
        for r0 in ladder:
            for threshold in guard_thresholds([share(r0) for share in of_probes]):
                guard = Guard(r0, threshold, tuple(ladder))
                rungs = tuple(guard.ratio(share) for share in of_probes)
                cost = costs(tried[i], rungs)
                policies.append(Policy("guard", i, r0, threshold, rungs, cost))
    return sorted(policies, key=lambda p: (p.cost, p.kind != "ratio", p.settings, p.ratio, p.threshold or 0.0))


def meets(row: dict, target: float, n: int, min_speedup: float) -> bool:
    return row["n"] == n and row["lower_bound"] >= target and row["ttft_speedup"] >= min_speedup


def choose(
    curve: list[dict],
    *,
    base,
    ladder,
    target,
    confidence,
    tokens,
    tasks: dict[str, int],
    min_speedup,
    identity: dict,
    version,
    seconds,
) -> CalibrationRecord:
    """The cheapest policy meeting the target on every task (a row's
    ``lower_bound`` is its worst task's): the single ratio (with its
    settings) for every engine, and the guard when it is cheaper still; each
    only if measured at least ``min_speedup`` times sooner than full prefill,
    else full prefill. ``tasks``: each kind of question's probe count.
    ``identity``: the record's model, fingerprint, dtype, engine and kv_codec."""
    n = sum(tasks.values())
    meeting = [c for c in curve if c["n"] == n and c["lower_bound"] >= target]
    cost = lambda c: (c["cost"], c["ratio"])  # noqa: E731
    worth = [c for c in meeting if c["ttft_speedup"] >= min_speedup]  # confirmed by measured TTFT
    uniform = min((c for c in worth if c["policy"] == "ratio"), key=cost, default=None)
    guarded = min((c for c in worth if c["policy"] == "guard"), key=cost, default=None)
    if guarded is not None and uniform is not None and cost(guarded) >= cost(uniform):
        guarded = None  # the guard only when it is cheaper than one ratio for every request
    short = [(name, k) for name, k in tasks.items() if max_misses(k, target, confidence) < 0]
    if short:
        needed = _prompts_needed(target, confidence)
        name, k = short[0]
        why = (
            f"{k} prompts{f' of {name}' if len(tasks) > 1 else ''} cannot show agreement {target} at "
            f"{confidence:.0%} confidence even if every one agrees "
            + (f"(that takes {needed} or more)" if needed else "(no number of prompts can: lower the target)")
            + ": full prefill"
        )
    elif not meeting:
        why = f"no policy below ratio 1.0 meets the target {target}: blending cannot hold it here; full prefill"
    elif uniform is None and guarded is None:
        best = min(meeting, key=cost)
        why = (
            f"the cheapest policy meeting the target (cost {best['cost']} of full prefill's) was measured only "
            f"{best['ttft_speedup']:.2f}x sooner than full prefill, under min_speedup {min_speedup}: full prefill"
        )
    else:
        chosen = guarded if guarded is not None else uniform
        assert chosen is not None  # one of the two, by the branch above
        why = (
            f"the cheapest policy meeting the target: cost {chosen['cost']} of full prefill's, mean ratio "
            f"{chosen['mean_ratio']}, {chosen['ttft_speedup']:.2f}x sooner than full prefill"
        )
    return CalibrationRecord(
        **identity,
        settings=uniform["settings"] if uniform is not None else base,
        ratio=uniform["ratio"] if uniform is not None else 1.0,
        guard=None if guarded is None else Guard(guarded["ratio"], guarded["threshold"], tuple(ladder)),
        guard_settings=None if guarded is None else guarded["settings"],
        meets_target=bool(meeting),
        target=target,
        confidence=confidence,
        tokens=tokens,
        n=n,
        tasks=dict(tasks),
        curve=curve,
        date=time.strftime("%Y-%m-%d"),
        package_version=version,
        seconds=round(seconds, 1),
        why=why,
        min_speedup=min_speedup,
    )
