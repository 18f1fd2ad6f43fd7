"""Walk layer: the walk's attention over a dense KV cache, with torch's SDPA.

Every engine's adapter can use it (``LayerModel.attention``): the
transformers engine always does, the vLLM adapter outside a connector job and
on backends whose kernel it does not drive. Active queries attend with an
exact causal mask by absolute position (key position <= query position),
in groups of sorted queries (``query_groups``); on a GPU in blocks whose
scores stay within ``SCORE_BUDGET``, so that a pass's memory does not grow
with its queries times its keys. Layers with attention-logit soft-capping
(Gemma 2) attend in plain torch, since SDPA cannot cap its scores.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


class DenseAttention:
    """The active queries at sorted absolute ``positions`` (of the new tokens
    ``start..end``) against the dense K, V the walk keeps; one plan per
    sliding window, built at first use and shared by the layers."""

    def __init__(
        self,
        positions: torch.Tensor,
        start: int,
        end: int,
        *,
        windows: Sequence[int | None],
        scaling: float,
        dtype: torch.dtype,
        softcaps: Sequence[float | None] | None = None,
    ) -> None:
        self.positions, self.start, self.end = positions, start, end
        self.windows, self.scaling, self.dtype = windows, scaling, dtype
        self.softcaps = softcaps
        self.plans: dict = {}

    def __call__(self, layer: int, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
        """q ``[H, A, D]``, K and V ``[Hkv, end, D]`` -> ``[H, A, D]``."""
        window = self.windows[layer]
        softcap = self.softcaps[layer] if self.softcaps else None
        if softcap:
            return _capped(q, K, V, self.positions, window, self.scaling, softcap)
        if window not in self.plans:
            self.plans[window] = _plan(self.positions, self.start, self.end, window, self.dtype, heads=q.shape[0])
        return _attend(q, K, V, self.plans[window], self.scaling)

    def store(self, layer: int, K: torch.Tensor, V: torch.Tensor) -> None:
        """Nothing to write: the queries read the walk's dense K, V."""


# Queries per attention call on a CPU when an explicit mask is needed. A mask
# makes the kernel compute every query-key score, so scattered recomputed
# queries would pay for keys after their own position; in groups of sorted
# queries each group only reads keys up to its last position (about half the
# work).
QUERY_GROUP = 32
# A CPU group also ends at a gap in the queries' positions where its queries so
# far would read more than this many keys past their own position: reuse's
# active set is the system prompt's tokens and, 3,000 positions later, the
# question's; in one group the first would read every key (1.6x the pairs).
# A blend's scattered queries (gaps of a few positions) are not split.
GAP_PAIRS = 4096
# On a GPU a call of 32 query rows is a kernel launch that leaves most of the
# GPU idle (a 16k-token prompt on an H200, llama3-8b's shape: 9.9 s in groups
# of 32, 0.97 s of 512, 0.59 s in one call), but one call materialises, on
# torch's math path (an explicit mask with GQA), the scores of every query and
# their softmax: about 41 GB for a 32k-token blend at 0.15 of that shape. So
# the queries attend in blocks, each as large as SCORE_BUDGET allows.
SCORE_BUDGET = 2**30
SCORE_BYTES = 8  # per head, query and key: a float32 score and its softmax (an upper bound)


def block_pairs(heads: int) -> int:
    """The query-key pairs one call on a GPU may score with ``heads`` query
    heads: as many as keep its scores within ``SCORE_BUDGET``."""
    return max(1, SCORE_BUDGET // (heads * SCORE_BYTES))


def query_groups(q_pos: torch.Tensor, device: torch.device, heads: int) -> list[tuple[int, int]]:
    """``[(lo, hi)]``: the runs of sorted query positions ``q_pos`` attended
    in one call each by ``heads`` query heads. On a GPU a block reads the keys
    up to its last query, so it takes queries while their count times those
    keys stays within ``block_pairs`` (a single query may exceed it)."""
    A = q_pos.shape[0]
    if A == 0:
        return []
    pos = q_pos.tolist()
    pairs = block_pairs(heads)
    groups, lo = [], 0
    for i in range(1, A):
        if device.type != "cpu":
            split = (i + 1 - lo) * (pos[i] + 1) > pairs
        else:
            split = i - lo == QUERY_GROUP or (i - lo) * (pos[i] - pos[i - 1]) > GAP_PAIRS
        if split:
            groups.append((lo, i))
            lo = i
    groups.append((lo, A))
    return groups


def visible_keys(q_pos: torch.Tensor, k_end: int, window: int | None, k_start: int = 0) -> torch.Tensor:
    """``[Q, k_end - k_start]``: which of the keys ``k_start..k_end`` each
    query at ``q_pos`` sees (causal by absolute position, and within its
    sliding window)."""
    k_pos = torch.arange(k_start, k_end, device=q_pos.device)
    visible = q_pos[:, None] >= k_pos[None, :]
    if window is not None:
        visible &= q_pos[:, None] - k_pos[None, :] < window
    return visible


def _first_key(pos: torch.Tensor, window: int | None) -> int:
    """The first key a group of sorted queries at ``pos`` can see: 0, or with
    a sliding window the first inside its first query's window."""
    return 0 if window is None else max(0, int(pos[0]) - window + 1)


def _plan(q_pos, start, end, window, dtype, heads):
    """How active queries at sorted positions ``q_pos`` attend to keys
    0..end-1 with ``heads`` query heads: None for ordinary causal attention
    (every new token in order, or one query at the end), else
    ``[(lo, hi, k_start, k_end, additive_mask)]`` per query group, whose keys
    ``k_start..k_end`` are all it can see (up to its last query, from its
    first query's window on). Depends only on the active set, so layers share it."""
    A = q_pos.shape[0]
    if window is None and ((start == 0 and end == A) or (A == 1 and int(q_pos[0]) == end - 1)):
        return None
    plan = []
    for lo, hi in query_groups(q_pos, q_pos.device, heads):
        pos = q_pos[lo:hi]
        k_start, k_end = _first_key(pos, window), int(pos[-1]) + 1
        visible = visible_keys(pos, k_end, window, k_start)
        mask = torch.zeros(visible.shape, dtype=dtype, device=q_pos.device).masked_fill_(~visible, float("-inf"))
        plan.append((lo, hi, k_start, k_end, mask))
    return plan


def _attend(q, K, V, plan, scale):
    """q ``[H, A, D]`` against K, V ``[Hkv, end, D]`` following ``plan``."""
    gqa = q.shape[0] != K.shape[0]
    if plan is None:
        return _sdpa(q, K, V, None, scale, gqa, causal=q.shape[1] > 1)
    outs = []
    for lo, hi, k_start, k_end, mask in plan:
        outs.append(_sdpa(q[:, lo:hi], K[:, k_start:k_end], V[:, k_start:k_end], mask, scale, gqa))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _sdpa(q, K, V, mask, scale, gqa, causal=False):
    out = F.scaled_dot_product_attention(
        q.unsqueeze(0), K.unsqueeze(0), V.unsqueeze(0), attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
    )
    return out[0]


def _capped(q, K, V, q_pos, window, scale, cap):
    """Attention with soft-capped scores, ``cap * tanh(scores / cap)`` (Gemma 2)."""
    H, A, D = q.shape
    outs = [
        torch.einsum("hgqk,hkd->hgqd", weights, V[:, keys].float()).to(q.dtype)
        for keys, weights in attention_weights(q, K, q_pos, window, scale, cap)
    ]
    return torch.cat(outs, dim=2).reshape(H, A, D)


def attention_weights(q, K, q_pos, window, scale, softcap):
    """The softmax weights of queries ``q`` ``[H, A, D]`` at sorted positions
    ``q_pos`` over ``K`` ``[Hkv, N, D]``, in float32, scores soft-capped where
    the layer caps them: per group of queries (``query_groups`` as on a CPU,
    bounded memory on any device), ``(keys, weights)`` with ``keys`` the slice
    of keys the group can see and ``weights`` ``[Hkv, H / Hkv, group, keys]``."""
    H, A, D = q.shape
    Hkv = K.shape[0]
    q = q.reshape(Hkv, H // Hkv, A, D)  # query heads of one KV head side by side, as in GQA (no copy of K)
    for lo, hi in query_groups(q_pos, torch.device("cpu"), H):
        pos = q_pos[lo:hi]
        keys = slice(_first_key(pos, window), int(pos[-1]) + 1)
        visible = visible_keys(pos, keys.stop, window, keys.start)
        scores = torch.einsum("hgqd,hkd->hgqk", q[:, :, lo:hi].float(), K[:, keys].float()) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        yield keys, scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
