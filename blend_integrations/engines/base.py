"""Engines layer: the engine API every backend implements, and what a generation returns."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from typing_extensions import Unpack

from ..calibration import CalibrationRecord, Calibrations, calibrate, exclusive, record_name
from ..config import BlendConfig, check_mode, check_ratio
from ..fusion.controller import LoadingStats
from ..fusion.plan import ChunkKeys
from ..prompt import PromptError, PromptInput, TextOrIds, TokenizedPrompt, bos_id_added, tokenize_prompt
from ..store import ChunkStore
from .decoding import check_sampling
from .quality_check import QualityChecker

# The ratio sources of a request "auto" planned (``config.RATIO_SOURCES``): the ones a live check judges.
AUTO_SOURCES = ("calibrated", "packaged", "fallback", "guard", "checked")


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the chunk store
    recomputed_tokens: int = 0  # of the cached tokens, those blending recomputed anyway
    chunks_hit: int = 0  # chunks whose KV was loaded from the store
    chunks_missed: int = 0  # chunks not in the store (computed, and stored after the answer)
    chunks_computed: int = 0  # chunks in the store that the loading controller computed instead of loading
    # The ratio blending used and where it came from: "calibrated" (the store's calibration, for
    # recompute_ratio="auto"), "packaged" (the calibration shipped for this model and engine), "fallback"
    # ("auto" without either), "request", "config", or "guard" (the
    # per-request guard raised the calibrated ratio); None when the prompt was not blended.
    recompute_ratio: float | None = None
    ratio_source: str | None = None
    # The dtype the calibration behind the ratio was measured in (a calibration serves every
    # floating-point dtype of its model: ``calibration.SERVES_DTYPES``); None when the ratio came from none.
    calibration_dtype: str | None = None
    # The share of the score the check layer ranks the reused tokens by (their deviation; for a
    # selection by the query, the query's attention) that the recomputed ones hold; None when
    # nothing was blended.
    ranking_captured: float | None = None
    # Whether this answer is checked against full prefill after it was given (``BlendConfig.quality_check``);
    # not compared: two answers blended alike are equal whether or not one was picked for a check.
    quality_checked: bool = field(default=False, compare=False)

    @property
    def chunks_recomputed(self) -> int:
        """Deprecated name of ``chunks_computed`` (0.x): those chunks were computed, never recomputed."""
        warnings.warn("Usage.chunks_recomputed is deprecated: use chunks_computed", DeprecationWarning, stacklevel=2)
        return self.chunks_computed

    @property
    def deviation_captured(self) -> float | None:
        """Deprecated name of ``ranking_captured`` (0.x): under a selection by the query it holds
        the query's attention, not deviation."""
        warnings.warn("Usage.deviation_captured is deprecated: use ranking_captured", DeprecationWarning, stacklevel=2)
        return self.ranking_captured


@dataclass
class Generation:
    text: str
    token_ids: list[int]  # the generated tokens, the end token that stopped them included (as vLLM returns them)
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    ttft_s: float  # call start to first token, tokenization and store reads included
    usage: Usage
    mode: str
    logprobs: list[dict[int, float]] | None = None  # per decoding step (an end token's too): top-k and the chosen token
    total_s: float = 0.0
    loading: LoadingStats | None = None  # the loading controller's decisions, when it ran
    # Why the prompt was computed in full although blending was asked for (the
    # vLLM engine: its blend pass failed and vLLM recomputed it), else None.
    fallback: str | None = None
    # ``ranking_share(r)``: the share of the check layer's ranking score (as for
    # ``usage.ranking_captured``, which is it at the ratio used) that the top ``r`` of the reused
    # tokens hold, for any ratio; calibration simulates the guard with it. None where the engine
    # does not report it.
    ranking_share: Callable[[float], float] | None = field(default=None, repr=False, compare=False)
    # The prompt's tokens whose KV came from the chunk store, as [start, end) spans of
    # ``prompt_token_ids``, and of those the ones blending recomputed ("reuse" recomputes none):
    # what blending did to each token. Empty when nothing was reused; None where the engine does
    # not report it (the server client).
    reused_spans: tuple[tuple[int, int], ...] | None = field(default=None, repr=False, compare=False)
    recomputed_positions: tuple[int, ...] | None = field(default=None, repr=False, compare=False)

    @property
    def deviation_share(self) -> Callable[[float], float] | None:
        """Deprecated name of ``ranking_share`` (0.x)."""
        warnings.warn("Generation.deviation_share is deprecated: use ranking_share", DeprecationWarning, stacklevel=2)
        return self.ranking_share

    def stats(self) -> dict:
        """What the call reused and recomputed, and how soon it answered (a flat
        dict: the integrations put it in their responses' metadata), plus
        ``loading`` (a dict of ``LoadingStats``) when the loading controller
        ran and ``fallback`` when the prompt was computed in full instead of blended."""
        stats = {
            "mode": self.mode,
            "finish_reason": self.finish_reason,
            "ttft_s": self.ttft_s,
            **dataclasses.asdict(self.usage),
        }
        if self.loading is not None:
            stats["loading"] = dataclasses.asdict(self.loading)
        if self.fallback is not None:
            stats["fallback"] = self.fallback
        return stats


class GenerateOptions(TypedDict, total=False):
    """The options of ``Engine.generate`` and ``stream`` (defaults: ``Engine._request``)."""

    max_tokens: int  # 256
    temperature: float  # 0.0: greedy
    top_p: float  # 1.0
    stop: str | Sequence[str] | None  # stop strings
    seed: int | None  # sampling seed
    mode: str  # "blend" (default), "reuse" or "full"
    recompute_ratio: float | str | None  # None: the engine config's; "auto": the calibrated one
    selection: str | None  # how recomputed tokens are chosen; None: the engine config's
    check_layers: Sequence[int] | None  # the blend settings (``BlendConfig``); None: the engine's,
    deviation: str | None  # or under "auto" the calibrated policy's
    sink_tokens: int | None
    logprobs: int | None  # return the top-k log-probabilities of every token


@dataclass(frozen=True)
class Request:
    """One validated, tokenized generation request."""

    prompt: TokenizedPrompt
    max_tokens: int
    temperature: float
    top_p: float
    stop: list[str]
    seed: int | None
    mode: str
    recompute_ratio: float | str | None  # None: the engine's configured ratio; "auto": the calibrated one
    # The request's own blend settings (``config.SETTINGS``): only those it set.
    settings: dict[str, Any]
    logprobs: int | None
    started: float  # perf_counter() when the call came in: time to first token counts from here
    checking: bool = False  # a live check's full prefill (``quality_check``): never offered, counted or shown


@dataclass
class GenerationStream:
    """Iterates over text deltas; ``generation`` is set once it is exhausted."""

    _deltas: Iterator[str]
    generation: Generation | None = field(default=None)

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> str:
        return next(self._deltas)

    def result(self) -> Generation:
        """The whole generation, once the stream is exhausted."""
        if self.generation is None:
            raise RuntimeError("the stream is not exhausted yet: iterate over it first")
        return self.generation

    def close(self) -> None:
        close = getattr(self._deltas, "close", None)
        if close is not None:
            close()


class AsyncGenerationStream:
    """Async iteration over an engine's ``stream``, run in a worker thread."""

    def __init__(self, engine: Engine, prompt, kwargs: dict) -> None:
        self._engine, self._prompt, self._kwargs = engine, prompt, kwargs
        self._stream: GenerationStream | None = None
        self._deltas: asyncio.Queue | None = None

    @property
    def generation(self) -> Generation | None:
        return self._stream.generation if self._stream is not None else None

    def result(self) -> Generation:
        """The whole generation, once the stream is exhausted."""
        if self.generation is None:
            raise RuntimeError("the stream is not exhausted yet: iterate over it first")
        return self.generation

    def __aiter__(self) -> AsyncGenerationStream:
        return self

    async def __anext__(self) -> str:
        if self._deltas is None:
            loop = asyncio.get_running_loop()
            self._deltas = asyncio.Queue()
            self._stream = await asyncio.to_thread(self._engine.stream, self._prompt, **self._kwargs)
            threading.Thread(target=self._pump, args=(loop, self._stream, self._deltas), daemon=True).start()
        item = await self._deltas.get()
        if item is StopAsyncIteration:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    @staticmethod
    def _pump(loop, stream: GenerationStream, deltas: asyncio.Queue) -> None:
        try:
            for delta in stream:
                loop.call_soon_threadsafe(deltas.put_nowait, delta)
            loop.call_soon_threadsafe(deltas.put_nowait, StopAsyncIteration)
        except BaseException as exc:  # hand errors to the awaiting side
            loop.call_soon_threadsafe(deltas.put_nowait, exc)


def engine_store(store: ChunkStore | None, config: BlendConfig) -> ChunkStore:
    """The store an engine uses: ``store``, which must keep chunks in the
    config's ``kv_codec`` when that is set; None: the default store, in it."""
    if store is None:
        return ChunkStore(kv_codec=config.kv_codec)
    if config.kv_codec is not None and store.kv_codec != config.kv_codec:
        raise ValueError(
            f"BlendConfig(kv_codec={config.kv_codec!r}), but the store given keeps chunks as {store.kv_codec!r}: "
            f"make it ChunkStore(..., kv_codec={config.kv_codec!r}), or leave kv_codec out of the config"
        )
    return store


class Engine(ABC):
    """A model plus a chunk store, generating from blend prompts."""

    backend: str
    model_name: str
    config: BlendConfig
    store: ChunkStore
    context_length: int
    fingerprint: str
    dtype_name: str
    num_layers: int | None = None  # the model's decoder layers (None: not known here, e.g. over HTTP)

    @property
    @abstractmethod
    def tokenizer(self): ...

    def tokenize(self, prompt: PromptInput) -> TokenizedPrompt:
        tp = tokenize_prompt(prompt, self.tokenizer, self.config.separator)
        if len(tp) >= self.context_length:
            raise PromptError(
                f"the prompt has {len(tp)} tokens but the model's context is {self.context_length} tokens "
                "(a prompt must leave room for at least one generated token); retrieve fewer or shorter documents"
            )
        return tp

    @property
    def kv_codec(self) -> str | None:
        """How this engine's store keeps chunk KV (``ChunkStore.kv_codec``)."""
        return self.store.kv_codec

    def chunk_key(self, token_ids: Sequence[int]) -> str:
        return ChunkKeys(self.fingerprint, self.dtype_name, bos_id_added(self.tokenizer))(token_ids)

    def generate(self, prompt: PromptInput, **options: Unpack[GenerateOptions]) -> Generation:
        """See ``stream`` for the options."""
        stream = self.stream(prompt, **options)
        for _ in stream:
            pass
        return stream.result()

    def stream(self, prompt: PromptInput, **options: Unpack[GenerateOptions]) -> GenerationStream:
        """Generate, yielding text deltas.

        mode: "full" (ordinary prefill, the reference), "reuse" (cached chunks
        loaded at their new positions, only fresh tokens computed) or "blend"
        (CacheBlend). recompute_ratio, selection, check_layers, deviation
        and sink_tokens override the engine config's (``BlendConfig``) and,
        under ``recompute_ratio="auto"``, the calibrated policy's.
        logprobs: also return the top-k log-probabilities of every token.
        The other options and their defaults: ``GenerateOptions``.
        """
        request = self._request(prompt, **options)
        stream = GenerationStream(iter(()))
        stream._deltas = self._run(request, stream)
        return stream

    def _request(
        self,
        prompt: PromptInput,
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        mode: str = "blend",
        recompute_ratio: float | str | None = None,
        selection: str | None = None,
        check_layers: Sequence[int] | None = None,
        deviation: str | None = None,
        sink_tokens: int | None = None,
        logprobs: int | None = None,
    ) -> Request:
        """Check the options, apply their defaults and tokenize: what every engine does first."""
        started = time.perf_counter()
        check_mode(mode)
        check_sampling(max_tokens, temperature, top_p, logprobs)
        ratio = recompute_ratio
        if ratio is not None and ratio != "auto":
            ratio = check_ratio(ratio, auto=True)  # type: ignore[arg-type]  # any other str fails here
        given = {"check_layers": check_layers, "deviation": deviation, "sink_tokens": sink_tokens}
        settings = {k: v for k, v in (given | {"selection": selection}).items() if v is not None}
        checked = self.config.with_settings(settings, num_layers=self.num_layers).settings()  # ValueError if bad
        settings = {k: checked[k] for k in settings}  # as plain values: check_layers a list
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        return Request(
            self.tokenize(prompt),
            max_tokens,
            temperature,
            top_p,
            stops,
            seed,
            mode,
            ratio,
            settings,
            logprobs,
            started,
        )

    @abstractmethod
    def _run(self, request: Request, stream: GenerationStream) -> Iterator[str]:
        """Yield text deltas and set ``stream.generation`` at the end."""

    @property
    def quality_checker(self) -> QualityChecker:
        """This engine's live checks (``BlendConfig.quality_check``), made on first use."""
        checker = self.__dict__.get("_quality_checker")
        if checker is None:
            checker = self.__dict__.setdefault(
                "_quality_checker", QualityChecker(self, self.config.quality_check, self.config.quality_check_risk)
            )
        return checker

    def _answered(self, request: Request, generation: Generation) -> Generation:
        """An answer about to be handed over: picked for a live check or not (``Usage.quality_checked``).
        Only a greedy ``"auto"`` answer blended from stored chunk KV may be: not sampled, not in
        ``reuse`` or ``full`` mode, not at a ratio of its own, not fallen back, not run in full."""
        usage = generation.usage
        generation.usage.quality_checked = (
            not request.checking
            and request.mode == "blend"
            and request.temperature == 0
            and generation.fallback is None
            and usage.ratio_source in AUTO_SOURCES
            and usage.recompute_ratio is not None
            and usage.recompute_ratio < 1.0
            and usage.cached_tokens > 0  # nothing reused (every chunk missed): full prefill's answer
            and bool(generation.token_ids)
            and self.quality_checker.offer(request.prompt, generation.token_ids, request.max_tokens)
        )
        return generation

    def idle(self) -> bool:
        """Whether no user request is in flight (a live check waits for it)."""
        return True

    def full_prefill_tokens(self, prompt: TokenizedPrompt, tokens: int) -> list[int]:
        """Full prefill's first ``tokens`` greedy tokens of ``prompt``: a live check's run."""
        request = dataclasses.replace(self._request(prompt, max_tokens=tokens, mode="full"), checking=True)
        stream = GenerationStream(iter(()))
        for _ in self._run(request, stream):
            pass
        return stream.result().token_ids

    def quality_check_stats(self) -> dict:
        """The live checks this engine ran, and the state in use (``QualityChecker.stats``)."""
        return self.quality_checker.stats()

    def generate_many(self, prompts: Sequence[PromptInput], **kwargs) -> list[Generation]:
        """Generate for several prompts; engines that batch run them together."""
        return [self.generate(p, **kwargs) for p in prompts]

    async def agenerate(self, prompt: PromptInput, **kwargs) -> Generation:
        """``generate`` without blocking the event loop."""
        return await asyncio.to_thread(self.generate, prompt, **kwargs)

    def astream(self, prompt: PromptInput, **kwargs) -> AsyncGenerationStream:
        """``stream`` without blocking the event loop: text deltas as they
        come; ``generation`` is set once it is exhausted."""
        return AsyncGenerationStream(self, prompt, kwargs)

    @abstractmethod
    def warm(self, chunks: Iterable[TextOrIds], *, progress: bool | None = None) -> int:
        """Compute and store the KV of chunks not yet in the store; returns how many were computed."""

    @property
    @abstractmethod
    def calibrations(self) -> Calibrations:
        """This model's calibration in the store (what ``recompute_ratio="auto"`` uses)."""

    def stored_documents(self, limit: int = 256) -> list[str]:
        """The texts of up to ``limit`` of this model's chunks in the store,
        most recently used first (``ChunkStore.chunk_token_ids``): what
        ``calibrate`` probes with when given no documents."""
        return [self.tokenizer.decode(ids) for ids in self.store.chunk_token_ids(self.chunk_key, limit=limit)]

    def calibration(self) -> CalibrationRecord | None:
        """The calibration record ``recompute_ratio="auto"`` uses now (the user's
        own in the store, else the one the package ships for this model); None:
        neither (or a refused one), so the fallback ratio."""
        return self.calibrations.record()

    def calibration_source(self) -> str:
        """Where ``calibration()`` comes from: "calibrated" (the user's own, in
        the store), "packaged" (shipped with the package), or "fallback" (none)."""
        return self.calibrations.source()

    def calibration_meaning(self) -> str | None:
        """What the packaged calibration of this model on this engine measured,
        in one plain sentence (``PackagedCalibration.meaning``); None where the
        package ships none for it."""
        packaged = self.calibrations.packaged()
        return None if packaged is None else packaged.meaning()

    def calibration_lock(self, name: str) -> contextlib.AbstractContextManager:
        """Held while ``calibrate`` measures: one calibration of a model per store at a time."""
        return exclusive(self.store, name)

    def keep_calibration(self, record: CalibrationRecord) -> None:
        """Store what ``calibrate`` measured, for every engine on the store, and use it now."""
        self.store.put_record(record_name(record.fingerprint, record.dtype, record.kv_codec), record.to_bytes())
        self.calibrations.set(record)

    def calibrate(
        self,
        documents: Sequence[str] | None = None,
        *,
        prompts: Sequence[PromptInput] | Mapping[str, Sequence[PromptInput]] | None = None,
        questions: Sequence[str] | None = None,
        target: float = 0.95,
        **options,
    ) -> CalibrationRecord:
        """Measure the recompute ratio this model needs to agree with full
        prefill on ``target`` of prompts about ``documents`` (your own
        ``questions`` over them where you have some), or on ``prompts`` (a
        mapping of kinds of question to prompts: the worst kind decides),
        store it for every engine on this store, and return it. Options and
        method: ``calibration.calibrate``."""
        return calibrate(self, documents, prompts=prompts, questions=questions, target=target, **options)

    def close(self) -> None:
        """Release what the engine holds (the live checks' thread, the vLLM engine's processes); closing twice is harmless."""
        checker = self.__dict__.get("_quality_checker")
        if checker is not None:
            checker.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
