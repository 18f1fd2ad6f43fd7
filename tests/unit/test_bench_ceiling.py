"""The benchmarks' compute ceiling: token-layers of full prefill over a mode's."""

from __future__ import annotations

import pytest

from benchmarks import compute_ceiling

N, L, C = 1000, 16, 1


def test_full_prefill_is_its_own_ceiling():
    assert compute_ceiling("full", N, 900, 0, L, C, full_layers=L) == 1.0


@pytest.mark.parametrize("full_layers", [L - 1, L])
def test_blend_counts_the_layers_each_engine_computes(full_layers):
    """The walk computes the last layer for the logits' token alone; the
    transformers engine's full prefill (the walk) does too, vLLM's does not."""
    # 900 reused tokens, 135 recomputed: |R| = 100 fresh + 135
    blend = compute_ceiling("blend", N, 900, 135, L, C, full_layers=full_layers)
    assert blend == pytest.approx(full_layers * N / (C * N + (L - 1 - C) * 235))
    # every reused token recomputed: the walk's work, full prefill's on the transformers engine
    every = compute_ceiling("blend", N, 900, 900, L, C, full_layers=full_layers)
    assert every == pytest.approx(full_layers / (L - 1))


def test_reuse_and_the_query_pass():
    assert compute_ceiling("reuse", N, 900, 0, L, C, full_layers=L - 1) == pytest.approx(N / 100)
    deviation = compute_ceiling("blend", N, 900, 135, L, C, full_layers=L - 1)
    query = compute_ceiling("blend", N, 900, 135, L, C, "query", full_layers=L - 1)
    assert 1 / query == pytest.approx(1 / deviation + (L - 1) * 100 / ((L - 1) * N))
