"""Walk layer: a prefill plan carried out, with the store and the walk.

An engine (the transformers engine in-process, the vLLM connector inside a
vLLM worker) wraps its model as a ``LayerModel`` and hands a ``Blender`` a
prompt and its plan (``plan.py``); the Blender reads the chunks to load from
the store, runs the walk, and computes and saves missed chunks with the
standalone recipe.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ..calibration import Calibrations, RankShares
from ..config import BlendConfig
from ..cost import WalkSpeed
from ..store import ChunkKV, ChunkStore
from ..store.layered import LayerReader
from .controller import LoadingStats
from .layers import LayerModel, agreed
from .pipeline import LayerLoader, LoadFailed
from .plan import COMPUTE, MISS, ChunkKeys, Planner, PrefillPlan, measured_rates
from .walk import KVCache, ReusedSpan, ScratchCache, WalkStats, forward

logger = logging.getLogger(__name__)

# Threads reading a prompt's chunks from the store at once (on a GPU machine).
READ_THREADS = 8
# Threads reading a prompt's chunks layer by layer while the walk computes (pipelined loading), by
# device. On a 2-CPU machine two read a prompt from the page cache in half the time of one, and the
# walk was no slower for it (benchmarks store, "layered reads by thread count"); on a GPU the cores
# are free, and one thread reads the page cache at well under the bus's speed.
LAYER_READ_THREADS = {"cpu": 2, "cuda": 4}
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _read_pool() -> ThreadPoolExecutor:
    """The process's pool of reading threads, made on first use."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="blend-read")
        return _pool


@dataclass
class PrefillStats:
    cached_tokens: int = 0  # prompt tokens whose KV came from the store
    recomputed_tokens: int = 0  # of those, the ones blending recomputed
    chunks_hit: int = 0  # chunks loaded from the store
    chunks_missed: int = 0  # chunks not in the store: computed, and saved after
    chunks_computed: int = 0  # chunks in the store the loading controller computed instead
    recompute_ratio: float | None = None  # the ratio the walk blended at (None: not blended)
    ratio_source: str | None = None  # where it came from (``config.RATIO_SOURCES``)
    calibration_dtype: str | None = None  # the dtype of the calibration it came from (``Usage.calibration_dtype``)
    ranking_captured: float | None = None  # the share of the check layer's ranking score that ratio covers
    ranking_share: RankShares | None = field(default=None, repr=False)  # the same, for any ratio
    # the prompt's tokens whose KV came from the store, as [start, end) spans, and of those the recomputed ones
    reused_spans: tuple[tuple[int, int], ...] = ()
    recomputed_positions: tuple[int, ...] = ()
    loading: LoadingStats | None = None  # the loading controller's decisions, when it ran
    missed: dict[str, list[int]] = field(default_factory=dict, repr=False)  # key -> ids, to save


class Blender:
    def __init__(
        self, model: LayerModel, store: ChunkStore, config: BlendConfig, *, fingerprint: str, bos_token_id: int | None
    ) -> None:
        if config.check_layers[-1] >= model.num_layers:
            raise ValueError(f"check_layers {config.check_layers} must be below the model's {model.num_layers} layers")
        self.model = model
        self.config = config
        self.calibrations = Calibrations(
            store, fingerprint, model.dtype, engine="transformers", num_layers=model.num_layers
        )
        self.planner = Planner(
            config, ChunkKeys(fingerprint, model.dtype, bos_token_id), model.num_layers, self.calibrations
        )
        self.store = store
        # The speed of this model's walk (per token-layer and per pass), measured on every walk.
        self.walk_speed = WalkSpeed()
        # The dense KV cache of the engine's requests (it runs one at a time).
        self.request_caches = ScratchCache(model)

    @property
    def keys(self) -> ChunkKeys:
        return self.planner.keys

    @property
    def store(self) -> ChunkStore:
        return self._store

    @store.setter
    def store(self, store: ChunkStore) -> None:
        self._store = store
        self.calibrations.use_store(store)

    def plan(
        self,
        token_ids: Sequence[int],
        chunk_spans: Sequence[tuple[int, int]],
        *,
        mode: str,
        recompute_ratio: float | str | None = None,
        settings: dict | None = None,
        question_end: int | None = None,
    ) -> PrefillPlan:
        """The plan (``Planner.plan``) from this Blender's store, at its measured rates."""
        rates = measured_rates(self.store, self.walk_speed)
        return self.planner.plan(
            token_ids,
            chunk_spans,
            mode=mode,
            ratio=recompute_ratio,
            store=self.store,
            rates=rates,
            settings=settings,
            question_end=question_end,
        )

    def _expect(self, n: int):
        """The shape and dtype of a stored chunk of ``n`` tokens: every KV head
        of the model, whatever the tensor-parallel group computing it."""
        m = self.model
        heads = m.tp.total_kv_heads if m.tp is not None else m.num_kv_heads
        return (m.num_layers, heads, n, m.head_dim, m.dtype)

    def _missing_anywhere(self, missing: list[bool]) -> list[bool]:
        """Under tensor parallelism, a chunk one rank could not read is missing
        on every rank: the ranks' walks run in lockstep and must reuse the same
        chunks (a store may change between two ranks' reads)."""
        tp = self.model.tp
        if tp is None or not missing:
            return missing
        flags = torch.tensor(missing, dtype=torch.float32, device=self.model.device)
        return (tp.sum(flags) > 0).tolist()

    def compute_chunk(self, token_ids: Sequence[int], key: str | None = None) -> ChunkKV:
        """The standalone recipe: ``[BOS] + chunk`` at positions 0..n, BOS row
        dropped, K before RoPE."""
        m = self.model
        bos = self.keys.bos_token_id
        ids = ([bos] if bos is not None else []) + list(token_ids)
        with agreed(m.tp):  # the buffers, on every rank before the walk's collectives
            shape = (m.num_layers, 2, m.num_kv_heads, len(ids), m.head_dim)
            record = torch.empty(shape, dtype=m.dtype, device=m.device)
            cache = KVCache.allocate(m, len(ids))
        self._forward(cache, ids, record=record, logits=False)
        if m.tp is not None:  # a stored chunk holds every head, so any group size can read it
            record = m.tp.gather_kv_heads(record)
        skip = 1 if bos is not None else 0
        return ChunkKV(
            key or self.keys(token_ids), record[:, :, :, skip:].to("cpu").contiguous(), token_ids=tuple(token_ids)
        )

    def pass_seconds(self, context: int, repeats: int = 5, tokens: int = 1, scored: int = 0) -> float:
        """The median time of one walk pass over ``tokens`` new tokens after
        ``context`` tokens of KV, without logits, the last ``scored`` of them
        scoring their attention at every layer, as a query selection's reuse
        pass scores the query's. Less its token-layers, it is what a pass costs
        whatever its tokens (on a CPU, reading every layer's weights once, and
        multiplying a few dozen tokens by them far below the speed of
        hundreds), which the cost model's token-layers do not count. On every
        rank of a tensor-parallel group together, as any walk."""
        for name, value, least in (("context", context, 0), ("repeats", repeats, 1), ("tokens", tokens, 1)):
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
                raise ValueError(f"{name} must be an int >= {least}; got {value!r:.40}")
        if not (isinstance(scored, int) and not isinstance(scored, bool) and 0 <= scored <= tokens):
            raise ValueError(f"scored must be an int from 0 to tokens ({tokens}); got {scored!r:.40}")
        m = self.model
        with agreed(m.tp):
            cache = KVCache.allocate(m, context + tokens)
            for rows in (*cache.k, *cache.v):
                rows.zero_()  # any values: only the time is read
            ids = torch.zeros(tokens, dtype=torch.long, device=m.device)
        times = []
        with torch.inference_mode():
            for _ in range(repeats + 1):  # the first one warms up
                cache.length = context
                started = time.perf_counter()
                query = {"relevance": torch.zeros(tokens, device=m.device), "query_start": tokens - scored}
                forward(m, cache, ids, logits=False, **(query if scored else {}))
                if m.device.type == "cuda":
                    torch.cuda.synchronize(m.device)
                times.append(time.perf_counter() - started)
        return statistics.median(times[1:])

    def ensure(self, token_ids: Sequence[int]) -> bool:
        """Compute and store a chunk unless the store has it; True if computed."""
        key = self.keys(token_ids)
        with agreed(self.model.tp):
            found = self.store.get(key, expect=self._expect(len(token_ids)))
        [missing] = self._missing_anywhere([found is None])
        if not missing:
            return False
        entry = self.compute_chunk(token_ids, key)
        with agreed(self.model.tp):  # a rank that cannot store it fails the warm-up with the others
            self.store.put(entry)
        return True

    def prefill(
        self,
        cache: KVCache,
        token_ids: Sequence[int],
        plan: PrefillPlan,
        *,
        logits: bool = True,
        kv_target: object | None = None,
        before_layer: Callable[[], None] | None = None,
    ) -> tuple[torch.Tensor | None, PrefillStats]:
        """Prefill ``token_ids`` into an empty ``cache`` as ``plan`` says (see
        ``plan.py``); ``kv_target``: the engine's own cache the walk also
        writes and attends (``LayerModel.attention``); ``before_layer``: the
        walk's (``walk.forward``). Call ``save_missed`` after."""
        stats = PrefillStats(loading=plan.loading)
        to_open = []  # (chunk, ids) of the chunks to load
        for chunk in plan.chunks:
            ids = list(token_ids[chunk.start : chunk.end])
            if chunk.action == MISS:
                stats.missed[chunk.key] = ids
            elif chunk.action == COMPUTE:
                stats.chunks_computed += 1
            else:
                to_open.append((chunk, ids))
        with agreed(self.model.tp):  # a read that raised on one rank stops every rank before the walk
            sources = self._open_all(to_open)
        # (chunk, ids, ChunkKV or LayerReader or None) of the chunks to load
        opened = [(chunk, ids, source) for (chunk, ids), source in zip(to_open, sources)]
        missing = self._missing_anywhere([source is None for *_, source in opened])
        loaded = []  # (start, end, key, ids, ChunkKV or LayerReader) of the chunks reused
        for (chunk, ids, source), gone in zip(opened, missing):
            if gone:
                source = self._unreadable(chunk.key, ids, plan.promised)
            if source is None:
                stats.missed[chunk.key] = ids
            else:
                loaded.append((chunk.start, chunk.end, chunk.key, ids, source))
        first = cache.length
        while True:
            out, walk = self._walk(
                cache, token_ids, loaded, plan, logits=logits, kv_target=kv_target, before_layer=before_layer
            )
            if walk is not None:
                break
            # A chunk failed to read or verify after its bytes may have been
            # used: it becomes a missed chunk, and the walk starts over.
            for i in [i for i, (*_, source) in enumerate(loaded) if source is None][::-1]:
                _, _, key, ids, _ = loaded.pop(i)
                stats.missed[key] = ids
            cache.length = first
        stats.chunks_hit = len(loaded)
        stats.chunks_missed = len(plan.chunks) - stats.chunks_hit - stats.chunks_computed
        stats.cached_tokens, stats.recomputed_tokens = walk.cached_tokens, walk.recomputed_tokens
        sink = plan.sink_tokens
        stats.reused_spans = tuple((start + sink, end) for start, end, *_ in loaded if end - start > sink)
        stats.recomputed_positions = walk.kept
        if plan.reports_ratio:  # the planned ratio, or the guard's (the walk's is None when nothing was reused)
            stats.recompute_ratio = walk.ratio if walk.ratio is not None else plan.ratio
            stats.ratio_source = "guard" if walk.guarded else plan.ratio_source
            stats.calibration_dtype = plan.calibration_dtype
            stats.ranking_captured, stats.ranking_share = walk.captured, walk.share
        return out, stats

    def _walk(
        self, cache: KVCache, token_ids, loaded: list, plan: PrefillPlan, *, logits: bool, kv_target, before_layer
    ):
        """One walk with the ``loaded`` chunks, as ``plan`` says, reading the
        layers of those still in the store meanwhile (pipelined loading).
        Every reader is then settled: ``loaded`` holds its entry, or None if it
        failed, and the walk's stats are None if any did (its result must not
        be used)."""
        sink = plan.sink_tokens
        heads = self.model.tp.kv_heads if self.model.tp is not None else slice(None)  # this rank's
        loader = LayerLoader(
            [source for *_, source in loaded if isinstance(source, LayerReader)],
            threads=LAYER_READ_THREADS.get(self.model.device.type, 1),
        )
        reused = [
            ReusedSpan(
                start + sink,
                source.kv,
                loader.ready(source) if isinstance(source, LayerReader) else None,
                heads=heads,
                skip=sink,
            )
            for start, end, _, _, source in loaded
            if end - start > sink
        ]
        out = walk = None
        try:
            with loader:
                out, walk = self._forward(
                    cache,
                    token_ids,
                    reused=reused,
                    schedule=plan.schedule(plan.ratio) if plan.mode == "blend" else None,
                    deviation=plan.deviation,
                    selection=plan.selection,
                    # the query: what follows the last chunk (the question, the template's tail)
                    query_start=plan.chunks[-1].end if plan.chunks else None,
                    question_end=plan.question_end,
                    logits=logits,
                    loader=loader,
                    guard=plan.guard,
                    schedule_for=plan.schedule,
                    kv_target=kv_target,
                    before_layer=before_layer,
                )
        except LoadFailed:
            pass  # settled below
        except BaseException:
            for reader in loader.readers:
                reader.close()
            raise
        for i, (start, end, key, ids, source) in enumerate(loaded):
            if isinstance(source, LayerReader):
                entry = self.store.finish_layers(source, loader.errors.get(source))
                if entry is None:
                    walk = None
                    entry = self._unreadable(key, ids, plan.promised)
                loaded[i] = (start, end, key, ids, entry)
        return out, walk

    def _open_all(self, chunks: list) -> list[ChunkKV | LayerReader | None]:
        """``_open`` of each ``(chunk, ids)``. On a GPU, several at once in
        threads: a whole read from disk or Redis (and its checksum) runs
        without the GIL, and one thread reads a file tier at well under the
        bus's speed (0.8 GB/s from the page cache on an H200's host, where
        the walk copies 19 GB/s). Elsewhere (a CPU, whose cores compute the
        walk) one after another, in order."""
        if self.model.device.type != "cuda" or len(chunks) < 2:
            return [self._open(chunk.key, ids) for chunk, ids in chunks]
        return list(_read_pool().map(lambda c: self._open(c[0].key, c[1]), chunks))

    def _open(self, key: str, ids: list[int]) -> ChunkKV | LayerReader | None:
        """A chunk's entry from the store (or a reader of its layers, with
        pipelined loading); None on a miss. Under tensor parallelism entries
        are read whole: a layer failing to load halfway through one rank's
        walk would leave the other ranks waiting for it."""
        pipelined = self.config.pipelined_loading and self.model.tp is None
        return (self.store.open_layers if pipelined else self.store.get)(key, expect=self._expect(len(ids)))

    def _unreadable(self, key: str, ids: list[int], promised: bool) -> ChunkKV | None:
        """For a chunk not read from the store: None (the walk computes it
        fresh), or, when the plan's usage was reported, its KV computed
        standalone now, so that usage stays true."""
        if not promised:
            return None
        entry = self.compute_chunk(ids, key)
        self._put(entry)
        return entry

    def _put(self, entry: ChunkKV) -> None:
        """Store a computed chunk. One that cannot be stored is logged and
        dropped (it is computed again when next used); the ranks of a
        tensor-parallel group go on in step either way."""
        try:
            self.store.put(entry)
        except Exception:
            logger.exception("storing chunk %s failed; it is computed again when next used", entry.key[:16])

    def _forward(
        self, cache: KVCache, token_ids: Sequence[int], *, loader: LayerLoader | None = None, **options
    ) -> tuple[torch.Tensor | None, WalkStats]:
        """The walk, timed: every walk measures the walk's speed (the time it
        waited for pipelined loads is not compute)."""
        m = self.model
        started = time.perf_counter()
        with torch.inference_mode():
            out, walk = forward(m, cache, torch.tensor(list(token_ids), device=m.device), **options)
        if m.device.type == "cuda":
            torch.cuda.synchronize(m.device)  # the kernels are queued, not done
        waited = loader.waited_s if loader is not None else 0.0
        self.walk_speed.add(walk.token_layers, walk.passes, time.perf_counter() - started - waited)
        return out, walk

    def save_missed(self, stats: PrefillStats) -> None:
        """Store missed chunks with the standalone recipe so the next request
        hits. A chunk that cannot be computed raises (on every rank
        together, under tensor parallelism); one that cannot be stored is logged."""
        missed, stats.missed = stats.missed, {}
        for key, ids in missed.items():
            self._put(self.compute_chunk(ids, key))
