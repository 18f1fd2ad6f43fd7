"""Engines layer: the reference engine, a Hugging Face model driven by the fusion walk.

Runs anywhere torch runs (CPU or CUDA, fp32 or bf16). Prefill and decode go
through ``fusion.forward`` with the model's own modules; ``mode="full"`` is the
same walk with every token computed, so timings compare like with like.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence

import torch

from ..calibration import Calibrations
from ..config import BlendConfig
from ..fusion import Blender, forward
from ..models import HFDecoder, check_supported
from ..models.loading import dtype_name, end_token_ids, resolve_device, resolve_dtype, resolve_model_dir
from ..prompt import TextOrIds, bos_id_added
from ..store import ChunkKV, ChunkStore, model_fingerprint
from .base import Engine, Generation, GenerationStream, Request, Usage, engine_store
from .decoding import TextAssembler, sample, top_logprobs
from .quality_check import CheckPreempted


class TransformersEngine(Engine):
    backend = "transformers"

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        store: ChunkStore | None = None,
        config: BlendConfig | None = None,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "auto",
        model_fingerprint_override: str | None = None,
    ) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        model_dir = resolve_model_dir(model)
        hf_config = AutoConfig.from_pretrained(model_dir)
        check_supported(hf_config)
        self.model_name = str(model)
        self.config = config or BlendConfig()
        store = engine_store(store, self.config)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device, model_dir)
        self.dtype_name = dtype_name(self.dtype)
        self._tokenizer = AutoTokenizer.from_pretrained(model_dir)
        # The walk calls the model's modules and attends itself; the model's own
        # forward (``hf_model``, for users and tests) must honour soft-capping,
        # which only transformers' eager attention does.
        capped = getattr(hf_config, "attn_logit_softcapping", None) is not None
        hf_model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=self.dtype, **({"attn_implementation": "eager"} if capped else {})
        )
        hf_model = hf_model.to(self.device).eval()
        self.hf_model = hf_model
        self.layers = HFDecoder(hf_model)
        self.num_layers = self.layers.num_layers
        self.context_length = int(hf_model.config.max_position_embeddings)
        self.fingerprint = model_fingerprint_override or model_fingerprint(model_dir)
        self.blender = Blender(
            self.layers, store, self.config, fingerprint=self.fingerprint, bos_token_id=bos_id_added(self._tokenizer)
        )
        self._eos = end_token_ids(hf_model.generation_config, self._tokenizer)
        self._lock = threading.RLock()  # one request at a time on this model
        self._in_flight = 0  # user requests started and not finished (a live check waits for none)
        self._in_flight_lock = threading.Lock()

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def calibrations(self) -> Calibrations:
        return self.blender.calibrations

    @property
    def store(self) -> ChunkStore:
        return self.blender.store

    @store.setter
    def store(self, store: ChunkStore) -> None:
        self.blender.store = store

    def __repr__(self) -> str:
        return f"TransformersEngine({self.model_name!r}, dtype={self.dtype_name}, device={self.device})"

    def compute_chunk(self, token_ids: Sequence[int]) -> ChunkKV:
        """A chunk's KV with the standalone recipe (see ``Blender.compute_chunk``)."""
        return self.blender.compute_chunk(token_ids)

    def warm(self, chunks: Iterable[TextOrIds], *, progress: bool | None = None) -> int:
        from tqdm.auto import tqdm

        chunks = list(chunks)
        show = progress if progress is not None else len(chunks) > 8
        computed = 0
        with self._lock:
            for chunk in tqdm(chunks, desc="warming chunk KV", unit="chunk", disable=not show):
                ids = chunk if not isinstance(chunk, str) else self._tokenizer.encode(chunk, add_special_tokens=False)
                if not ids:
                    raise ValueError("cannot warm an empty chunk")
                computed += self.blender.ensure(ids)
        return computed

    # -- generation -----------------------------------------------------
    def idle(self) -> bool:
        return self._in_flight == 0

    def _run(self, req: Request, stream: GenerationStream) -> Iterator[str]:
        if req.checking:
            yield from self._walk(req, stream)
            return
        self.quality_checker.arrived()
        with self._in_flight_lock:
            self._in_flight += 1
        try:
            yield from self._walk(req, stream)
        finally:
            with self._in_flight_lock:
                self._in_flight -= 1
        if stream.generation is not None:
            self._answered(req, stream.generation)

    def _give_way(self) -> None:
        """A live check's walk, before each layer: a user's request waits for the lock it holds."""
        if self._in_flight:
            raise CheckPreempted("a user's request arrived")

    def _walk(self, req: Request, stream: GenerationStream) -> Iterator[str]:
        tp = req.prompt
        with self._lock, contextlib.ExitStack() as held:
            generator = None
            if req.temperature > 0:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(
                    req.seed if req.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
                )
            n_prompt = len(tp)
            max_tokens = min(req.max_tokens, self.context_length - n_prompt)
            cache = held.enter_context(self.blender.request_caches.lease(n_prompt + max_tokens))
            plan = self.blender.plan(
                tp.token_ids,
                tp.chunk_spans,
                mode=req.mode,
                recompute_ratio=req.recompute_ratio,
                settings=req.settings,
                question_end=tp.question_end,
            )
            # a live check gives way to a user's request at the next layer: one layer's wait, not a prefill's
            give_way = self._give_way if req.checking else None
            logits, stats = self.blender.prefill(cache, tp.token_ids, plan, before_layer=give_way)
            text = TextAssembler(self._tokenizer, req.stop)
            out_ids: list[int] = []
            out_logprobs: list[dict[int, float]] | None = [] if req.logprobs is not None else None
            ttft = None
            finish = "length"
            try:
                while True:
                    token = sample(logits, req.temperature, req.top_p, generator)
                    if ttft is None:
                        ttft = time.perf_counter() - req.started
                    if out_logprobs is not None and req.logprobs is not None:  # the end step too, as vLLM has it
                        out_logprobs.append(top_logprobs(logits, req.logprobs, token))
                    out_ids.append(token)  # an end token too, as vLLM returns it (its text is empty)
                    if token in self._eos:
                        finish = "stop"
                        break
                    delta = text.add(token)
                    if delta:
                        yield delta
                    if text.stopped:
                        finish = "stop"
                        break
                    if len(out_ids) >= max_tokens:
                        break
                    with torch.inference_mode():
                        token_ids = torch.tensor([token], device=self.device)
                        logits, _ = forward(self.layers, cache, token_ids, before_layer=give_way)
                if not text.stopped:
                    delta = text.finish()
                    if delta:
                        yield delta
                usage = Usage(
                    prompt_tokens=n_prompt,
                    completion_tokens=len(out_ids),
                    cached_tokens=stats.cached_tokens,
                    recomputed_tokens=stats.recomputed_tokens,
                    chunks_hit=stats.chunks_hit,
                    chunks_missed=stats.chunks_missed,
                    chunks_computed=stats.chunks_computed,
                    recompute_ratio=stats.recompute_ratio,
                    ratio_source=stats.ratio_source,
                    calibration_dtype=stats.calibration_dtype,
                    ranking_captured=stats.ranking_captured,
                )
                stream.generation = Generation(
                    text=text.text,
                    token_ids=out_ids,
                    prompt_token_ids=list(tp.token_ids),
                    finish_reason=finish,
                    ttft_s=ttft,
                    usage=usage,
                    mode=req.mode,
                    logprobs=out_logprobs,
                    total_s=time.perf_counter() - req.started,
                    loading=stats.loading,
                    ranking_share=stats.ranking_share,
                    reused_spans=stats.reused_spans,
                    recomputed_positions=stats.recomputed_positions,
                )
            finally:
                # Missed chunks are computed with the standalone recipe after the
                # answer, off the time-to-first-token path, so the next request hits.
                self.blender.save_missed(stats)
