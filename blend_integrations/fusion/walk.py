"""The CacheBlend layer walk: one implementation for every engine.

A forward pass over new tokens at positions ``cache.length ..``. Some of them
may come with reused KV (chunks computed standalone, K before RoPE). Which
tokens are computed at each layer is the *active* set:

- full:   every token at every layer;
- reuse:  only fresh tokens (no reused KV) at every layer;
- blend:  every token up to the first check layer; at each check layer the
          reused tokens whose KV deviates most from the fresh KV stay active
          (a share ``ratio`` of the reused tokens), the rest keep their
          reused KV from there on.

Attention of active queries uses an exact causal mask by absolute position
(key position <= query position), never a bottom-right aligned one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .layers import LayerModel, rotate


@dataclass
class KVCache:
    """Per-layer K (after RoPE) and V, ``[num_kv_heads, capacity, head_dim]``."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    length: int = 0

    @classmethod
    def allocate(cls, model: LayerModel, capacity: int) -> "KVCache":
        shape = (model.num_kv_heads, capacity, model.head_dim)
        make = lambda: torch.empty(shape, dtype=model.dtype, device=model.device)  # noqa: E731
        return cls([make() for _ in range(model.num_layers)], [make() for _ in range(model.num_layers)])

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]


@dataclass(frozen=True)
class ReusedSpan:
    """Reused KV for new tokens ``[start, start + n)`` (offsets into the new
    tokens). kv: ``[num_layers, 2, num_kv_heads, n, head_dim]``, K before RoPE."""

    start: int
    kv: torch.Tensor

    @property
    def end(self) -> int:
        return self.start + self.kv.shape[3]


@dataclass(frozen=True)
class WalkStats:
    reused_tokens: int  # tokens that came with reused KV
    recomputed_tokens: int  # of those, how many were recomputed after all


def forward(
    model: LayerModel,
    cache: KVCache,
    ids: torch.Tensor,
    *,
    reused: list[ReusedSpan] = (),
    schedule: list[tuple[int, float]] | None = None,
    deviation: str = "v",
    record: torch.Tensor | None = None,
) -> tuple[torch.Tensor, WalkStats]:
    """Run the new tokens ``ids`` through every layer, appending their KV to
    ``cache``. Returns the float32 logits of the last token and stats.

    reused + schedule=None is "reuse"; reused + schedule [(layer, ratio), ...]
    is "blend"; no reused is "full". ``record``, if given
    (``[num_layers, 2, num_kv_heads, T, head_dim]``), receives K before RoPE
    and V of every token: the standalone chunk recipe. The last token is always
    computed, since its hidden state gives the logits.
    """
    T = ids.shape[0]
    start, end = cache.length, cache.length + T
    if end > cache.capacity:
        raise ValueError(f"{end} tokens do not fit the KV cache of {cache.capacity}")
    device = model.device
    positions = torch.arange(start, end, device=device)
    cos, sin = model.rope(positions)

    is_reused = torch.zeros(T, dtype=torch.bool)
    for span in reused:
        is_reused[span.start : span.end] = True
    is_reused[-1] = False
    num_reused = int(is_reused.sum())
    if num_reused == 0:
        reused, schedule = (), None
    checks = dict(schedule or ())
    # Layers before the first check layer compute every token; their reused KV is never read.
    load_from = min(checks) if checks else 0
    active = torch.arange(T) if (schedule or not num_reused) else torch.nonzero(~is_reused).flatten()
    if record is not None and active.numel() != T:
        raise ValueError("record needs every token computed (full mode)")
    recomputed = num_reused if schedule else 0

    h = model.embed(ids[active.to(ids.device)])
    for layer in range(model.num_layers):
        act = active.to(device)
        q, k, v = model.qkv(layer, h)
        if record is not None:
            record[layer, 0].copy_(k)
            record[layer, 1].copy_(v)
        q = rotate(q, cos[act], sin[act])
        k = rotate(k, cos[act], sin[act])
        K = cache.k[layer][:, :end]
        V = cache.v[layer][:, :end]
        if reused and layer >= load_from:
            for span in reused:
                a, b = start + span.start, start + span.end
                K[:, a:b] = rotate(span.kv[layer, 0].to(device, model.dtype), cos[span.start : span.end], sin[span.start : span.end])
                V[:, a:b] = span.kv[layer, 1].to(device, model.dtype)
        keep = None
        if layer in checks:
            keep = _select(k if deviation == "k" else v, K if deviation == "k" else V, start, active, is_reused, round(checks[layer] * num_reused))
            recomputed = int((keep & is_reused[active]).sum())
        K.index_copy_(1, start + act, k)
        V.index_copy_(1, start + act, v)
        if keep is not None:
            q, h, active = q[:, keep.to(device)], h[keep.to(device)], active[keep]
        attn = _attend(q, K, V, positions[active.to(device)], start, end, T, model.scaling, model.windows[layer])
        h = model.finish(layer, h, attn)
    cache.length = end
    return model.logits(h[-1:])[0], WalkStats(num_reused, recomputed)


def _select(fresh, cached, start, active, is_reused, count):
    """Keep-mask over ``active``: fresh tokens plus the ``count`` reused tokens
    whose fresh KV deviates most from the reused KV (L2 over heads and dims)."""
    reused_rows = is_reused[active]
    idx = torch.nonzero(reused_rows).flatten()
    keep = ~reused_rows
    count = min(count, idx.numel())
    if count:
        rows = idx.to(fresh.device)
        old = cached[:, start + active[idx].to(fresh.device)]
        dev = (fresh[:, rows].float() - old.float()).pow(2).sum(dim=(0, 2))
        keep[idx[dev.topk(count).indices.cpu()]] = True
    return keep


def _attend(q, K, V, q_pos, start, end, T, scale, window):
    """q ``[H, A, D]`` at positions q_pos against keys 0..end-1."""
    full_causal = start == 0 and q.shape[1] == T
    last_only = q.shape[1] == 1 and int(q_pos[0]) == end - 1
    mask = None
    if window is not None and end > window:
        k_pos = torch.arange(end, device=q.device)
        diff = q_pos[:, None] - k_pos[None, :]
        mask = (diff >= 0) & (diff < window)
    elif not (full_causal or last_only):
        mask = q_pos[:, None] >= torch.arange(end, device=q.device)[None, :]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(0),
        K.unsqueeze(0),
        V.unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None and full_causal and T > 1,
        scale=scale,
        enable_gqa=q.shape[0] != K.shape[0],
    )
    return out[0]
