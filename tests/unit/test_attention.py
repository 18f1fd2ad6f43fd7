"""The walk's dense attention in blocks (fusion/attention.py): a GPU's
blocks keep their scores within the budget, and attending in blocks gives
the output of one call, with and without a sliding window or a soft-cap,
up to float rounding."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from blend_integrations.fusion import attention
from blend_integrations.fusion.attention import DenseAttention, block_pairs, query_groups, visible_keys

GPU = torch.device("meta")  # query_groups only asks whether the device is a CPU
HEADS, KV_HEADS, D, T = 4, 2, 16, 600
# A blend's active set: the first 8 tokens, every 7th after them, the last 12
POSITIONS = torch.cat([torch.arange(8), torch.arange(8, T - 12, 7), torch.arange(T - 12, T)])


def test_a_gpus_blocks_keep_their_scores_within_the_budget(monkeypatch):
    monkeypatch.setattr(attention, "SCORE_BUDGET", HEADS * attention.SCORE_BYTES * 4000)  # 4,000 pairs a block
    assert block_pairs(HEADS) == 4000
    blocks = query_groups(POSITIONS, GPU, HEADS)
    pos = POSITIONS.tolist()
    # consecutive, covering every query, each reading keys up to its last query within 4,000 pairs
    assert blocks[0][0] == 0 and blocks[-1][1] == len(pos)
    assert all(a[1] == b[0] for a, b in pairwise(blocks))
    assert all((hi - lo) * (pos[hi - 1] + 1) <= 4000 for lo, hi in blocks)
    # and as large as that allows: one more query would go over
    assert all((hi + 1 - lo) * (pos[hi] + 1) > 4000 for lo, hi in blocks[:-1])
    assert blocks[0][1] - blocks[0][0] > blocks[-1][1] - blocks[-1][0]  # early queries read fewer keys
    # a query whose keys alone exceed the budget is a block of its own
    monkeypatch.setattr(attention, "SCORE_BUDGET", HEADS * attention.SCORE_BYTES * 100)
    assert query_groups(torch.tensor([200, 300, 301]), GPU, HEADS) == [(0, 1), (1, 2), (2, 3)]


def dense_reference(q, K, V, window, softcap):
    """One einsum over every query and key, the mask applied to all of them."""
    scores = torch.einsum("hqd,hkd->hqk", q, K.repeat_interleave(HEADS // KV_HEADS, dim=0)) * D**-0.5
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    weights = scores.masked_fill(~visible_keys(POSITIONS, T, window), float("-inf")).softmax(-1)
    return weights @ V.repeat_interleave(HEADS // KV_HEADS, dim=0)


@pytest.mark.parametrize("window, softcap", [(None, None), (64, None), (None, 5.0), (64, 5.0)])
def test_attending_in_blocks_gives_the_output_of_one_call(monkeypatch, window, softcap):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(HEADS, len(POSITIONS), D, generator=gen)
    K, V = torch.randn(KV_HEADS, T, D, generator=gen), torch.randn(KV_HEADS, T, D, generator=gen)

    def attend(budget_pairs):
        # every query_groups call (the SDPA plan's, and the soft-capped path's) groups as a GPU does
        monkeypatch.setattr(attention, "SCORE_BUDGET", HEADS * attention.SCORE_BYTES * budget_pairs)
        dense = DenseAttention(
            POSITIONS, 0, T, windows=[window], scaling=D**-0.5, dtype=torch.float32, softcaps=[softcap]
        )
        return dense(0, q, K, V)

    real_groups = attention.query_groups
    monkeypatch.setattr(attention, "query_groups", lambda q_pos, device, heads: real_groups(q_pos, GPU, heads))
    one_call = attend(len(POSITIONS) * T)
    assert len(real_groups(POSITIONS, GPU, HEADS)) == 1
    blocked = attend(2000)
    assert len(real_groups(POSITIONS, GPU, HEADS)) > 10
    # the same math, up to float rounding (a block reads fewer keys: its kernel sums in another order; 2e-7 seen)
    torch.testing.assert_close(blocked, one_call, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(one_call, dense_reference(q, K, V, window, softcap), atol=1e-5, rtol=1e-5)
