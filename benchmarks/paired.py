"""Paired times: each request asked in two arms (checks on and off), the median of its ratio
between them, and that median's distribution-free confidence interval (the live-check pages)."""

from __future__ import annotations

import math
import statistics

CONFIDENCE = 0.9  # of the paired ratios' median's interval


def median_interval(xs: list[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """A distribution-free confidence interval for the median of ``xs``: the order statistics
    ``k`` in from each end, ``k`` the largest with P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2.
    None where ``xs`` are too few for any (5 at 90%)."""
    xs, n = sorted(xs), len(xs)
    tail, k = 0.0, 0
    while k < n and tail + math.comb(n, k) / 2**n <= (1 - confidence) / 2:
        tail += math.comb(n, k) / 2**n
        k += 1
    return (xs[k - 1], xs[n - k]) if k else None


def paired(on: dict[int, float], off: dict[int, float]) -> dict:
    """Each request asked of both arms: the median of its TTFT with checks on over off, and the interval."""
    ratios = [on[i] / off[i] for i in sorted(on.keys() & off.keys()) if off[i] > 0]
    if not ratios:
        return {"n": 0}
    interval = median_interval(ratios)
    return {
        "n": len(ratios),
        "median": round(statistics.median(ratios), 4),
        "interval": [round(x, 4) for x in interval] if interval else None,
        "confidence": CONFIDENCE,
    }


def paired_text(p: dict | None) -> str:
    """The paired ratios' median and interval, as a page's verdict line gives them (old pages: none)."""
    if not p or not p["n"]:
        return ""
    interval = (
        f" ({p['confidence']:.0%} interval {p['interval'][0]:.3f}-{p['interval'][1]:.3f})" if p["interval"] else ""
    )
    return f"paired by request {p['median']:.3f}x at the median{interval} over {p['n']} requests; "
