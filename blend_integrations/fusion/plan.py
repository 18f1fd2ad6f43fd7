"""Plan layer: the prefill plan, what happens to each chunk of one request.

Decided once, before any KV moves, by ``Planner.plan``, which both kinds of
engine call: the in-process engines through ``Blender.plan``, and the vLLM
connector's scheduler side, which must report a request's usage before its
worker runs. ``Blender.prefill`` then carries the plan out.

Each chunk is one of:

- ``LOAD``: its stored KV is read and reused (blended or plainly reused);
- ``COMPUTE``: it is in the store, but the loading controller found computing
  its tokens fresh faster than loading them (``controller.py``);
- ``MISS``: it is not in the store: computed fresh, then saved with the
  standalone recipe so that the next request finds it.

A plan whose usage is reported before it runs (``promised``) looks every
chunk up; a chunk planned to load that has left the store or turns out
damaged by the time it is read is then computed standalone and used as
loaded, so the reported usage stays true. Otherwise chunks are looked up only
when the loading controller needs their tiers, and a chunk planned to load
that is not found when read counts as a miss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..calibration import Calibrations, Guard, RatioChoice, choose_ratio
from ..config import CALIBRATION_SOURCES, BlendConfig, check_schedule
from ..cost import Speed, WalkSpeed
from ..store import ChunkStore, chunk_key
from .controller import LoadingStats, decide

LOAD, COMPUTE, MISS = "load", "compute", "miss"


@dataclass(frozen=True)
class ChunkKeys:
    """How a model names its chunks in the store: everything in a chunk's
    key but its tokens. One per model; every key is made here."""

    fingerprint: str  # the checkpoint's (``store.model_fingerprint``)
    dtype: Any  # the KV dtype: a torch.dtype or its name
    bos_token_id: int | None  # the BOS the tokenizer adds, part of the standalone recipe

    def __call__(self, token_ids: Sequence[int]) -> str:
        return chunk_key(
            fingerprint=self.fingerprint, dtype=self.dtype, token_ids=token_ids, bos_token_id=self.bos_token_id
        )


@dataclass(frozen=True)
class ChunkPlan:
    start: int  # the chunk's tokens in the prompt, end exclusive
    end: int
    key: str
    action: str  # LOAD, COMPUTE or MISS


@dataclass(frozen=True)
class PrefillPlan:
    mode: str  # "full", "reuse" or "blend"
    ratio: float  # the recompute ratio the walk uses: the floor, or the loading controller's
    chunks: tuple[ChunkPlan, ...]  # none in "full" mode
    sink_tokens: int  # each reused chunk's first tokens, computed fresh (``BlendConfig.sink_tokens``)
    selection: str = "deviation"  # how a check layer picks the tokens it recomputes (``BlendConfig.selection``)
    promised: bool = False  # its usage was reported before it ran
    loading: LoadingStats | None = None  # the loading controller's decisions, when it ran
    ratio_source: str = "request"  # where ``ratio`` came from (``config.RATIO_SOURCES``)
    guard: Guard | None = None  # may raise the ratio in the walk (calibrated "auto" only)
    check_layers: tuple[int, ...] = (1,)  # where the walk measures deviation (``BlendConfig.check_layers``)
    deviation: str = "v"  # what it compares there (``BlendConfig.deviation``)
    calibration_dtype: str | None = None  # the dtype of the calibration ``ratio`` came from (``RatioChoice.dtype``)
    question_end: int | None = None  # where the question's own tokens end (``TokenizedPrompt.question_end``)

    def schedule(self, ratio: float) -> list[tuple[int, float]]:
        """(layer, ratio) per check layer, for ``ratio`` (``config.check_schedule``)."""
        return check_schedule(self.check_layers, ratio)

    @property
    def reports_ratio(self) -> bool:
        """Its usage names a recompute ratio: a blend plan, or one computed in
        full because the calibrated ratio is 1.0 (``in_full``)."""
        return self.mode == "blend" or self.ratio_source in CALIBRATION_SOURCES

    def usage(self) -> dict[str, Any]:
        """The usage the prefill reports (``Usage`` fields), when every chunk
        planned to load is loaded, no token is forced fresh (the walk's
        ``logits=False`` case) and no guard raises the ratio. Where the
        walk's own numbers come later (the vLLM worker's report), they are
        set over these (``engines/vllm_answers.py``)."""
        loaded = [c for c in self.chunks if c.action == LOAD]
        cached = sum(max(0, c.end - c.start - self.sink_tokens) for c in loaded)
        blend = self.reports_ratio
        return {
            "cached_tokens": cached,
            "recomputed_tokens": min(round(self.ratio * cached), cached) if self.mode == "blend" else 0,
            "chunks_hit": len(loaded),
            "chunks_missed": sum(c.action == MISS for c in self.chunks),
            "chunks_computed": sum(c.action == COMPUTE for c in self.chunks),
            "recompute_ratio": self.ratio if blend else None,
            "ratio_source": self.ratio_source if blend else None,
            "calibration_dtype": self.calibration_dtype if blend else None,
        }


def in_full(choice: RatioChoice) -> bool:
    """A calibration that recomputes every token (no ratio below 1.0 held
    its target) is run as full prefill: the same KV, without the blend
    pass's extra work. An explicit ratio of 1.0 still blends."""
    return choice.source in CALIBRATION_SOURCES and choice.ratio >= 1.0 and choice.guard is None


def measured_rates(store: ChunkStore, speed: WalkSpeed | None) -> dict[str, float | None]:
    """What the loading controller estimates with: each store tier's read
    bandwidth in bytes/s, "compute", the walk's token-layers per second (None
    until measured), "pass", a walk pass's fixed cost in seconds, and "scoring", a query
    selection's scoring in seconds (``WalkSpeed``; plain numbers, which cross vLLM's processes)."""
    rates = {tier: rate.value for tier, rate in store.read_rates.items()}
    fit = speed.fitted() if speed is not None else None
    if fit is None:
        return rates | {"compute": None, "pass": 0.0, "scoring": 0.0}
    return rates | {"compute": fit.throughput, "pass": fit.pass_s, "scoring": fit.scoring_s}


def walk_speed(rates: dict[str, float | None]) -> Speed | None:
    """The walk's ``Speed`` from ``measured_rates``; None until measured."""
    compute = rates.get("compute")
    if not compute:
        return None
    return Speed(1.0 / compute, rates.get("pass") or 0.0, rates.get("scoring") or 0.0)


def _bandwidth(rates: dict[str, float | None], tier: str) -> float:
    bandwidth = rates.get(tier)
    if not bandwidth:  # every tier starts from an assumed bandwidth (``ChunkStore(read_bandwidth=)``)
        raise ValueError(f"no read bandwidth for the store's {tier} tier")
    return bandwidth


@dataclass(frozen=True)
class Planner:
    """Makes the prefill plans of one model's requests: what every plan of
    that model shares (its settings, its chunk keys, its depth)."""

    config: BlendConfig
    keys: ChunkKeys
    num_layers: int
    # the model's calibration in the store, for recompute_ratio="auto" (None: the fallback ratio)
    calibrations: Calibrations | None = None

    def choose(self, ratio: float | str | None) -> RatioChoice:
        """A blend request's ratio and where it comes from (``choose_ratio``)."""
        return choose_ratio(ratio, self.config, self.calibrations)

    def plan(
        self,
        token_ids: Sequence[int],
        chunk_spans: Sequence[tuple[int, int]],
        *,
        mode: str,
        ratio: float | str | None,
        store: ChunkStore,
        rates: dict[str, float | None],
        settings: dict[str, Any] | None = None,
        promise: bool = False,
        question_end: int | None = None,
    ) -> PrefillPlan:
        """The plan for prefilling ``token_ids`` with chunks at ``chunk_spans``
        from ``store``.

        ratio: the request's recompute ratio (None: the config's; "auto":
        the calibrated one, ``choose_ratio``), the floor the loading
        controller may raise. settings: the request's own blend settings
        (``config.SETTINGS``), over the calibrated policy's under "auto", over
        the config's. rates: ``measured_rates`` where the walk runs. promise:
        the caller reports the plan's usage before it runs (see the module's
        docstring). Raises ValueError for settings that do not apply."""
        if mode == "full":
            s = self.config.with_settings(settings)
            return PrefillPlan(mode, 1.0, (), s.sink_tokens, s.selection, promise, ratio_source="request")
        choice = self.choose(ratio) if mode == "blend" else RatioChoice(0.0, "request")  # reuse: none recomputed
        floor, source, guard = choice.ratio, choice.source, choice.guard
        s = self.config.with_settings(choice.settings).with_settings(settings, num_layers=self.num_layers)

        def planned(mode: str, ratio: float, chunks: tuple[ChunkPlan, ...], loading=None) -> PrefillPlan:
            return PrefillPlan(
                mode,
                ratio,
                chunks,
                s.sink_tokens,
                s.selection,
                promise,
                loading,
                source,
                guard,
                s.check_layers,
                s.deviation,
                choice.dtype,
                question_end,
            )

        if in_full(choice):
            return planned("full", 1.0, ())
        spans = [(int(a), int(b)) for a, b in chunk_spans]
        chunk_keys = [self.keys(token_ids[a:b]) for a, b in spans]
        control = mode == "blend" and s.loading_controller
        if not (promise or control):
            # Nothing to decide before reading: a chunk not found when read is a miss.
            chunks = tuple(ChunkPlan(a, b, key, LOAD) for (a, b), key in zip(spans, chunk_keys))
            return planned(mode, floor, chunks)
        found: list[tuple[int, str, int]] = []  # (chunk, tier, bytes) of the chunks in the store
        for i, key in enumerate(chunk_keys):
            where = store.locate(key)
            if where.tier is not None:
                found.append((i, where.tier, where.nbytes))
        actions = [MISS] * len(spans)
        for i, _, _ in found:
            actions[i] = LOAD
        loading = None
        if control:
            decided, loading = decide(
                [tier for _, tier, _ in found],
                [max(0, spans[i][1] - spans[i][0] - s.sink_tokens) for i, _, _ in found],
                [nbytes / _bandwidth(rates, tier) for _, tier, nbytes in found],
                num_tokens=len(token_ids),
                num_layers=self.num_layers,
                schedule=s.check_schedule,
                floor=floor,
                speed=walk_speed(rates),
                overlapped=s.pipelined_loading,
                query_pass=s.selection != "deviation",
                prefix=spans[0][0] + s.sink_tokens,  # before the first reused token, or fewer
            )
            floor = decided.ratio
            for (i, _, _), load in zip(found, decided.load):
                actions[i] = LOAD if load else COMPUTE
        chunks = tuple(ChunkPlan(a, b, key, action) for (a, b), key, action in zip(spans, chunk_keys, actions))
        return planned(mode, floor, chunks, loading)
