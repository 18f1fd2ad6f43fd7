"""Chunks, store and walk together: the part every engine shares.

An engine (the transformers engine in-process, the vLLM connector inside a
vLLM worker) wraps its model as a ``LayerModel`` and hands prompts with chunk
spans to a ``Blender``; the Blender finds chunks in the store, runs the walk,
and computes and saves missed chunks with the standalone recipe.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..config import BlendConfig
from ..store import ChunkKV, ChunkStore, chunk_key
from ..store.layered import LayerReader
from ..store.rate import Rate
from .controller import LoadingStats, decide
from .layers import LayerModel
from .pipeline import LayerLoader, LoadFailed
from .walk import KVCache, ReusedSpan, WalkStats, forward


@dataclass
class PrefillStats:
    cached_tokens: int = 0  # prompt tokens whose KV came from the store
    recomputed_tokens: int = 0  # of those, the ones blending recomputed
    chunks_hit: int = 0  # chunks loaded from the store
    chunks_missed: int = 0  # chunks not in the store: computed, and saved after
    chunks_recomputed: int = 0  # chunks in the store the loading controller computed instead
    loading: LoadingStats | None = None  # the loading controller's decisions, when it ran
    missed: dict[str, list[int]] = field(default_factory=dict, repr=False)  # key -> ids, to save


def planned_usage(
    chunk_lengths: Sequence[int], hits: Sequence[bool], *, mode: str, ratio: float, sink_tokens: int,
    chunks_recomputed: int = 0,
) -> dict[str, int]:
    """The usage a prefill will report, known before it runs: what the walk
    counts when no token is forced fresh (its ``logits=False`` case). Lets a
    scheduler report usage without waiting for the worker. ``hits``: the
    chunks to load; of the others, ``chunks_recomputed`` are stored chunks
    the loading controller chose to compute, the rest are misses."""
    cached = sum(max(0, n - sink_tokens) for n, hit in zip(chunk_lengths, hits) if hit) if mode != "full" else 0
    recomputed = round(ratio * cached) if mode == "blend" else 0
    return {
        "cached_tokens": cached,
        "recomputed_tokens": min(recomputed, cached),
        "chunks_hit": sum(map(bool, hits)) if mode != "full" else 0,
        "chunks_missed": (len(hits) - sum(map(bool, hits)) - chunks_recomputed) if mode != "full" else 0,
        "chunks_recomputed": chunks_recomputed if mode != "full" else 0,
    }


class Blender:
    def __init__(
        self,
        model: LayerModel,
        store: ChunkStore,
        config: BlendConfig,
        *,
        fingerprint: str,
        bos_token_id: int | None,
    ) -> None:
        if config.check_layers[-1] >= model.num_layers:
            raise ValueError(f"check_layers {config.check_layers} must be below the model's {model.num_layers} layers")
        self.model = model
        self.store = store
        self.config = config
        self.fingerprint = fingerprint
        self.bos = bos_token_id
        self.dtype_name = str(model.dtype).removeprefix("torch.")
        # Token-layers per second of this model's walk, measured on every prefill.
        self.compute_rate = Rate()

    def key(self, token_ids: Sequence[int]) -> str:
        return chunk_key(fingerprint=self.fingerprint, dtype=self.dtype_name, token_ids=token_ids, bos_token_id=self.bos)

    def _expect(self, n: int):
        m = self.model
        return (m.num_layers, m.num_kv_heads, n, m.head_dim, m.dtype)

    def compute_chunk(self, token_ids: Sequence[int], key: str | None = None) -> ChunkKV:
        """The standalone recipe: ``[BOS] + chunk`` at positions 0..n, BOS row
        dropped, K before RoPE."""
        m = self.model
        ids = ([self.bos] if self.bos is not None else []) + list(token_ids)
        record = torch.empty((m.num_layers, 2, m.num_kv_heads, len(ids), m.head_dim), dtype=m.dtype, device=m.device)
        self._forward(KVCache.allocate(m, len(ids)), ids, record=record, logits=False)
        skip = 1 if self.bos is not None else 0
        return ChunkKV(key or self.key(token_ids), record[:, :, :, skip:].to("cpu").contiguous())

    def ensure(self, token_ids: Sequence[int]) -> bool:
        """Compute and store a chunk unless the store has it; True if computed."""
        key = self.key(token_ids)
        if self.store.get(key, expect=self._expect(len(token_ids))) is not None:
            return False
        self.store.put(self.compute_chunk(token_ids, key))
        return True

    def prefill(
        self,
        cache: KVCache,
        token_ids: Sequence[int],
        chunk_spans: Sequence[tuple[int, int]],
        *,
        mode: str,
        recompute_ratio: float | None = None,
        logits: bool = True,
        hits: Sequence[bool] | None = None,
        computed: Sequence[bool] | None = None,
    ) -> tuple[torch.Tensor | None, PrefillStats]:
        """Prefill ``token_ids`` into an empty ``cache``; chunks at ``chunk_spans``
        are reused in "reuse" and "blend" modes. Call ``save_missed`` after.

        hits: which chunks a scheduler already counted as hits (and decided
        to load). Those are reused even if they left the store since
        (recomputed standalone now), and the others are fresh, so the usage
        it reported stays true. computed: of the others, those in the store
        that its loading controller chose to compute: not saved again."""
        stats = PrefillStats()
        floor = self.config.recompute_ratio if recompute_ratio is None else recompute_ratio
        ratio = floor
        loaded = []  # (start, end, key, ids, ChunkKV or LayerReader) of the chunks reused
        if mode != "full":
            chunks = []  # (start, end, key, ids) of the chunks to read from the store
            for i, (start, end) in enumerate(chunk_spans):
                ids = list(token_ids[start:end])
                key = self.key(ids)
                if hits is not None and not hits[i]:
                    if computed is not None and computed[i]:
                        stats.chunks_recomputed += 1
                    else:
                        stats.missed[key] = ids
                else:
                    chunks.append((start, end, key, ids))
            # With ``hits`` a scheduler has decided (its loading controller too) and reported the usage.
            if mode == "blend" and self.config.loading_controller and hits is None:
                chunks, ratio = self._control(chunks, len(token_ids), floor, stats)
            for start, end, key, ids in chunks:
                source = self._open(key, ids, hits)
                if source is None:
                    stats.missed[key] = ids
                else:
                    loaded.append((start, end, key, ids, source))
        schedule = self.config.check_schedule(ratio) if mode == "blend" else None
        first = cache.length
        while True:
            out, walk = self._walk(cache, token_ids, loaded, schedule=schedule, logits=logits, hits=hits)
            if walk is not None:
                break
            # A chunk failed to read or verify after its bytes may have been
            # used: it becomes a missed chunk, and the walk starts over.
            for i in [i for i, (*_, source) in enumerate(loaded) if source is None][::-1]:
                _, _, key, ids, _ = loaded.pop(i)
                stats.missed[key] = ids
            cache.length = first
        stats.chunks_hit = len(loaded)
        if mode != "full":
            stats.chunks_missed = len(chunk_spans) - stats.chunks_hit - stats.chunks_recomputed
        stats.cached_tokens, stats.recomputed_tokens = walk.reused_tokens, walk.recomputed_tokens
        return out, stats

    def _walk(self, cache: KVCache, token_ids, loaded: list, *, schedule, logits: bool, hits):
        """One walk with the ``loaded`` chunks, reading the layers of those
        still in the store meanwhile (pipelined loading). Every reader is then
        settled: ``loaded`` holds its entry, or None if it failed, and the
        walk's stats are None if any did (its result must not be used)."""
        sink = self.config.sink_tokens
        loader = LayerLoader([source for *_, source in loaded if isinstance(source, LayerReader)])
        reused = [
            ReusedSpan(start + sink, source.kv[:, :, :, sink:],
                       loader.ready(source) if isinstance(source, LayerReader) else None)
            for start, end, _, _, source in loaded
            if end - start > sink
        ]
        out = walk = None
        try:
            with loader:
                out, walk = self._forward(cache, token_ids, reused=reused, schedule=schedule,
                                          deviation=self.config.deviation, logits=logits, loader=loader)
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
                    entry = self._unreadable(key, ids, hits)
                loaded[i] = (start, end, key, ids, entry)
        return out, walk

    def _open(self, key: str, ids: list[int], hits) -> ChunkKV | LayerReader | None:
        """A chunk's entry from the store (or a reader of its layers, with
        pipelined loading); None on a miss."""
        expect = self._expect(len(ids))
        source = (self.store.open_layers if self.config.pipelined_loading else self.store.get)(key, expect=expect)
        return source if source is not None else self._unreadable(key, ids, hits)

    def _unreadable(self, key: str, ids: list[int], hits) -> ChunkKV | None:
        """For a chunk not read from the store: None (the walk computes it
        fresh), or, when a scheduler counted it as a hit, its KV computed
        standalone now, so the usage it reported stays true."""
        if hits is None:
            return None
        entry = self.compute_chunk(ids, key)
        self.store.put(entry)
        return entry

    def _control(self, chunks: list, num_tokens: int, floor: float, stats: PrefillStats) -> tuple[list, float]:
        """The loading controller (see ``controller.py``): of the chunks in the
        store, which to load, and the ratio. The others are computed fresh."""
        found, located = [], []
        for chunk in chunks:
            where = self.store.locate(chunk[2])
            if where.tier is None:
                stats.missed[chunk[2]] = chunk[3]
            else:
                found.append(chunk)
                located.append(where)
        sink = self.config.sink_tokens
        p, stats.loading = decide(
            [where.tier for where in located],
            [max(0, end - start - sink) for start, end, _, _ in found],
            [self.store.load_seconds(where) for where in located],
            num_tokens=num_tokens, num_layers=self.model.num_layers, schedule=self.config.check_schedule,
            floor=floor, throughput=self.compute_rate.value,
            overlapped=self.config.pipelined_loading,
        )
        stats.chunks_recomputed = stats.loading.chunks_recomputed
        return [chunk for chunk, load in zip(found, p.load) if load], p.ratio

    def _forward(
        self, cache: KVCache, token_ids: Sequence[int], *, loader: LayerLoader | None = None, **options
    ) -> tuple[torch.Tensor | None, WalkStats]:
        """The walk, timed: every prefill measures the compute throughput (the
        time it waited for pipelined loads is not compute)."""
        m = self.model
        started = time.perf_counter()
        with torch.inference_mode():
            out, walk = forward(m, cache, torch.tensor(list(token_ids), device=m.device), **options)
        if m.device.type == "cuda":
            torch.cuda.synchronize(m.device)  # the kernels are queued, not done
        waited = loader.waited_s if loader is not None else 0.0
        self.compute_rate.add(walk.token_layers, time.perf_counter() - started - waited)
        return out, walk

    def save_missed(self, stats: PrefillStats) -> None:
        """Store missed chunks with the standalone recipe so the next request hits."""
        for key, ids in stats.missed.items():
            self.store.put(self.compute_chunk(ids, key))
        stats.missed = {}
