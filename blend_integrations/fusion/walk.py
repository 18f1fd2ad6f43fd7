"""Walk layer: the CacheBlend layer walk, one implementation for every engine.

A forward pass over new tokens at positions ``cache.length ..``. Some of them
may come with reused KV (chunks computed standalone, K before RoPE). Which
tokens are computed at each layer is the *active* set:

- full:   every token at every layer;
- reuse:  only fresh tokens (no reused KV) at every layer;
- blend:  every token up to the first check layer; at each check layer a
          share ``ratio`` of the reused tokens stays active, the rest keep
          their reused KV from there on. Which ones (``selection``): those
          whose fresh KV deviates most from the reused KV (CacheBlend's HKVD),
          those the query tokens attend to most (as ProphetKV and A³ do), or
          half of each.

Query attention is summed over every layer: at the check layer it follows
position, not the question (on SmolLM2 it turns question-specific only from
about layer 14 of 30). So a query-aware walk runs a reuse pass first (only
the fresh tokens computed, over the reused KV: what "reuse" costs) that adds
up the attention the query pays each reused token at each layer, then the
blend walk, which selects by it (ProphetKV fuses attention across layers
likewise).

Attention of active queries uses an exact causal mask by absolute position
(key position <= query position), never a bottom-right aligned one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

from ..calibration import Guard, RankShares
from ..store import CodedKV
from .layers import LayerModel
from .selection import QUERY_TAIL, choose, deviation_score, over_ranks, query_attention


@dataclass
class KVCache:
    """Per-layer K (after RoPE) and V, ``[num_kv_heads, capacity, head_dim]``."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    length: int = 0

    @classmethod
    def allocate(cls, model: LayerModel, capacity: int) -> KVCache:
        shape = (model.num_kv_heads, capacity, model.head_dim)
        make = lambda: torch.empty(shape, dtype=model.dtype, device=model.device)  # noqa: E731
        return cls([make() for _ in range(model.num_layers)], [make() for _ in range(model.num_layers)])

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]


class ScratchCache:
    """The dense KV cache of an engine's requests, reused from one request to
    the next on a CPU: there a fresh allocation is paged in by the kernel as
    the walk first writes it (55 ms for SmolLM2's 3k-token prompt on 2 CPUs,
    14% of its reuse TTFT). A GPU's caching allocator reuses memory by itself.
    Keeps the largest request's cache (in steps of ``STEP`` tokens) for the
    engine's life."""

    STEP = 512

    def __init__(self, model: LayerModel) -> None:
        self.model = model
        self._cache: KVCache | None = None
        self._leased = False

    @contextmanager
    def lease(self, capacity: int) -> Iterator[KVCache]:
        """An empty cache of ``capacity`` tokens for one request: on a CPU
        the kept one's rows, unless a request still holds them (a stream not
        yet finished), which gets a cache of its own."""
        if self.model.device.type != "cpu" or self._leased:
            yield KVCache.allocate(self.model, capacity)
            return
        if self._cache is None or self._cache.capacity < capacity:
            self._cache = None  # the smaller one is freed before the larger one is made
            self._cache = KVCache.allocate(self.model, -(-capacity // self.STEP) * self.STEP)
        self._leased = True
        try:
            yield KVCache([k[:, :capacity] for k in self._cache.k], [v[:, :capacity] for v in self._cache.v])
        finally:
            self._leased = False


@dataclass(frozen=True)
class ReusedSpan:
    """Reused KV for new tokens ``[start, start + n)`` (offsets into the new
    tokens). kv: a stored chunk's ``[num_layers, 2, num_kv_heads, skip + n,
    head_dim]``, K before RoPE: a tensor, or a coded store's ``CodedKV``,
    decoded one layer at a time on the walk's device; the walk reads its
    heads ``heads`` (a tensor-parallel rank's) after its first ``skip``
    tokens (the sink the prompt's own prefix replaces).

    ready: for KV still being loaded, ``ready(layer)`` returns once ``kv[layer]``
    holds its values (or raises if it never will); None: all there already."""

    start: int
    kv: torch.Tensor | CodedKV
    ready: Callable[[int], None] | None = None
    heads: slice | None = None  # None: every head
    skip: int = 0

    @property
    def end(self) -> int:
        return self.start + self.kv.shape[3] - self.skip

    def layer(self, layer: int, device: torch.device) -> torch.Tensor:
        """Layer ``layer``'s reused K and V, ``[2, heads, n, head_dim]``: a
        view of the tensor (on the CPU), or decoded on ``device``."""
        kv = self.kv
        values = kv[layer] if isinstance(kv, torch.Tensor) else kv.layer(layer, device)
        return values[:, self.heads or slice(None), self.skip :]


@dataclass(frozen=True)
class WalkStats:
    cached_tokens: int  # tokens whose KV came from the store (reused)
    recomputed_tokens: int  # of those, how many were recomputed after all
    token_layers: int = 0  # tokens computed, summed over layers (the walk's work)
    passes: int = 1  # 2: a selection by the query ran its reuse pass first
    kept: tuple[int, ...] = ()  # the reused tokens recomputed after the last check layer (offsets in the new tokens)
    ratio: float | None = None  # the recompute ratio used (blend only): the schedule's, or the guard's
    guarded: bool = False  # the guard raised the ratio
    # the share of the first check layer's ranking score (the reused tokens' deviation, or for a
    # selection by the query its attention) that the top ``ratio`` of them hold
    captured: float | None = None
    # ``share(r)``: the same for any ratio r (it does not depend on the ratio the walk ran at)
    share: RankShares | None = field(default=None, repr=False, compare=False)


def forward(
    model: LayerModel,
    cache: KVCache,
    ids: torch.Tensor,
    *,
    reused: Sequence[ReusedSpan] = (),
    schedule: list[tuple[int, float]] | None = None,
    deviation: str = "v",
    selection: str = "deviation",
    query_start: int | None = None,
    query_end: int | None = None,
    question_end: int | None = None,
    record: torch.Tensor | None = None,
    logits: bool = True,
    relevance: torch.Tensor | None = None,
    guard: Guard | None = None,
    schedule_for: Callable[[float], list[tuple[int, float]]] | None = None,
    kv_target: object | None = None,
    ranking: torch.Tensor | None = None,
    before_layer: Callable[[], None] | None = None,
) -> tuple[torch.Tensor | None, WalkStats]:
    """Run the new tokens ``ids`` through every layer, appending their KV to
    ``cache``. Returns the float32 logits of the last token (None when
    ``logits`` is False) and stats.

    reused + schedule=None is "reuse"; reused + schedule [(layer, ratio), ...]
    is "blend"; no reused is "full". ``selection`` ("deviation", "query",
    "query-tail" or "mixed") picks the reused tokens a check layer keeps; the query is the new
    tokens from offset ``query_start`` to ``query_end`` (default: the end,
    less the one whose logits are returned: vLLM computes a prompt's last
    token itself, so its blend pass never has it, and leaving it out
    everywhere keeps the choice the same on every engine). Without query tokens, the choice falls back to deviation.
    ``question_end``: the offset where the question's own tokens end (before a chat
    template's end of turn and assistant header, ``TokenizedPrompt.question_end``); "query-tail"
    scores the last ``QUERY_TAIL`` of them (None: of the query's).
    ``relevance`` (``[T]``, zeros), if given, receives the query's attention to
    every new token summed over layers (the first pass of a query-aware walk;
    with ``selection`` "query-tail", each key weighted by its value's norm).
    ``guard`` (blend): at the first check layer, raise the ratio for this
    request as the guard says (``calibration.Guard``), the schedule then being
    ``schedule_for(ratio)``. ``record``, if given
    (``[num_layers, 2, num_kv_heads, T, head_dim]``), receives K before RoPE
    and V of every token: the standalone chunk recipe. With ``logits`` the last
    token is always computed, since its hidden state gives them.
    ``kv_target``: an engine's own KV cache that the adapter writes every
    layer into and attends there (``LayerModel.attention``); None: the dense
    ``cache`` alone. ``ranking`` (``[T]``), if given, ranks the reused tokens
    at every check layer in place of ``selection``: the oracle benchmark hands
    the walk a token set (each token's true deviation from full prefill) to
    measure the recompute apart from the selection. ``before_layer``, if
    given, is called before each layer: a live check's walk raises there to
    give way to a user's request (``engines.quality_check.CheckPreempted``).
    """
    T = ids.shape[0]
    start, end = cache.length, cache.length + T
    if end > cache.capacity:
        raise ValueError(f"{end} tokens do not fit the KV cache of {cache.capacity}")
    device = model.device
    positions = torch.arange(start, end, device=device)
    rotary = model.rotary(positions)

    is_reused = torch.zeros(T, dtype=torch.bool)
    for span in reused:
        is_reused[span.start : span.end] = True
    if logits:
        is_reused[-1] = False  # its hidden state gives the logits
    num_reused = int(is_reused.sum())
    if num_reused == 0:
        reused, schedule = (), None
    checks = dict(schedule or ())
    ratio = schedule[-1][1] if schedule else None
    guarded, captured, share = False, None, None
    # Layers before the first check layer compute every token; their reused KV is never read.
    load_from = min(checks) if checks else 0
    active = torch.arange(T) if (schedule or not num_reused) else torch.nonzero(~is_reused).flatten()
    if record is not None and active.numel() != T:
        raise ValueError("record needs every token computed (full mode)")
    recomputed = num_reused if schedule else 0

    is_query = torch.zeros(T, dtype=torch.bool)
    if query_end is None:
        query_end = T - 1 if logits else T
    if query_start is not None:
        is_query[query_start:query_end] = True
    query_mass = None  # per new token, the query's attention summed over layers (query-aware blend)
    first_pass = 0  # token-layers of its reuse pass
    if schedule and selection != "deviation" and bool(is_query.any()):
        query_mass = torch.zeros(T, device=device)
        scored_from, scored_to = query_start, query_end
        if selection == "query-tail":
            assert query_start is not None  # the query has tokens
            if question_end is not None and query_start < question_end <= query_end:
                scored_to = question_end  # the question's own tail, not the template's
            scored_from = max(query_start, scored_to - QUERY_TAIL)
        _, first = forward(
            model,
            cache,
            ids,
            reused=reused,
            selection=selection,
            query_start=scored_from,
            query_end=scored_to,
            logits=False,  # its last layer only scores: the blend walk gives the logits
            relevance=query_mass,
            kv_target=kv_target,
            before_layer=before_layer,
        )
        first_pass = first.token_layers
        cache.length = start  # the blend walk below writes its rows again
        query_mass = over_ranks(model, query_mass)
        # The tokens before the first reused one (the system prompt, the
        # chat template's head) read nothing a blend changes: the first pass
        # left their final KV in the cache, so the blend walk skips them.
        active = active[active >= int(torch.nonzero(is_reused)[0])]
    act = active.to(device)  # the same indices on the model's device
    h = model.embed(ids[act])
    attention = None  # how the active tokens attend: built for each active set, shared by its layers
    token_layers = 0
    # A query-aware walk's first pass left every layer's reused KV in the cache,
    # rotated, and no row of it has been written since: the blend walk reads it there.
    to_load = () if query_mass is not None else reused
    loads = _Loads(cache, start, to_load, load_from, model.num_layers, device)
    try:
        for layer in range(model.num_layers):
            if before_layer is not None:
                before_layer()
            # A check layer needs every token's K and V, but queries only for
            # the tokens it keeps: they are made once it has chosen (at 0.15,
            # five sixths of that layer's query projection and RoPE saved).
            later_queries = layer in checks and relevance is None
            with record_function("walk.qkv"):
                q, k, v = model.qkv(layer, h, queries=not later_queries)
            if record is not None:
                record[layer, 0].copy_(k)
                record[layer, 1].copy_(v)
            with record_function("walk.rope"):
                if not later_queries:
                    q = rotary(layer, q, act)
                k = rotary(layer, k, act)
            K = cache.k[layer][:, :end]
            V = cache.v[layer][:, :end]
            if to_load and layer >= load_from:
                with record_function("walk.load_kv"):
                    loads.load(layer)
                # One rotation over all new rows; rows that are not reused hold
                # stale values here and are overwritten by fresh KV just below.
                with record_function("walk.rerotate"):
                    new_rows = K[:, start:end]
                    rotated = rotary(layer, new_rows)
                    if rotated.data_ptr() != new_rows.data_ptr():  # not rotated in place
                        new_rows.copy_(rotated)
            keep = None
            if layer in checks:
                with record_function("walk.check"):
                    reused_rows = is_reused[active]
                    rows = torch.nonzero(reused_rows).flatten()
                    # before the fresh KV overwrites the reused KV
                    scores = {"deviation": deviation_score(model, deviation, (k, K), (v, V), start, act, rows)}
                    if captured is None:  # the first check layer: every reused token is still active
                        # What the guard reads: how much of the ranking's score the top tokens hold. A
                        # selection by the query ranks by its attention (at check layer 0 no token deviates).
                        ranked = scores["deviation"]
                        if query_mass is not None and selection in ("query", "query-tail"):
                            share = RankShares.of(query_mass[act[rows.to(device)]])
                        elif layer == 0:
                            # a reused token's layer-0 K and V are its own whatever the context: no
                            # deviation there says nothing (a query selection without query tokens)
                            share = RankShares.even(len(rows))
                        else:
                            share = RankShares.of(ranked)
                        if guard is not None and schedule_for is not None and ratio is not None:
                            raised = guard.ratio(share)
                            if raised > ratio:
                                ratio, guarded = raised, True
                                checks = dict(schedule_for(raised))
                        captured = share(ratio if ratio is not None else 0.0)
            with record_function("walk.kv_write"):
                K.index_copy_(1, start + act, k)
                V.index_copy_(1, start + act, v)
            if relevance is not None:
                assert q is not None  # made with K and V: a scoring pass does not defer queries
                with record_function("walk.query_scoring"):
                    queries = torch.nonzero(is_query[active]).flatten().to(device)
                    relevance += query_attention(
                        q[:, queries],
                        K,
                        positions[act[queries]],
                        model.windows[layer],
                        model.scaling,
                        model.softcaps[layer],
                        values=V if selection == "query-tail" else None,
                    )[start:]
            if layer in checks:
                if query_mass is not None:
                    scores["query"] = query_mass[act[rows.to(device)]]
                keep = ~reused_rows
                count = round(checks[layer] * num_reused)
                if ranking is None:
                    chosen = choose(scores, selection, count)
                else:
                    chosen = ranking[act[rows.to(device)]].topk(min(count, rows.numel())).indices
                keep[rows[chosen.cpu()]] = True
                recomputed = int((keep & reused_rows).sum())
            if keep is not None:
                keep_dev = keep.to(device)
                h, active, act = h[keep_dev], active[keep], act[keep_dev]
                # token-major, as the projections make q: vLLM's fused RoPE and
                # its kernel take it so, in one call for every head
                q = None if q is None else q.transpose(0, 1)[keep_dev].transpose(0, 1)
                attention = None
            if later_queries:
                with record_function("walk.qkv"):
                    if q is None:  # its K and V again, for the kept rows only: cheaper than a second method
                        q = model.qkv(layer, h)[0]
                with record_function("walk.rope"):
                    q = rotary(layer, q, act)
            assert q is not None
            token_layers += act.numel()
            if layer == model.num_layers - 1:
                # Past its KV, the last layer only gives the logits, from the
                # last token's hidden state: without logits (a vLLM blend pass,
                # a chunk's KV) its attention and MLP are not run at all, with
                # them only for that token (1/16 of a 16-layer prefill saved).
                if not logits:
                    with record_function("walk.attention"):
                        if attention is None:
                            attention = model.attention(positions[act], start, end, kv_target)
                        attention.store(layer, K, V)
                    break
                if act.numel() > 1:
                    q, h, act, attention = q[:, -1:], h[-1:], act[-1:], None
            with record_function("walk.attention"):
                if attention is None:
                    attention = model.attention(positions[act], start, end, kv_target)
                attn = attention(layer, q, K, V)
            with record_function("walk.finish"):
                h = model.finish(layer, h, attn)
    finally:
        loads.close()  # the copies still under way finish before the cache is used or freed
    cache.length = end
    kept = tuple(active[is_reused[active]].tolist()) if schedule else ()
    stats = WalkStats(
        num_reused, recomputed, first_pass + token_layers, 2 if first_pass else 1, kept, ratio, guarded, captured, share
    )
    return (model.logits(h[-1:])[0] if logits else None), stats


# On CUDA, how many layers ahead of the walk the reused KV's copies are issued.
LOOKAHEAD = 2


_copy_streams: dict[torch.device, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream the walks on ``device`` copy reused KV on, one for the
    process rather than one of torch's pool of 32 per walk: the allocator
    keeps cached blocks per stream, so the copies' temporary buffers are
    reused from walk to walk instead of being kept 32 times over."""
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    stream = _copy_streams.get(device)
    if stream is None:
        stream = _copy_streams.setdefault(device, torch.cuda.Stream(device=device))
    return stream


class _Loads:
    """Copies the reused KV of layer l into the cache when the walk reaches it.

    On CUDA, the spans' KV that is at hand (``ready`` None: the memory tier's,
    page-locked) is copied on a second stream, ``LOOKAHEAD`` layers ahead of
    the layer that reads it, so the copies overlap the computation; each
    layer's computation waits (an event) for its own copies only. Spans still
    being read from the store (``ready``) are copied when the walk reaches
    their layer, on the computation's stream. Elsewhere (a CPU) every copy is
    made when the walk reaches its layer. ``close`` (always called) orders the
    computation's stream after the copy stream: no copy is left writing into
    the cache, or reading a span, once the walk returns or fails.
    """

    def __init__(
        self,
        cache: KVCache,
        start: int,
        reused: Sequence[ReusedSpan],
        load_from: int,
        num_layers: int,
        device: torch.device,
    ) -> None:
        self.cache, self.start, self.reused, self.num_layers = cache, start, reused, num_layers
        self.stream: torch.cuda.Stream | None = None
        if device.type == "cuda" and any(span.ready is None for span in reused):
            self.compute = torch.cuda.current_stream(device)
            self.stream = _copy_stream(device)
            # after what the computation did before (a query-aware walk's first pass wrote these rows)
            self.stream.wait_stream(self.compute)
            self.events: dict[int, torch.cuda.Event] = {}
            self.issued = load_from  # the next layer whose copies are issued
            self._issue(load_from + LOOKAHEAD)

    def _copy(self, span: ReusedSpan, layer: int) -> None:
        a, b = self.start + span.start, self.start + span.end
        # asynchronous from page-locked memory (the memory tier's on a
        # machine with a GPU): no wait for the GPU per chunk and layer
        kv = span.layer(layer, self.cache.k[layer].device)
        self.cache.k[layer][:, a:b].copy_(kv[0], non_blocking=True)
        self.cache.v[layer][:, a:b].copy_(kv[1], non_blocking=True)

    def _issue(self, through: int) -> None:
        """Copy the KV at hand of every layer up to ``through`` on the copy stream."""
        assert self.stream is not None
        while self.issued <= min(through, self.num_layers - 1):
            with torch.cuda.stream(self.stream):
                for span in self.reused:
                    if span.ready is None:
                        self._copy(span, self.issued)
                self.events[self.issued] = self.stream.record_event()
            self.issued += 1

    def load(self, layer: int) -> None:
        """Layer ``layer``'s reused KV in the cache (for the computation's stream)."""
        if self.stream is not None:
            self._issue(layer + LOOKAHEAD)
            self.compute.wait_event(self.events.pop(layer))
        for span in self.reused:
            if span.ready is not None:
                span.ready(layer)  # the walk needs layer l's KV only here
            elif self.stream is not None:
                continue  # copied on the copy stream
            self._copy(span, layer)

    def close(self) -> None:
        if self.stream is not None:
            self.compute.wait_stream(self.stream)
