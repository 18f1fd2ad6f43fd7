"""Walk layer: what the walk needs from a decoder model, engine-neutral.

An engine adapts its model (Hugging Face modules, vLLM modules) to
``LayerModel``; the walk in ``walk.py`` only ever calls these methods. Shapes
are batch-free: hidden ``[T, hidden]``, per-head tensors ``[heads, T, head_dim]``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch


class Ranks(Protocol):
    """The ranks of a tensor-parallel group, as agreeing on failure needs them."""

    rank: int  # this process's rank in the group
    size: int
    device: torch.device  # where the group's collectives take tensors

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the group's ranks; the same tensor on every rank."""


class RanksFailed(RuntimeError):
    """Every rank of a tensor-parallel group stopped at the same point,
    because one or more of them failed there (``agreed``). ``cause``: this
    rank's own failure; None on a rank that stopped for another's."""

    def __init__(self, message: str, cause: BaseException | None) -> None:
        super().__init__(message)
        self.cause = cause


def agree(ranks: Ranks | None, failure: BaseException | None) -> None:
    """Before the next collective: every rank learns whether any rank failed
    since the last agreement, and if one did, every rank raises
    ``RanksFailed`` (with the cause on the ranks that failed), so no rank is
    left waiting in a collective the others never join. One all-reduce of a
    flag per rank. Without tensor parallelism, ``failure`` is raised as is."""
    if ranks is None:
        if failure is not None:
            raise failure
        return
    flags = torch.zeros(ranks.size, dtype=torch.float32, device=ranks.device)
    flags[ranks.rank] = float(failure is not None)
    failed = [r for r, flag in enumerate(ranks.sum(flags).tolist()) if flag]
    if not failed:
        return
    if failure is not None:
        raise RanksFailed(
            f"tensor-parallel rank {ranks.rank}: {type(failure).__name__}: {failure}", failure
        ) from failure
    raise RanksFailed(f"tensor-parallel rank(s) {', '.join(map(str, failed))} failed", None)


@contextmanager
def agreed(ranks: Ranks | None) -> Iterator[None]:
    """Run a stretch of rank-local work (no collective inside), then
    ``agree``: a failure in it on any rank stops every rank together."""
    failure = None
    try:
        yield
    except Exception as exc:
        if ranks is None:
            raise
        failure = exc
    agree(ranks, failure)


class TensorParallel(Ranks, Protocol):
    """A model split over a tensor-parallel group: every rank computes its own
    heads, and the walk on every rank must choose the same tokens."""

    kv_heads: slice  # this rank's KV heads among the model's (a stored chunk holds them all)
    total_kv_heads: int  # the model's KV heads, over every rank

    def gather_kv_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[layers, 2, kv_heads, T, D]`` of this rank's KV heads -> of all the model's."""


class LayerModel(Protocol):
    num_layers: int
    num_heads: int  # computed here: under tensor parallelism, this rank's
    num_kv_heads: int  # likewise
    head_dim: int
    scaling: float  # softmax scale of attention
    windows: tuple[int | None, ...]  # per layer sliding window; None: every earlier key is visible
    softcaps: tuple[float | None, ...]  # per layer attention-logit soft-cap (Gemma 2); None: none
    dtype: torch.dtype
    device: torch.device
    tp: TensorParallel | None  # None: this process computes every head

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``[T]`` -> hidden ``[T, hidden]``."""

    def rotary(self, positions: torch.Tensor) -> Rotary:
        """RoPE at these absolute positions, with the model's own rotary
        module(s) (so every rope scaling it supports, and a rope base per
        layer where the model has one, is honoured)."""

    def qkv(
        self, layer: int, hidden: torch.Tensor, queries: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """Input norm and projections: q ``[num_heads, T, D]``, k and v
        ``[num_kv_heads, T, D]``, before RoPE. Without ``queries`` q may be
        None (an adapter whose projection is fused returns it anyway)."""

    def finish(self, layer: int, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection, residuals and MLP: hidden ``[T, hidden]`` and
        attention output ``[num_heads, T, D]`` -> next hidden ``[T, hidden]``."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: ``[T, hidden]`` -> ``[T, vocab]`` (float32)."""

    def attention(self, positions: torch.Tensor, start: int, end: int, target: object | None) -> Attention:
        """How the active queries at sorted absolute ``positions`` attend the
        KV of positions ``0..end`` (the new tokens are ``start..end``): built
        once per active set, then called for each layer. ``target``: the
        engine's own KV cache to write each layer into and attend there (the
        vLLM adapter's paged cache), or None: the walk's dense cache
        (``attention.DenseAttention``)."""


class Attention(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
        """q ``[num_heads, A, D]`` (after RoPE) against the layer's complete
        K (after RoPE) and V ``[num_kv_heads, end, D]`` -> ``[num_heads, A, D]``;
        first ``store``s the layer's KV."""

    def store(self, layer: int, K: torch.Tensor, V: torch.Tensor) -> None:
        """Write the layer's new KV where this attention reads it, when that is
        not the walk's dense cache (which holds it already): for a layer whose
        attention the walk does not need."""


class Rotary(Protocol):
    def __call__(self, layer: int, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``[heads, n, D]`` rotated as ``layer`` rotates, to the
        positions ``positions[rows]`` (all of them when rows is None); may
        rotate ``x`` in place."""


class TableRotary:
    """``Rotary`` from cos, sin tables ``[T, R]`` of the walk's positions, one
    pair per layer (layers with the same rope share one pair). R < D: only the
    first R dims of each head rotate (partial rotary, as Phi-4-mini)."""

    def __init__(self, tables: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.tables = tables
        self._rows: torch.Tensor | None = None
        self._sliced: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, layer: int, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        if rows is not self._rows:  # the walk passes one rows tensor per active set
            self._rows, self._sliced = rows, {}
        cos, sin = self.tables[layer]
        if rows is not None:
            key = id(cos)
            if key not in self._sliced:
                self._sliced[key] = (cos[rows], sin[rows])
            cos, sin = self._sliced[key]
        return rotate(x, cos, sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE in the half-split layout (HF Llama family, vLLM neox style)
    to the first ``cos.shape[-1]`` dims of each head. x ``[heads, T, D]``,
    cos/sin ``[T, R]``: ``x * cos + cat(-x2, x1) * sin``, in one new tensor
    (on a CPU it is memory-bound: each temporary costs a pass)."""
    width = cos.shape[-1]
    if width < x.shape[-1]:
        return torch.cat((rotate(x[..., :width], cos, sin), x[..., width:]), dim=-1)
    half = width // 2
    out = x * cos
    out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
    out[..., half:].addcmul_(x[..., :half], sin[..., half:])
    return out
