"""Chunks, store and walk together: the part every engine shares.

An engine (the transformers engine in-process, the vLLM connector inside a
vLLM worker) wraps its model as a ``LayerModel`` and hands prompts with chunk
spans to a ``Blender``; the Blender finds chunks in the store, runs the walk,
and computes and saves missed chunks with the standalone recipe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..config import BlendConfig
from ..store import ChunkKV, ChunkStore, chunk_key
from .layers import LayerModel
from .walk import KVCache, ReusedSpan, forward


@dataclass
class PrefillStats:
    cached_tokens: int = 0  # prompt tokens whose KV came from the store
    recomputed_tokens: int = 0  # of those, the ones blending recomputed
    chunks_hit: int = 0
    chunks_missed: int = 0
    missed: dict[str, list[int]] = field(default_factory=dict, repr=False)  # key -> ids, to save


def planned_usage(
    chunk_lengths: Sequence[int], hits: Sequence[bool], *, mode: str, ratio: float, sink_tokens: int
) -> dict[str, int]:
    """The usage a prefill will report, known before it runs: what the walk
    counts when no token is forced fresh (its ``logits=False`` case). Lets a
    scheduler report usage without waiting for the worker."""
    cached = sum(max(0, n - sink_tokens) for n, hit in zip(chunk_lengths, hits) if hit) if mode != "full" else 0
    recomputed = round(ratio * cached) if mode == "blend" else 0
    return {
        "cached_tokens": cached,
        "recomputed_tokens": min(recomputed, cached),
        "chunks_hit": sum(map(bool, hits)) if mode != "full" else 0,
        "chunks_missed": (len(hits) - sum(map(bool, hits))) if mode != "full" else 0,
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
        with torch.inference_mode():
            forward(m, KVCache.allocate(m, len(ids)), torch.tensor(ids, device=m.device), record=record, logits=False)
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
    ) -> tuple[torch.Tensor | None, PrefillStats]:
        """Prefill ``token_ids`` into an empty ``cache``; chunks at ``chunk_spans``
        are reused in "reuse" and "blend" modes. Call ``save_missed`` after.

        hits: which chunks a scheduler already counted as hits. Those are
        reused even if they left the store since (recomputed standalone now),
        and the others are fresh, so the usage it reported stays true."""
        stats = PrefillStats()
        reused = []
        if mode != "full":
            sink = self.config.sink_tokens
            for i, (start, end) in enumerate(chunk_spans):
                ids = list(token_ids[start:end])
                key = self.key(ids)
                if hits is not None and not hits[i]:
                    stats.missed[key] = ids
                    continue
                entry = self.store.get(key, expect=self._expect(len(ids)))
                if entry is None and hits is not None:
                    entry = self.compute_chunk(ids, key)
                    self.store.put(entry)
                if entry is None:
                    stats.missed[key] = ids
                    continue
                stats.chunks_hit += 1
                if end - start > sink:
                    reused.append(ReusedSpan(start + sink, entry.kv[:, :, :, sink:]))
            stats.chunks_missed = len(chunk_spans) - stats.chunks_hit
        ratio = self.config.recompute_ratio if recompute_ratio is None else recompute_ratio
        schedule = self.config.check_schedule(ratio) if mode == "blend" else None
        m = self.model
        with torch.inference_mode():
            out, walk = forward(
                m, cache, torch.tensor(list(token_ids), device=m.device),
                reused=reused, schedule=schedule, deviation=self.config.deviation, logits=logits,
            )
        stats.cached_tokens, stats.recomputed_tokens = walk.reused_tokens, walk.recomputed_tokens
        return out, stats

    def save_missed(self, stats: PrefillStats) -> None:
        """Store missed chunks with the standalone recipe so the next request hits."""
        for key, ids in stats.missed.items():
            self.store.put(self.compute_chunk(ids, key))
        stats.missed = {}
