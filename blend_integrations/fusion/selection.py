"""Walk layer: how a check layer chooses the reused tokens to recompute.

Scores per reused token (deviation of fresh from reused K or V, or the
query's attention from a reuse pass), the choice of the top ones, and the
share of the scores a choice covers (which the calibration's guard reads).
The walk (``walk.py``) calls these at its check layers.
"""

from __future__ import annotations

import torch

from .attention import attention_weights
from .layers import LayerModel


def over_ranks(model: LayerModel, scores: torch.Tensor) -> torch.Tensor:
    """Per-token scores summed over a tensor-parallel group's heads: each rank
    scores its own heads, and every rank must choose the same tokens."""
    return scores if model.tp is None else model.tp.sum(scores)


def deviation_score(model: LayerModel, deviation: str, keys, values, start, act, rows) -> torch.Tensor:
    """Per reused row, how far its fresh K ("k") or V ("v", ``deviation``) is
    from its reused one, summed over a tensor-parallel group's heads."""
    fresh, stored = keys if deviation == "k" else values
    return over_ranks(model, _deviation(fresh, stored, start, act, rows.to(act.device)))


def _deviation(fresh, stored, start, act, rows):
    """Per reused row (``rows``, indices into the active tokens): squared L2
    distance over heads and dims between its fresh and its reused K or V."""
    old = stored[:, start + act[rows]]
    return (fresh[:, rows].float() - old.float()).pow(2).sum(dim=(0, 2))


# How many query tokens "query-tail" scores by: the question's own last ones
# (``TokenizedPrompt.question_end``: before a chat template's end of turn and
# assistant header; without one, before the prompt's last token). On
# Qwen2.5-Coder-1.5B, value-weighted over the last 4 before the prompt's last
# token (the template's, then) it kept more answers at 0.10 and 0.15 than the
# whole query's attention (docs/tuning.md, "selection").
QUERY_TAIL = 4


def query_attention(q, K, q_pos, window, scale, softcap=None, values=None):
    """Attention the queries ``q`` ``[H, Q, D]`` (at sorted positions
    ``q_pos``) pay to each key of ``K`` ``[Hkv, N, D]``: softmax over every key
    each query sees (causal, within its sliding window; scores soft-capped as
    the layer caps them), summed over heads and queries; ``[N]``. With
    ``values`` (``V`` ``[Hkv, N, D]``), each head's weight on a key is scaled
    by the norm of that key's value: what the key adds to the head's output."""
    mass = torch.zeros(K.shape[1], device=q.device)
    for keys, weights in attention_weights(q, K, q_pos, window, scale, softcap):
        if values is None:
            mass[keys] += weights.sum(dim=(0, 1, 2))
        else:
            norms = values[:, keys].float().norm(dim=-1)  # [Hkv, keys]
            mass[keys] += (weights.sum(dim=(1, 2)) * norms).sum(dim=0)
    return mass


def choose(scores: dict[str, torch.Tensor], selection: str, count: int) -> torch.Tensor:
    """Indices of the ``count`` reused rows to keep: the top by deviation, by
    query attention ("query", "query-tail": the walk scored them so), or
    (mixed) half by query attention and the rest by deviation. Without query
    scores (no query tokens) it ranks by deviation."""
    deviation = scores["deviation"]
    count = min(count, deviation.numel())
    if selection == "deviation" or "query" not in scores:
        return deviation.topk(count).indices
    query = scores["query"]
    if selection in ("query", "query-tail"):
        return query.topk(count).indices
    first = query.topk((count + 1) // 2).indices
    rest = deviation.clone()
    rest[first] = -1.0  # deviations are >= 0: the chosen rows come last
    return torch.cat([first, rest.topk(count - first.numel()).indices])
