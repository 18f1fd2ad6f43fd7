"""Engines layer: the production engine, an embedded ``vllm.LLM`` with the blend connector.

One background thread steps vLLM's engine; every request (``generate``,
``stream``, ``generate_many``, the async methods, from any thread) is added
between steps and its outputs are handed to it through a queue, so
concurrent requests are batched by vLLM's scheduler.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Iterable, Iterator, Sequence

from ..calibration import Calibrations
from ..config import BlendConfig
from ..models import check_supported
from ..models.loading import resolve_device, resolve_model_dir
from ..prompt import PromptInput, TextOrIds, TokenizedPrompt
from ..store import ChunkStore, model_fingerprint
from .base import Engine, Generation, GenerationStream, Request, Usage, engine_store
from .blend_metrics import BlendCounters
from .quality_check import CheckPreempted
from .vllm_answers import blend_details
from .vllm_check import SlicedWalk
from .vllm_contract import (
    KV_CACHE_ENV,
    blend_engine_args,
    blend_engine_env,
    blend_results,
    check_tensor_parallel,
    check_vllm_version,
    kv_transfer_params,
)
from .vllm_limits import UnsupportedSetting, refused_settings

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    """Set environment variables for the duration of the block, then restore them."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _refusal(kwargs: dict) -> UnsupportedSetting | None:
    """The connector's refusal of these engine arguments (``vllm_limits``),
    if that is why vLLM did not start: vLLM's own error only points at its
    engine process's log. Checked once vLLM has failed, which costs a
    successful start nothing."""
    from vllm.engine.arg_utils import EngineArgs

    try:
        problems = refused_settings(EngineArgs(**kwargs).create_engine_config())
    except Exception:  # vLLM refused the arguments itself: its error stands
        return None
    return UnsupportedSetting(problems) if problems else None


class VLLMEngine(Engine):
    backend = "vllm"

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        store: ChunkStore | None = None,
        config: BlendConfig | None = None,
        dtype: str = "auto",
        device: str = "auto",
        max_model_len: int | None = None,
        kv_cache_gib: int = 2,
        max_num_seqs: int = 64,
        tensor_parallel_size: int = 1,
        walk_attention: str = "auto",
        **llm_kwargs,
    ) -> None:
        import vllm
        from transformers import AutoConfig, AutoTokenizer
        from vllm.config import KVTransferConfig

        check_vllm_version(vllm.__version__)
        model_dir = resolve_model_dir(model)
        hf_config = AutoConfig.from_pretrained(model_dir)
        check_supported(hf_config)
        self.num_layers = int(hf_config.get_text_config().num_hidden_layers)
        check_tensor_parallel(hf_config, tensor_parallel_size)
        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda' for the vLLM backend, got {device!r}")
        on_gpu = resolve_device(device).type == "cuda"
        self.model_name = str(model)
        self.config = config or BlendConfig()
        self.store = engine_store(store, self.config)
        self._tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.fingerprint = model_fingerprint(model_dir)
        args = blend_engine_args(
            store=self.store,
            config=self.config,
            on_gpu=on_gpu,
            dtype=dtype,
            model_dir=model_dir,
            max_model_len=max_model_len or int(hf_config.max_position_embeddings),
            tensor_parallel_size=tensor_parallel_size,
            walk_attention=walk_attention,
        )
        self.dtype_name = args["dtype"]
        # What "auto" resolves to is decided by the connector's scheduler side, which reads the same
        # record from the store (within calibration.RELOAD_S of a write); this copy is for callers.
        self._calibrations = Calibrations(
            self.store,
            self.fingerprint,
            self.dtype_name,
            engine="vllm",
            num_layers=self.num_layers,
            label=self.model_name,
        )
        kwargs = dict(
            args,
            model=model_dir,
            tokenizer=model_dir,
            kv_transfer_config=KVTransferConfig(**args["kv_transfer_config"]),
            max_num_seqs=max_num_seqs,
            seed=0,
        )
        kwargs.update(llm_kwargs)
        # vLLM starts its processes (and their connectors) in LLM(); they keep
        # the variables, this process gets its own back.
        env = blend_engine_env(self.store, tensor_parallel_size=tensor_parallel_size, on_gpu=on_gpu)
        if not on_gpu and not os.environ.get(KV_CACHE_ENV):
            # The CPU backend reserves its KV cache from host RAM, in GiB, read from its environment
            # while LLM() starts: this engine's own size, not one an earlier engine left behind.
            env[KV_CACHE_ENV] = str(int(kv_cache_gib))
        with _environ(env):
            try:
                self.llm = vllm.LLM(**kwargs)
            except Exception as exc:
                refusal = _refusal(kwargs)
                if refusal is not None:
                    raise refusal from exc
                raise
        self.context_length = int(self.llm.llm_engine.model_config.max_model_len)
        self._ids = itertools.count()
        self._counters = BlendCounters()  # every finished request's blend outcome: ``stats()``
        self._counters_lock = threading.Lock()
        self._requests: dict[str, queue.Queue] = {}  # request id -> its outputs, until finished
        self.checking = False  # a live check walks on the workers (``full_prefill_tokens``)
        self._walk = SlicedWalk()  # a live check's, on the workers
        self._lock = threading.Lock()  # vLLM's engine is not thread-safe
        self._wake = threading.Event()
        self._closed = False
        self._stepper = threading.Thread(target=self._step_loop, name="blend-vllm-stepper", daemon=True)
        self._stepper.start()

    @property
    def tokenizer(self):
        return self._tokenizer

    def __repr__(self) -> str:
        return f"VLLMEngine({self.model_name!r}, dtype={self.dtype_name})"

    # -- the stepping thread -------------------------------------------
    def _step_loop(self) -> None:
        engine = self.llm.llm_engine
        while not self._closed:
            with self._lock:
                busy = engine.has_unfinished_requests()
                outputs = engine.step() if busy else []
            for out in outputs:
                waiting = self._requests.get(out.request_id)
                if waiting is not None:
                    waiting.put(out)
                    if out.finished:
                        self._requests.pop(out.request_id, None)
            if not busy:
                self._wake.wait(timeout=0.05)
                self._wake.clear()

    def close(self) -> None:
        """Stop the stepping thread and vLLM's engine core."""
        if self._closed:
            return
        self._closed = True  # the stepping thread and a live check in flight stop at their next turn
        super().close()
        self._wake.set()
        self._stepper.join(timeout=30)
        with self._lock:
            with contextlib.suppress(Exception):  # the engine is already gone
                self.llm.collective_rpc("blend_check_stop")
                self.llm.collective_rpc("blend_flush")
            shutdown = getattr(self.llm.llm_engine, "engine_core", None)
            if shutdown is not None and hasattr(shutdown, "shutdown"):
                shutdown.shutdown()

    def __del__(self) -> None:
        # Closed already (at interpreter exit the modules it would use may be gone), or never started.
        if getattr(self, "_closed", True):
            return
        with contextlib.suppress(Exception):
            self.close()

    # -- chunks ---------------------------------------------------------
    def warm(self, chunks: Iterable[TextOrIds], *, progress: bool | None = None) -> int:
        from tqdm.auto import tqdm

        ids = [c if not isinstance(c, str) else self._tokenizer.encode(c, add_special_tokens=False) for c in chunks]
        if any(not x for x in ids):
            raise ValueError("cannot warm an empty chunk")
        show = progress if progress is not None else len(ids) > 8
        computed = 0
        batch = 8
        with tqdm(total=len(ids), desc="warming chunk KV", unit="chunk", disable=not show) as bar:
            for i in range(0, len(ids), batch):
                part = [list(x) for x in ids[i : i + batch]]
                with self._lock:
                    computed += self.llm.collective_rpc("blend_warm", args=(part,))[0]
                bar.update(len(part))
        return computed

    @property
    def calibrations(self) -> Calibrations:
        return self._calibrations

    # -- generation -----------------------------------------------------
    def _sampling_params(self, req: Request):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        tp = req.prompt
        params = kv_transfer_params(req, details=True)
        return SamplingParams(
            max_tokens=min(req.max_tokens, self.context_length - len(tp)),
            temperature=req.temperature,
            top_p=req.top_p,
            stop=req.stop or None,
            seed=req.seed,
            logprobs=req.logprobs,
            output_kind=RequestOutputKind.DELTA,
            extra_args={"kv_transfer_params": params} if params else None,
        )

    def idle(self) -> bool:
        return not self._requests

    def full_prefill_tokens(self, prompt: TokenizedPrompt, tokens: int) -> list[int]:
        """A live check's run: full prefill's first ``tokens`` greedy tokens, walked on the workers
        a slice of layers at a time (about ``vllm_check.SLICE_S``) between engine steps while no
        user's request is in flight. A user's request that comes stops it at the next slice
        (``CheckPreempted``)."""
        tokens = min(tokens, self.context_length - len(prompt))
        if tokens < 1:
            raise ValueError(f"a prompt of {len(prompt)} tokens leaves no room in the context of {self.context_length}")

        def call(method: str, args: tuple):
            with self._lock:
                if self._closed or not self.idle():
                    raise CheckPreempted("a user's request arrived")
                return self.llm.collective_rpc(method, args=args)[0]

        def stop() -> None:
            with self._lock:
                if not self._closed:  # else close() stops it
                    self.llm.collective_rpc("blend_check_stop")

        self.checking = True
        try:
            return self._walk.run(call, stop, list(prompt.token_ids), tokens)
        finally:
            self.checking = False

    def _run(self, req: Request, stream: GenerationStream) -> Iterator[str]:
        from vllm.inputs import TokensPrompt

        params = self._sampling_params(req)
        rid = f"blend-{next(self._ids)}"
        outputs: queue.Queue = queue.Queue()
        self._requests[rid] = outputs  # before it waits for the lock: a live check sees it and stops
        self.quality_checker.arrived()
        with self._lock:
            # vLLM 0.32 and 0.33 deprecate raw prompts in add_request; it takes what the
            # engine's renderer makes of one (the raw path ran the same renderer inside).
            engine = self.llm.llm_engine
            (prompt,) = engine.renderer.render_cmpl([TokensPrompt(prompt_token_ids=req.prompt.token_ids)])
            engine.add_request(rid, prompt, params)
        self._wake.set()
        return self._follow(stream, rid, outputs, req)

    def stats(self) -> dict[str, int | float]:
        """Totals over the requests this engine finished, counted as the blend
        series on a server's ``/metrics`` are (``blend_metrics``): requests by
        outcome (``requests_blend``, ``requests_full_<reason>``, ...), reused and
        recomputed tokens, chunks hit, missed and computed, the mean ratio."""
        with self._counters_lock:
            return self._counters.summary()

    def generate_many(self, prompts: Sequence[PromptInput], **kwargs) -> list[Generation]:
        """Submit every prompt at once so vLLM batches them."""
        streams = [self.stream(p, **kwargs) for p in prompts]
        gens = []
        for s in streams:
            for _ in s:
                pass
            assert s.generation is not None  # set once the stream is exhausted
            gens.append(s.generation)
        return gens

    def _answer_of_stopped(self, rid: str) -> dict | None:
        """The connector's answer for a request vLLM stopped on a stop string:
        its front end aborts such a request in the engine core, and the answer
        ``request_finished`` gave is dropped (``vllm_answers.RecentAnswers``)."""
        try:
            with self._lock:
                return self.llm.collective_rpc("blend_answer", args=(rid,))[0]
        except Exception:  # the usage must not fail the answer: it then says nothing was reused
            logger.warning("asking the workers for request %s's blend usage failed", rid, exc_info=True)
            return None

    def _follow(self, stream, rid, outputs, req: Request) -> Iterator[str]:
        tp, t0, mode = req.prompt, req.started, req.mode
        ids: list[int] = []
        text: list[str] = []
        logprobs: list[dict[int, float]] | None = [] if req.logprobs is not None else None
        ttft = None
        finished = False
        try:
            while not finished:
                out = outputs.get()
                finished = out.finished
                completion = out.outputs[0]
                if completion.token_ids and ttft is None:
                    ttft = time.perf_counter() - t0
                ids += completion.token_ids
                if logprobs is not None and completion.logprobs:
                    logprobs += [{t: lp.logprob for t, lp in step.items()} for step in completion.logprobs]
                if completion.text:
                    text.append(completion.text)
                    yield completion.text
            params = out.kv_transfer_params
            if mode != "full" and isinstance(completion.stop_reason, str) and "blend" not in (params or {}):
                params = self._answer_of_stopped(rid) or params
            blend, loading, fallback = blend_results(params)
            details = blend_details(params, len(tp))
            if details is None and not blend.get("cached_tokens"):
                details = ((), (), None)  # nothing was reused
            spans, positions, shares = details or (None, None, None)
            with self._counters_lock:
                self._counters.add(params)
            usage = Usage(prompt_tokens=len(tp), completion_tokens=len(ids), **blend)
            generation = Generation(
                text="".join(text),
                token_ids=ids,
                prompt_token_ids=list(tp.token_ids),
                finish_reason="length" if completion.finish_reason == "length" else "stop",
                ttft_s=ttft if ttft is not None else time.perf_counter() - t0,
                usage=usage,
                mode=mode,
                logprobs=logprobs,
                total_s=time.perf_counter() - t0,
                loading=loading,
                fallback=fallback,
                ranking_share=shares,
                reused_spans=spans,
                recomputed_positions=positions,
            )
            stream.generation = self._answered(req, generation)
        finally:
            if not finished:
                with self._lock:
                    self.llm.llm_engine.abort_request([rid])
                self._requests.pop(rid, None)
