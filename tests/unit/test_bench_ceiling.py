"""The benchmarks' compute ceiling: full prefill's token-layers over a mode's, by the package's
one cost model (whose count is the walk's own: tests/unit/test_walk.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks import compute_ceiling

N, L, C = 1000, 16, 1


def usage(cached: int, recomputed: int) -> SimpleNamespace:
    return SimpleNamespace(prompt_tokens=N, cached_tokens=cached, recomputed_tokens=recomputed)


def test_full_prefill_is_its_own_ceiling():
    assert compute_ceiling("full", usage(900, 0), L, C) == 1.0
    # every reused token recomputed: the walk computes what full prefill does
    assert compute_ceiling("blend", usage(900, 900), L, C) == pytest.approx(1.0)


def test_blend_reuse_and_the_query_pass():
    # 900 reused tokens, 135 recomputed past layer C: the 100 fresh ones and 135 through L - C layers
    deviation = compute_ceiling("blend", usage(900, 135), L, C)
    assert deviation == pytest.approx(L * N / (C * N + (L - C) * 235))
    assert compute_ceiling("reuse", usage(900, 0), L, C) == pytest.approx(N / 100)
    # a selection by the query runs a reuse pass first: the fresh tokens through every layer
    query = compute_ceiling("blend", usage(900, 135), L, C, "query")
    assert 1 / query == pytest.approx(1 / deviation + L * 100 / (L * N))
    assert compute_ceiling("blend", usage(900, 135), L, C, "mixed") == query
