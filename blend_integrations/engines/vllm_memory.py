"""Engines layer: the memory a blend pass takes beyond vLLM's budget, checked before the pass starts.

vLLM sizes its KV cache from what its own forward needs (it profiles a step
of ``max_num_batched_tokens``, which the engine sets to at least a whole
context) and holds the rest. The blend pass allocates besides that:

- the walk's dense KV copy (``fusion.walk.KVCache``): K and V of every layer
  for every token, this rank's KV heads, in the model's dtype. On a CPU the
  ``ScratchCache`` keeps the largest request's, so a pass that fits in it
  allocates none;
- the chunks it loads: a stored entry holds every KV head of every layer,
  read whole into host memory (or layer by layer, with pipelined loading:
  counted whole all the same); on a GPU one layer of them at a time is on
  the device too;
- attention temporaries: recomputed queries attend with an explicit mask,
  which fused kernels may serve without materialising scores, but torch's
  math path materialises them: ``heads x queries x keys`` float32 scores and
  their softmax, the GQA-expanded K and V, and the mask itself (``queries x
  keys`` per sliding-window size). A GPU attends all queries in one call, a
  CPU in groups of ``QUERY_GROUP``. These are upper bounds, not measurements.

``check_pass_memory`` compares that with what is free (on CUDA
``torch.cuda.mem_get_info``, and the host's MemAvailable for the chunks; on a
CPU everything against MemAvailable, once per tensor-parallel rank on the
host) and with ``blend_memory_limit_bytes`` from ``kv_connector_extra_config``,
if set; short of either it raises ``NotEnoughMemory``, and the connector
fails the pass before it allocates anything: vLLM computes the request in
full, and its answer says why (``blend_fallback_reason: "blend_memory"``).
The connector calls it where tensor-parallel ranks agree (``agreed``), so one
rank short of memory stops every rank's pass before the walk's collectives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..fusion.attention import QUERY_GROUP
from ..fusion.plan import LOAD, PrefillPlan

MEMORY_LIMIT_KEY = "blend_memory_limit_bytes"
REASON = "blend_memory"  # blend_metrics.REASONS
MiB = 2**20


def check_memory_limit(value: Any) -> int | None:
    """``kv_connector_extra_config[MEMORY_LIMIT_KEY]``: None (no limit but
    free memory), or the most bytes a blend pass may allocate beyond vLLM's
    budget, a non-negative integer."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"kv_connector_extra_config.{MEMORY_LIMIT_KEY} must be a non-negative integer (bytes) or null, "
            f"got {value!r:.60}"
        )
    return value


class NotEnoughMemory(RuntimeError):
    """A blend pass that would not fit: raised before it allocates anything."""


@dataclass(frozen=True)
class PassMemory:
    """Bytes one rank's blend pass allocates beyond vLLM's budget, by kind (see the module's doc)."""

    dense_kv: int
    chunk_kv: int  # in host memory
    chunk_layer: int  # the loaded chunks' layer on the device (a GPU's), at a time
    attention: int

    @property
    def device(self) -> int:
        return self.dense_kv + self.chunk_layer + self.attention

    @property
    def total(self) -> int:
        return self.device + self.chunk_kv

    def describe(self) -> str:
        parts = [
            ("the dense KV copy", self.dense_kv),
            ("the loaded chunks' KV", self.chunk_kv + self.chunk_layer),
            ("attention temporaries", self.attention),
        ]
        return ", ".join(f"{name} {size / MiB:.1f} MiB" for name, size in parts)


def pass_memory(
    model: Any, plan: PrefillPlan, num_tokens: int, *, pooled_tokens: int = 0, kernel: bool = False
) -> PassMemory:
    """What a blend pass of ``num_tokens`` tokens under ``plan`` allocates on
    one rank of ``model`` (a ``LayerModel``); ``pooled_tokens``: the dense
    cache a CPU's ``ScratchCache`` keeps for it already; ``kernel``: the pass
    attends with the attention backend's kernel (``VLLMDecoder.attends_with_kernel``),
    which reads vLLM's paged cache and keeps no scores: its temporaries are
    the queries' token-major copy and the output."""
    size = torch.empty((), dtype=model.dtype).element_size()
    layers, kv_heads, heads, dim = model.num_layers, model.num_kv_heads, model.num_heads, model.head_dim
    tokens = num_tokens
    on_gpu = model.device.type != "cpu"
    dense = 0 if not on_gpu and pooled_tokens >= tokens else 2 * layers * kv_heads * tokens * dim * size
    all_heads = model.tp.total_kv_heads if model.tp is not None else kv_heads
    loaded = [c for c in plan.chunks if c.action == LOAD]
    loaded_tokens = sum(c.end - c.start for c in loaded)
    chunk_kv = 2 * layers * all_heads * loaded_tokens * dim * size
    chunk_layer = 2 * kv_heads * loaded_tokens * dim * size if on_gpu else 0
    # Queries that attend with a mask: every token but the reused ones not recomputed.
    cached = sum(max(0, c.end - c.start - plan.sink_tokens) for c in loaded)
    recomputed = math.ceil(plan.ratio * cached) if plan.mode == "blend" else 0
    queries = max(0, tokens - cached) + recomputed
    per_call = queries if on_gpu else min(queries, QUERY_GROUP)
    windows = len(set(model.windows)) or 1
    attention = 0
    if queries and kernel:
        attention = 2 * heads * queries * dim * size
    elif queries:
        scores = 2 * heads * per_call * tokens * 4  # float32 scores and their softmax
        expanded = 2 * heads * tokens * dim * size if heads != kv_heads else 0  # K, V repeated per query head
        attention = scores + expanded + windows * queries * tokens * size
    return PassMemory(dense, chunk_kv, chunk_layer, attention)


def host_available() -> int | None:
    """The host's MemAvailable in bytes (what can be allocated without
    swapping), or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:
        return None


def check_pass_memory(need: PassMemory, device: torch.device, *, ranks: int = 1, limit: int | None = None) -> None:
    """Raise ``NotEnoughMemory`` if this rank's pass needs more than is free,
    or than ``limit``. ``ranks``: the tensor-parallel ranks of this host,
    which run their passes at once (each loads whole entries)."""
    if limit is not None and need.total > limit:
        raise NotEnoughMemory(
            f"not enough memory for the blend pass: it needs about {need.total / MiB:.1f} MiB beyond vLLM's "
            f"budget ({need.describe()}), over {MEMORY_LIMIT_KEY}={limit}"
        )
    host = host_available()
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if need.device > free:
            raise NotEnoughMemory(
                f"not enough memory for the blend pass: it needs about {need.device / MiB:.1f} MiB of GPU memory "
                f"beyond vLLM's budget ({need.describe()}), and {device} has {free / MiB:.1f} MiB free"
            )
        host_need = need.chunk_kv * ranks
    else:
        host_need = need.total * ranks
    if host is not None and host_need > host:
        raise NotEnoughMemory(
            f"not enough memory for the blend pass: it needs about {host_need / MiB:.1f} MiB of host memory "
            f"beyond vLLM's budget ({need.describe()}, on each of {ranks} rank(s)), and the host has "
            f"{host / MiB:.1f} MiB available"
        )


def pooled_tokens(caches: Any) -> int:
    """The tokens of dense cache a CPU's ``ScratchCache`` keeps for the next
    request (``fusion.walk``): a pass that fits in it allocates none. 0 while
    a request holds it, or where nothing is kept."""
    kept = getattr(caches, "_cache", None)
    return 0 if kept is None or getattr(caches, "_leased", False) else int(kept.capacity)
