"""Engines layer: the blend KV connector for vLLM, loaded by vLLM through ``kv_connector_module_path``.

vLLM's scheduler can only be told that a *prefix* of a prompt is already
computed. So the blend pass runs inside the worker, in ``start_load_kv``
(synchronous, before the forward): it computes the fused KV of every prompt
token but the last with the model's own modules and the shared ``Blender``
(so the question after the chunks is there for query-aware selection),
writes it into vLLM's paged cache through the attention backend's own
``do_kv_cache_update``, and the scheduler reports those tokens as matched.
vLLM then computes the last token itself and samples from it.

Per request the caller sends ``SamplingParams(extra_args={"kv_transfer_params":
{"blend": {"mode", "ratio", "selection", "chunk_spans", "num_tokens", ...}}})`` (``vllm serve``
takes ``kv_transfer_params`` in the request body). Callers that only have text
send ``{"mode", "separator"}`` instead: the chunks are the pieces between
separators in the prompt's tokens. The scheduler side decides
which chunks are hits (``key in store``), so the usage it returns in
``RequestOutput.kv_transfer_params["blend"]`` is known when the request ends.

No request can take the engine down (vLLM treats any exception on the
scheduler side as fatal). The scheduler side checks every request's
parameters by the rules of ``vllm_contract`` and never raises on them: a
request that breaks one is computed in full, and its ``kv_transfer_params``
say why (``"blend_fallback"``). On the worker, a blend pass that fails (an
unreadable entry that slipped past the store's checks, a shape mismatch, out
of memory) is logged once and its blocks are reported as failed to load
(``get_block_ids_with_load_errors``); with ``kv_load_failure_policy=
"recompute"`` vLLM computes that request in full, and the other requests of
the batch go on as usual. The worker tells the scheduler (worker metadata),
so that request's usage says it was not blended.

What each blend pass did (the ratio the calibration's per-request guard
raised, the tokens it recomputed) goes back in the worker's report of its
step, and the scheduler side puts it in the request's answer, also for a
request that ends in that step (``vllm_answers``).

The loading controller (``BlendConfig(loading_controller=True)``) runs on the
scheduler side: its plan decides which chunks the scheduler reports as hits
before the pass runs. The scheduler finds each chunk's tier with ``store.locate`` (the shared tiers: disk and
Redis; it has no memory tier, so a chunk the worker holds in memory counts
as on disk), estimates load and compute times from the read bandwidths and
walk throughput the worker measured, which the worker sends back whenever
they change (``build_connector_worker_meta``, vLLM's worker-to-scheduler
channel: in-engine, so it holds for ``vllm serve`` and several workers
alike; the estimates lag the worker by one step), and puts its plan (ratio,
chunks to load) in the ``BlendJob``. Its decisions come back in
``kv_transfer_params["blend_loading"]``. The worker follows the plan; a
chunk planned to load that turns out missing or damaged is computed
standalone and used as loaded, so the reported usage stays true.

The worker gets its model from the ``blend`` model loader (``load_format=
"blend"``, registered by this package's vLLM plugin). ``kv_connector_extra_config``
may set ``store_path``, ``store_size_limit_bytes``, ``store_memory_limit_bytes``,
``store_read_bandwidth`` (bytes/s per tier, assumed until the worker measures it),
the Redis tier's ``store_remote`` (a URL, or null for none; missing:
``$BLEND_STORE_REMOTE``), ``store_remote_in_env`` (true: ``store_remote`` has its
password replaced by ``***`` and the full URL is ``$BLEND_STORE_REMOTE``),
``store_remote_size_limit_bytes``, ``store_remote_timeout_s``,
``blend_memory_limit_bytes`` (the most a blend pass may allocate beyond
vLLM's budget, ``vllm_memory``: before it starts, a pass that would not fit
in that or in free memory is failed, and vLLM computes the request in full,
reason "blend_memory"), and ``blend_config`` (``BlendConfig`` fields);
everything has a default.

vLLM 0.32 and 0.33 (``SUPPORTED_VLLM``; tests/unit/test_vllm_versions.py
reads both) call this connector the same way. 0.33 adds hooks that keep
their base defaults here: ``supports_sleep_mode`` (True: nothing here pins
or registers the cache memory, and sleep mode gives the cache tensors back
at the same addresses), ``unregister_kv_caches`` / ``restore_kv_caches``
(nothing to drop), and the worker-extension hooks ``init_worker_extension``
/ ``destroy_worker_extension`` (unsaved chunks are flushed in ``shutdown``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections import Counter
from typing import Any

import torch
from torch.profiler import record_function
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

from ..fusion import Blender, ChunkKeys, Planner, PrefillStats
from ..fusion.layers import RanksFailed, agreed
from ..fusion.plan import in_full, measured_rates
from ..models.vllm import PagedCache, VLLMDecoder, VLLMRanks
from ..prompt import PromptError, separator_forms, spans_from_separator
from ..store import ChunkStore
from . import vllm_plugin
from .blend_metrics import BlendCounters, store_reads
from .vllm_answers import Answers, PassReport, RecentAnswers, answer_of
from .vllm_contract import BlendParams, blend_params_of, not_blended
from .vllm_limits import check_vllm_config, kv_block_size
from .vllm_memory import REASON as MEMORY_REASON
from .vllm_memory import NotEnoughMemory, check_pass_memory, pass_memory, pooled_tokens
from .vllm_messages import BlendConnectorMetadata, BlendJob, BlendWorkerMetadata
from .vllm_served import ServedModel, served_tokenizer
from .vllm_stats import BlendConnectorStats, BlendPromMetrics

logger = logging.getLogger(__name__)
# This process's connectors, for ``vllm_worker``'s ``blend_pending``: a worker's, and the scheduler's too where
# vLLM runs its engine core and worker in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the "uni" executor).
CONNECTORS: weakref.WeakSet[BlendConnector] = weakref.WeakSet()


@functools.lru_cache(maxsize=16)
def _separator_forms(tokenizer_name: str, separator: str) -> tuple[tuple[int, ...], ...]:
    """``prompt.separator_forms`` of the served tokenizer, kept for the separators requests send most."""
    return tuple(map(tuple, separator_forms(served_tokenizer(tokenizer_name), separator)))


class BlendConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        check_vllm_config(vllm_config)  # settings that would hand out wrong KV: refused by name
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        served = ServedModel.of(vllm_config)
        self.config = served.config
        self.walk_attention = served.walk_attention
        self.memory_limit_bytes = served.memory_limit_bytes  # vllm_memory: None, free memory alone
        self.block_size = kv_block_size(vllm_config, kv_cache_config)  # the KV cache spec's (vllm_limits)
        self.tokenizer_name = vllm_config.model_config.tokenizer
        store_args = dict(served.store_args)
        if role == KVConnectorRole.SCHEDULER:
            store_args["memory_limit_bytes"] = 0  # the scheduler only asks which keys exist
        self.store = ChunkStore(**store_args)
        # recompute_ratio="auto" reads the model's calibration from the store, guard included:
        # the worker reports the ratio a guard raised (``vllm_answers``).
        keys = ChunkKeys(served.fingerprint, served.dtype, served.bos)
        self.planner = Planner(self.config, keys, served.num_layers, served.calibrations(self.store))
        # scheduler side
        self._to_load: dict[str, tuple[BlendParams, list[int]]] = {}  # req_id -> (params, ids), until its job is sent
        self._answers = Answers()
        self._reads_told: Counter = Counter()  # worker side: the store reads already handed to vLLM
        # worker side
        self.blender: Blender | None = None
        # The worker's measured rates: on the worker as last sent, on the scheduler as last received.
        self._rates = self._measured_rates()
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layer_names: list[str] = []
        self._unsaved: list[PrefillStats] = []
        self._failed: dict[str, tuple[str, str]] = {}  # req_id -> (cause, reason) of failed passes, until reported
        self._reports: dict[str, PassReport] = {}  # req_id -> what its blend pass did, until reported
        self._invalid_blocks: set[int] = set()  # their blocks, until reported
        self.recent = RecentAnswers()  # the latest passes' answers, for requests that lose theirs
        CONNECTORS.add(self)

    def pending(self) -> dict[str, int]:
        """How many entries each of this side's per-request maps holds: all 0
        once no request is in flight (nothing outlives a request)."""
        if self._role == KVConnectorRole.SCHEDULER:
            return {"to_load": len(self._to_load), **self._answers.pending()}
        sizes = [len(self._failed), len(self._reports), len(self._invalid_blocks), len(self._unsaved)]
        return dict(zip(("failed", "reports", "invalid_blocks", "unsaved"), sizes))

    # -- scheduler side -------------------------------------------------
    # vLLM treats an exception here as fatal for the engine: nothing below raises on request data.
    def blend_params(self, request) -> BlendParams | None:
        """The request's checked blend parameters with chunk spans; None if it
        is not blended. Spans come from the caller, or for text-only callers
        from a ``separator`` found in the prompt's tokens. A request whose
        parameters break a rule is not blended: logged once, and its response
        says why."""
        rid = request.request_id
        if rid in self._answers.fallbacks:
            return None
        prompt_len = len(request.prompt_token_ids or ())
        try:
            params = blend_params_of(getattr(request, "kv_transfer_params", None), prompt_len)
            if params is None or params.mode == "full":
                return None
            if params.separator is not None:
                spans = spans_from_separator(
                    request.prompt_token_ids, _separator_forms(self.tokenizer_name, params.separator)
                )
                if not spans:
                    raise PromptError(
                        f"the prompt has no chunk between two separators {params.separator!r:.40} "
                        "(kv_transfer_params.blend.separator)"
                    )
                params = params.with_spans(spans, prompt_len)
            return params
        except Exception as exc:
            why = str(exc) if isinstance(exc, PromptError) else f"reading the blend parameters failed: {exc!r}"
            self._fall_back(rid, why, "invalid_params")
            return None

    def _fall_back(self, req_id: str, why: str, reason: str, *, logged: bool = False) -> None:
        """Compute the request in full; its response says why (``reason``: the
        metrics' name of the cause). ``logged``: the worker logged it."""
        if req_id not in self._answers.fallbacks and not logged:
            logger.warning("request %s is computed in full, not blended: %s", req_id, why)
        self._answers.fall_back(req_id, why, reason)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        params = self.blend_params(request)
        if params is None or num_computed_tokens:
            return 0, False
        if getattr(request, "skip_reading_prefix_cache", False):
            # vLLM computes every prompt token itself (and ignores a match) to return their logprobs.
            why = "prompt logprobs were asked for: vLLM computes every prompt token to return their logprobs"
            self._fall_back(request.request_id, why, "prompt_logprobs")
            return 0, False
        if self._computes_in_full(request.request_id, params):
            return 0, False  # vLLM's own prefill computes every token
        # load_kv_async=False: the blend pass runs synchronously before the forward. (Checked
        # parameters with spans always have num_tokens; nothing here may raise.)
        return params.num_tokens or 0, False

    def _computes_in_full(self, req_id: str, params: BlendParams) -> bool:
        """Whether the calibration recomputes every token for this request
        (``plan.in_full``): then no blend pass runs, and the usage says why."""
        try:
            choice = self.planner.choose(params.ratio) if params.mode == "blend" else None
        except Exception:  # never raise on the scheduler side: blend as asked
            logger.exception("reading the calibration failed; blending request %s", req_id)
            return False
        if choice is None or not in_full(choice):
            return False
        self._answers.in_full[req_id] = choice
        return True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            params = self.blend_params(request)
            if params is not None:
                self._to_load[request.request_id] = (params, list(request.prompt_token_ids[: params.num_tokens]))

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        self._answers.settle()  # requests that finished between steps (aborted)
        meta = BlendConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._to_load:
                meta.jobs.append(self._job(new.req_id, new.block_ids[0]))
        # A request preempted and resumed gets new blocks: blend into those again.
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid in self._to_load and rid in cached.resumed_req_ids and cached.new_block_ids[i] is not None:
                meta.jobs.append(self._job(rid, cached.new_block_ids[i][0]))
        return meta

    def _job(self, req_id: str, block_ids: list[int]) -> BlendJob:
        params, ids = self._to_load.pop(req_id)
        try:
            # The plan looks every chunk up (promise): the usage reported at the end is the plan's.
            assert params.chunk_spans is not None  # blend_params found the spans of a separator
            plan = self.planner.plan(
                ids,
                params.chunk_spans,
                mode=params.mode,
                ratio=params.ratio,
                store=self.store,
                rates=self._rates,
                settings=params.settings,
                promise=True,
                question_end=params.question_end,
            )
        except Exception as exc:
            why = f"planning the blend pass failed: {exc!r}"
            self._fall_back(req_id, why, "planning_failed")
            return BlendJob(req_id, ids, None, list(block_ids), error=why)
        self._answers.planned[req_id] = plan
        return BlendJob(req_id, ids, plan, list(block_ids), details=params.details)

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, BlendWorkerMetadata):
            self._rates = meta.rates
            # vLLM recomputes these requests in full (their blocks failed to load). Only a
            # planned request's pass ran: a report on one that has finished (aborted while its
            # step ran) or that the scheduler could not plan (its reason stays) changes nothing.
            for req_id, why in meta.failed.items():
                if req_id in self._answers.planned:
                    self._fall_back(req_id, why, meta.reasons.get(req_id, "blend_pass_failed"), logged=True)
            for req_id, report in meta.reports.items():
                self._answers.report(req_id, report)
        self._answers.settle()

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        self._to_load.pop(request.request_id, None)
        return False, self._answers.finish(request.request_id, getattr(request, "kv_transfer_params", None))

    # -- metrics (vLLM's API server turns them into Prometheus series) ----
    def get_kv_connector_stats(self) -> BlendConnectorStats | None:
        """The counts since vLLM last asked: finished requests on the scheduler
        side, the store's reads on the worker side (rank 0's: every rank reads
        the same entries)."""
        if self._role == KVConnectorRole.SCHEDULER:
            counters = self._answers.take_counters()  # vLLM asks after the step's reports are in
        elif self.blender is not None and get_tensor_model_parallel_rank() == 0:
            reads = store_reads(self.store.stats)
            counters = BlendCounters(tiers=reads - self._reads_told)
            self._reads_told = reads
        else:
            return None
        return BlendConnectorStats(data=counters.data()) if counters else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> BlendConnectorStats:
        return BlendConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> BlendPromMetrics:
        return BlendPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- worker side ----------------------------------------------------
    def _attach(self) -> Blender:
        if self.blender is None:
            model = vllm_plugin.loaded_model()
            if model is None:
                raise RuntimeError(
                    "the blend connector found no model: start vLLM with load_format='blend' "
                    "(`vllm serve ... --load-format blend`); load_engine(..., backend='vllm') does this"
                )
            decoder = VLLMDecoder(model, self._vllm_config, self.walk_attention)
            self.blender = Blender(
                decoder,
                self.store,
                self.config,
                fingerprint=self.planner.keys.fingerprint,
                bos_token_id=self.planner.keys.bos_token_id,
            )
            self._layer_names = decoder.attention_layer_names()
        return self.blender

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = kv_caches

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self.save_unsaved()
        meta = self._get_connector_metadata()
        if isinstance(meta, BlendConnectorMetadata):
            for job in meta.jobs:
                if job.error is not None:  # the scheduler could not plan it, and logged why
                    self._fail(job, job.error)
                    continue
                try:
                    self._run(job)
                except Exception as exc:
                    self._survive(exc, f"the blend pass of request {job.req_id}")
                    self._fail(job, *self._failure(job.req_id, exc))

    @functools.cached_property
    def _ranks(self) -> VLLMRanks | None:
        """This worker's tensor-parallel group, or None without tensor parallelism."""
        ranks = VLLMRanks()
        return ranks if ranks.size > 1 else None

    def _survive(self, exc: Exception, what: str) -> None:
        """Re-raise ``exc`` unless every rank surely stopped where this one
        did: without tensor parallelism, or where the ranks agreed
        (``RanksFailed``). A failure inside the walk, between its collectives,
        is this rank's alone: going on would leave the other ranks' collectives
        out of step with this one's, summing unrelated tensors. vLLM stops
        the engine on it instead, loudly."""
        if self._ranks is not None and not isinstance(exc, RanksFailed):
            logger.critical("%s failed on tensor-parallel rank %d between collectives", what, self._ranks.rank)
            raise exc

    def _failure(self, req_id: str, exc: Exception) -> tuple[str | None, str]:
        """Log why a blend pass failed; (why, reason) to report, why None on a
        rank that stopped for another's (which tells why)."""
        cause = exc.cause if isinstance(exc, RanksFailed) else exc
        if cause is None:
            return None, "blend_pass_failed"
        if isinstance(cause, NotEnoughMemory):  # checked before the pass allocated anything
            rank = f"tensor-parallel rank {self._ranks.rank}: " if self._ranks is not None else ""
            why = f"{rank}{cause}"
            logger.warning("request %s is computed in full, not blended: %s", req_id, why)
            return why, MEMORY_REASON
        why = f"the blend pass failed: {type(exc).__name__}: {exc}"
        logger.error("request %s: %s; vLLM computes it in full", req_id, why, exc_info=True)
        return why, "blend_pass_failed"

    def _fail(self, job: BlendJob, why: str | None, reason: str = "blend_pass_failed") -> None:
        """Report the job's blocks as failed to load (vLLM then computes the
        request in full), and tell the scheduler why (None: another rank does)."""
        if why is not None:
            self._failed[job.req_id] = (why, reason)
            self.recent.keep(job.req_id, not_blended(why, reason))
        self._invalid_blocks.update(job.block_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid_blocks = self._invalid_blocks, set()
        return invalid

    def _run(self, job: BlendJob) -> None:
        """One blend pass. Under tensor parallelism the ranks agree before
        the walk's collectives (what each rank prepares alone, and the
        entries it reads: ``Blender.prefill``) and after them, so that a
        failure on one rank there stops every rank's pass, not its own alone."""
        assert job.plan is not None  # a job without a plan has an error, and is failed without a run
        with contextlib.ExitStack() as stack:
            with agreed(self._ranks):
                blender = self._attach()
                # What the pass allocates beyond vLLM's budget, against what is free: every rank decides here
                need = pass_memory(
                    blender.model,
                    job.plan,
                    len(job.token_ids),
                    pooled_tokens=pooled_tokens(blender.request_caches),
                    kernel=isinstance(blender.model, VLLMDecoder) and blender.model.attends_with_kernel(),
                )
                ranks = self._ranks.size if self._ranks is not None else 1
                check_pass_memory(need, blender.model.device, ranks=ranks, limit=self.memory_limit_bytes)
                # The walk writes every layer into the request's blocks and attends there.
                layers = [self._kv_caches[name] for name in self._layer_names]
                paged = PagedCache(layers, job.block_ids, self.block_size)
                cache = stack.enter_context(blender.request_caches.lease(len(job.token_ids)))
            with record_function("blend.pass"):
                _, stats = blender.prefill(cache, job.token_ids, job.plan, logits=False, kv_target=paged)
        with agreed(self._ranks):
            # Missed chunks are saved at the next step, after this step's first
            # token is out: off the time-to-first-token path.
            self._unsaved.append(stats)
            report = self._reports[job.req_id] = PassReport.of(stats, job.details)
            self.recent.keep(job.req_id, answer_of(job.plan, report))

    def _measured_rates(self) -> dict[str, float | None]:
        return measured_rates(self.store, self.blender.walk_speed if self.blender is not None else None)

    def build_connector_worker_meta(self) -> BlendWorkerMetadata | None:
        rates = self._measured_rates()
        failed, self._failed = self._failed, {}
        reports, self._reports = self._reports, {}
        if rates == self._rates and not failed and not reports:
            return None
        self._rates = rates
        causes = {req_id: why for req_id, (why, _) in failed.items()}
        reasons = {req_id: reason for req_id, (_, reason) in failed.items()}
        return BlendWorkerMetadata(rates, causes, reports, reasons)

    def save_unsaved(self) -> None:
        """Store the chunks that missed. A chunk that cannot be saved is
        logged and dropped: it is computed again when it next misses."""
        while self._unsaved and self.blender is not None:
            stats = self._unsaved.pop()
            count = len(stats.missed)
            try:
                self.blender.save_missed(stats)
            except Exception as exc:
                self._survive(exc, "computing missed chunks to save")
                logger.exception("saving %d missed chunk(s) failed; they are computed again when next used", count)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # the blend pass is synchronous

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # chunks are saved with the standalone recipe, not from vLLM's cache

    def wait_for_save(self) -> None:
        return

    def shutdown(self) -> None:
        if self.blender is not None:
            self.save_unsaved()
