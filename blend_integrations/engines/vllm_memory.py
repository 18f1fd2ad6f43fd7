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
- attention temporaries, for the stretch of layers whose active queries cost
  the most: every token before the first check layer, which attends causally
  without scores but on sliding-window and soft-capped layers; after it the
  fresh tokens and the reused ones kept at the highest ratio the walk may
  reach (its first check layer's under gradual filtering, and 1.0 where a
  guard may raise it). Masked queries attend with torch's math path, which
  materialises float32 scores and their softmax for one call: a CPU's group of
  ``QUERY_GROUP`` queries, a GPU's block of at most ``fusion.attention.block_pairs``
  query-key pairs (about 1 GiB of scores); besides them the GQA-expanded K
  and V, and the masks (``queries x keys`` per sliding-window size). With the
  attention backend's kernel, the queries' token-major copy and the output.
  These are upper bounds, not measurements.

At Llama-3-8B's shape (bfloat16, one rank) a 32k-token blend at 0.15 needs
about 6 GiB on the GPU (the dense copy 4 GiB, a block's scores 1 GiB), within
the 13.9 GiB vLLM leaves of an H200 at ``gpu_memory_utilization`` 0.9
(``tests/unit/test_vllm_memory.py`` has the arithmetic); counted as one call
it was about 47 GiB, and every such blend fell back.

``check_pass_memory`` compares that with what is free (on CUDA
``torch.cuda.mem_get_info`` and the blocks torch's allocator holds unused,
and the host's MemAvailable for the chunks; on a CPU everything against
MemAvailable, once per tensor-parallel rank on the host) and with
``blend_memory_limit_bytes`` from ``kv_connector_extra_config``, if set;
short of either it raises ``NotEnoughMemory``, and the connector fails the
pass before it allocates anything: vLLM computes the request in full, and its
answer says why (``blend_fallback_reason: "blend_memory"``). The connector
calls it where tensor-parallel ranks agree (``agreed``), so one rank short of
memory stops every rank's pass before the walk's collectives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..fusion.attention import QUERY_GROUP, SCORE_BYTES, block_pairs
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


def highest_ratio(plan: PrefillPlan) -> float:
    """The largest share of a blend's reused tokens its walk may keep
    computing after a check layer: the first check layer's (gradual filtering
    keeps the most there), at the plan's ratio, or at 1.0 where a guard may
    raise it (``Guard.ratio`` ends at 1.0 when no rung of its ladder holds)."""
    ratio = 1.0 if plan.guard is not None else plan.ratio
    return plan.schedule(ratio)[0][1]


def stretches(model: Any, plan: PrefillPlan, num_tokens: int) -> list[tuple[int, range, bool]]:
    """``(queries, layers, in_order)`` for each stretch of layers the walk of
    ``plan`` attends with one active set; ``in_order``: the queries are every
    token in order, which attend causally without a mask."""
    layers = range(model.num_layers)
    loaded = [c for c in plan.chunks if c.action == LOAD]
    cached = sum(max(0, c.end - c.start - plan.sink_tokens) for c in loaded)
    if not cached:
        return [(num_tokens, layers, True)]
    fresh = max(0, num_tokens - cached)
    if plan.mode != "blend":
        return [(fresh, layers, False)]
    first = min(plan.check_layers)
    kept = fresh + math.ceil(highest_ratio(plan) * cached)
    # Before the first check layer every token is computed; a query-aware
    # selection's walk starts them at the first reused token, with masks.
    return [(num_tokens, layers[:first], plan.selection == "deviation"), (kept, layers[first:], False)]


def attention_memory(model: Any, stretch: tuple[int, range, bool], num_tokens: int, *, kernel: bool = False) -> int:
    """Temporaries of one stretch's attention (see the module's doc) over
    ``num_tokens`` keys on one rank of ``model``."""
    queries, layers, in_order = stretch
    size = torch.empty((), dtype=model.dtype).element_size()
    heads, kv_heads, dim, tokens = model.num_heads, model.num_kv_heads, model.head_dim, num_tokens
    if not queries or not layers:
        return 0
    if kernel:
        return 2 * heads * queries * dim * size  # the queries' token-major copy and the output
    # Every token in order attends with a fused causal kernel but on layers with a window or a cap.
    scored = [i for i in layers if not in_order or model.windows[i] is not None or model.softcaps[i]]
    if not scored:
        return 0
    if model.device.type != "cpu":
        pairs = min(queries * tokens, max(block_pairs(heads), tokens))  # a block holds at least one query
    else:
        pairs = min(queries, QUERY_GROUP) * tokens
    expanded = 2 * heads * tokens * dim * size if heads != kv_heads else 0  # K, V repeated per query head
    masks = len({model.windows[i] for i in scored}) * queries * tokens * size  # one per window, held by the set
    return heads * pairs * SCORE_BYTES + expanded + masks


def pass_memory(
    model: Any, plan: PrefillPlan, num_tokens: int, *, pooled_tokens: int = 0, kernel: bool = False
) -> PassMemory:
    """What a blend pass of ``num_tokens`` tokens under ``plan`` allocates on
    one rank of ``model`` (a ``LayerModel``, or anything with its shape
    attributes); ``pooled_tokens``: the dense cache a CPU's ``ScratchCache``
    keeps for it already; ``kernel``: the pass attends with the attention
    backend's kernel (``VLLMDecoder.attends_with_kernel``), which reads
    vLLM's paged cache and keeps no scores."""
    size = torch.empty((), dtype=model.dtype).element_size()
    layers, kv_heads, dim = model.num_layers, model.num_kv_heads, model.head_dim
    tokens = num_tokens
    on_gpu = model.device.type != "cpu"
    dense = 0 if not on_gpu and pooled_tokens >= tokens else 2 * layers * kv_heads * tokens * dim * size
    all_heads = model.tp.total_kv_heads if model.tp is not None else kv_heads
    loaded_tokens = sum(c.end - c.start for c in plan.chunks if c.action == LOAD)
    chunk_kv = 2 * layers * all_heads * loaded_tokens * dim * size
    chunk_layer = 2 * kv_heads * loaded_tokens * dim * size if on_gpu else 0
    # One stretch's temporaries are freed before the next stretch attends.
    attention = max(attention_memory(model, s, tokens, kernel=kernel) for s in stretches(model, plan, tokens))
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


def gpu_free(device: torch.device) -> int:
    """Bytes a pass may allocate on CUDA ``device``: what CUDA has free, and
    the blocks torch's caching allocator holds that no tensor uses (it hands
    them out before asking CUDA for more)."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def check_fits(
    need: PassMemory,
    *,
    gpu: tuple[str, int] | None,
    host: int | None,
    ranks: int = 1,
    limit: int | None = None,
) -> None:
    """Raise ``NotEnoughMemory`` if this rank's pass needs more than ``limit``,
    or than is free: ``gpu`` (the device's name and its free bytes; None: a
    CPU pass, all of it in host memory) and ``host`` (the host's available
    bytes; None: unknown). ``ranks``: the tensor-parallel ranks of this host,
    which run their passes at once (each loads whole entries)."""
    if limit is not None and need.total > limit:
        raise NotEnoughMemory(
            f"not enough memory for the blend pass: it needs about {need.total / MiB:.1f} MiB beyond vLLM's "
            f"budget ({need.describe()}), over {MEMORY_LIMIT_KEY}={limit}"
        )
    if gpu is not None:
        name, free = gpu
        if need.device > free:
            raise NotEnoughMemory(
                f"not enough memory for the blend pass: it needs about {need.device / MiB:.1f} MiB of GPU memory "
                f"beyond vLLM's budget ({need.describe()}), and {name} has {free / MiB:.1f} MiB free"
            )
    host_need = need.chunk_kv * ranks if gpu is not None else need.total * ranks
    if host is not None and host_need > host:
        raise NotEnoughMemory(
            f"not enough memory for the blend pass: it needs about {host_need / MiB:.1f} MiB of host memory "
            f"beyond vLLM's budget ({need.describe()}, on each of {ranks} rank(s)), and the host has "
            f"{host / MiB:.1f} MiB available"
        )


def check_pass_memory(need: PassMemory, device: torch.device, *, ranks: int = 1, limit: int | None = None) -> None:
    """``check_fits`` against what is free now on ``device`` and its host."""
    gpu = (str(device), gpu_free(device)) if device.type == "cuda" else None
    check_fits(need, gpu=gpu, host=host_available(), ranks=ranks, limit=limit)


def pooled_tokens(caches: Any) -> int:
    """The tokens of dense cache a CPU's ``ScratchCache`` keeps for the next
    request (``fusion.walk``): a pass that fits in it allocates none. 0 while
    a request holds it, or where nothing is kept."""
    kept = getattr(caches, "_cache", None)
    return 0 if kept is None or getattr(caches, "_leased", False) else int(kept.capacity)
