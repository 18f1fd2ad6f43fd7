"""The cost model (``blend_integrations.cost``): token-layers as the walk counts them (the walk's
own count is checked against it in tests/unit/test_walk.py), passes, and the measured speed."""

from __future__ import annotations

from dataclasses import astuple

import pytest

from blend_integrations import BlendConfig
from blend_integrations.cost import (
    Shape,
    Speed,
    WalkSpeed,
    fit_speed,
    passes,
    policy_cost,
    scoring_passes,
    token_layers,
)


def schedule_of(check_layers, ratio):
    return BlendConfig(check_layers=check_layers).check_schedule(ratio)


def test_token_layers():
    # 4 layers, check layer 1, 100 tokens of which 80 reused, ratio 0.25:
    # layer 0 computes 100, layers 1-3 compute 20 fresh + 20 recomputed.
    shape = Shape(100, 80)
    assert token_layers(shape, 4, [(1, 0.25)]) == 100 + 3 * 40
    assert token_layers(shape, 4, [(1, 1.0)]) == 400  # ratio 1 is full prefill
    assert token_layers(shape, 4, None) == 4 * 20  # reuse: fresh tokens only
    # a query-aware blend pays a reuse pass first: the walk measures it the same way
    assert token_layers(shape, 4, [(1, 0.25)], query_pass=True) == 100 + 3 * 40 + 4 * 20
    # its blend walk skips the 5 tokens before the first reused one; a blend by deviation does not
    assert token_layers(Shape(100, 80, 5), 4, [(1, 0.25)], query_pass=True) == 95 + 3 * 35 + 4 * 20
    assert token_layers(Shape(100, 80, 5), 4, [(1, 0.25)]) == 100 + 3 * 40
    # gradual filtering: (1, 0.625), (2, 0.25)
    assert token_layers(shape, 4, schedule_of((1, 2), 0.25)) == 100 + (20 + 50) + 2 * (20 + 20)


def test_passes_and_shapes():
    assert passes(None) == passes([(1, 0.15)]) == passes(None, query_pass=True) == 1  # reuse has no reuse pass
    assert passes([(0, 0.15)], query_pass=True) == 2
    assert scoring_passes(1) == 0 and scoring_passes(passes([(0, 0.15)], query_pass=True)) == 1
    # chunks at 10-50 and 50-90 of 100 tokens; two sink tokens each are computed fresh
    assert Shape.of(100, [(10, 50), (50, 90)]) == Shape(100, 80, 10)
    assert Shape.of(100, [(10, 50), (50, 90)], sink_tokens=2) == Shape(100, 76, 12)
    assert Shape.of(30, []) == Shape(30, 0, 30)


def test_a_policy_costs_its_token_layers_and_passes_over_full_prefills():
    shapes = [Shape(100, 80, 10), Shape(200, 160, 10)]
    walk = lambda s: token_layers(s, 4, [(1, 0.15)])  # noqa: E731
    assert policy_cost(shapes, 4, [1], [0.15, 0.15], False) == pytest.approx((walk(shapes[0]) + walk(shapes[1])) / 1200)
    assert policy_cost(shapes, 4, [1], [1.0, 1.0], True) == 1.0  # full prefill on every probe
    # with a pass's fixed cost of 40 token-layers, the query's two passes pay it twice, and its
    # scoring (25 more) once; full prefill pays one pass
    query = token_layers(shapes[0], 4, [(0, 0.15)], query_pass=True)
    speed = Speed(1.0, 40.0, 25.0)
    assert policy_cost(shapes[:1], 4, [0], [0.15], True, speed) == pytest.approx((query + 80 + 25) / 440)
    assert policy_cost(shapes[:1], 4, [1], [0.15], False, speed) == pytest.approx((walk(shapes[0]) + 40) / 440)


def test_walk_speed_fits_a_token_layers_cost_and_a_pass_cost():
    speed = WalkSpeed()
    assert speed.fitted() is None
    for token_layers_, k in [(1000, 1), (4000, 1), (2500, 1), (800, 1)]:
        speed.add(token_layers_, k, 2e-4 * token_layers_ + 0.03 * k)
    fit = speed.fitted()
    assert fit.throughput == pytest.approx(5000) and fit.pass_s == pytest.approx(0.03)
    assert fit.scoring_s == 0.0  # no query selection walked: nothing scored
    assert astuple(fit_speed([(1000, 1, 0.23), (4000, 1, 0.83), (2500, 1, 0.53)])) == pytest.approx((2e-4, 0.03, 0.0))
    assert fit_speed([]) is None


def test_walk_speed_fits_the_query_scoring_apart_from_a_pass():
    """A query selection's walk (two passes, the first scoring) beside deviation ones of other sizes:
    its scoring comes out as its own cost, and every walk's time is predicted."""
    truth = Speed(2e-4, 0.03, 0.05)
    walks = [(1000, 1), (4000, 1), (2500, 2), (800, 1), (3000, 2), (1500, 2)]
    speed = WalkSpeed()
    for x, k in walks:
        speed.add(x, k, truth.seconds(x, k))
    fit = speed.fitted()
    assert astuple(fit) == pytest.approx((2e-4, 0.03, 0.05))
    assert astuple(fit_speed([(x, k, truth.seconds(x, k)) for x, k in walks])) == pytest.approx(astuple(truth))
    # query selections alone cannot tell a pass from its scoring: the pass carries both, and their
    # walks are still predicted
    alone = fit_speed([(x, 2, truth.seconds(x, 2)) for x in (1000, 3000, 5000)])
    assert alone.scoring_s == 0.0 and alone.seconds(2000, 2) == pytest.approx(truth.seconds(2000, 2))


def test_walk_speed_without_different_sizes_is_one_rate_and_never_negative():
    same = WalkSpeed()
    for _ in range(3):
        same.add(1000, 1, 0.5)
    assert astuple(same.fitted()) == pytest.approx((5e-4, 0.0, 0.0))
    # a larger walk measured faster than a smaller one: no negative cost, one rate through the origin
    odd = fit_speed([(1000, 1, 0.5), (4000, 1, 0.4)])
    assert odd is not None and odd.pass_s == 0.0 and odd.token_layer_s > 0
    # a query selection measured faster than a pass would make the scoring negative: it is left out
    quick = fit_speed([(1000, 1, 0.23), (4000, 1, 0.83), (2500, 2, 0.5)])
    assert quick is not None and quick.scoring_s == 0.0 and quick.pass_s >= 0.0
    nothing = WalkSpeed()
    nothing.add(0, 1, 0.5)
    nothing.add(100, 1, -1.0)
    assert nothing.samples == 0
