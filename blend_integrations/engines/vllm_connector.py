"""The blend KV connector for vLLM, loaded by vLLM through ``kv_connector_module_path``.

vLLM's scheduler can only be told that a *prefix* of a prompt is already
computed. So the blend pass runs inside the worker, in ``start_load_kv``
(synchronous, before the forward): it computes the fused KV of every prompt
token before the suffix with the model's own modules and the shared
``Blender``, writes it into vLLM's paged cache through the attention
backend's own ``do_kv_cache_update``, and the scheduler reports those tokens
as matched. vLLM then computes the suffix itself, on top of the fused KV.

Per request, the caller sends ``SamplingParams(extra_args={"kv_transfer_params":
{"blend": {"mode", "ratio", "chunk_spans", "num_tokens", "id"}}})``. Usage comes back
in ``RequestOutput.kv_transfer_params["blend"]``.

The worker-side connector gets the model through ``BlendWorkerExtension``
(vLLM's ``worker_extension_cls``): the engine calls ``blend_attach`` once.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer import get_kv_transfer_group
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from ..config import BlendConfig
from ..fusion import Blender, KVCache, PrefillStats
from ..store import ChunkStore

log = logging.getLogger("blend_integrations.vllm")

RECENT_USAGE = 4096  # requests whose usage a worker remembers for blend_usage


@dataclass
class BlendJob:
    req_id: str  # vLLM's internal id
    client_id: str | None  # the caller's id (vLLM adds a suffix to ids internally)
    token_ids: list[int]  # the tokens the blend pass computes: the prompt before its suffix
    chunk_spans: list[tuple[int, int]]
    mode: str  # "blend" or "reuse"
    ratio: float | None
    block_ids: list[int]


@dataclass
class BlendConnectorMetadata(KVConnectorMetadata):
    jobs: list[BlendJob] = field(default_factory=list)


@dataclass
class BlendWorkerMetadata(KVConnectorWorkerMetadata):
    usage: dict[str, dict[str, int]] = field(default_factory=dict)  # req_id -> usage counts

    def aggregate(self, other: "BlendWorkerMetadata") -> "BlendWorkerMetadata":
        return BlendWorkerMetadata({**self.usage, **other.usage})


def blend_params(request) -> dict | None:
    params = getattr(request, "kv_transfer_params", None) or {}
    blend = params.get("blend")
    return blend if isinstance(blend, dict) and blend.get("mode") in ("blend", "reuse") else None


class BlendConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self.extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        # scheduler side
        self._to_load: dict[str, dict] = {}  # req_id -> blend params, until its job is sent
        self._usage: dict[str, dict[str, int]] = {}
        self._blending: set[str] = set()  # requests whose job was sent and that have not finished
        # worker side
        self.blender: Blender | None = None
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layer_names: list[str] = []
        self._done: dict[str, dict[str, int]] = {}  # usage to send with this step's output
        self._recent: OrderedDict[str, dict[str, int]] = OrderedDict()  # usage by client id, bounded
        self._unsaved: list[PrefillStats] = []

    # -- scheduler side -------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        params = blend_params(request)
        if params is None or num_computed_tokens:
            return 0, False
        # load_kv_async=False: the blend pass runs synchronously before the forward.
        return int(params["num_tokens"]), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self._to_load[request.request_id] = blend_params(request)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = BlendConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            params = self._to_load.pop(new.req_id, None)
            if params is not None:
                meta.jobs.append(self._job(new, params))
                self._blending.add(new.req_id)
        return meta

    def _job(self, new, params: dict) -> BlendJob:
        n = int(params["num_tokens"])
        return BlendJob(
            req_id=new.req_id,
            client_id=params.get("id"),
            token_ids=list(new.prompt_token_ids[:n]),
            chunk_spans=[(int(a), int(b)) for a, b in params["chunk_spans"]],
            mode=params["mode"],
            ratio=params.get("ratio"),
            block_ids=list(new.block_ids[0]),
        )

    def update_connector_output(self, connector_output) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, BlendWorkerMetadata):
            # vLLM applies worker output after freeing the step's finished
            # requests; usage of those is fetched from the worker instead.
            self._usage.update((rid, u) for rid, u in meta.usage.items() if rid in self._blending)

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._to_load.pop(rid, None)
        self._blending.discard(rid)
        usage = self._usage.pop(rid, None)
        return False, ({"blend": usage} if usage is not None else None)

    # -- worker side ----------------------------------------------------
    def attach_model(self, model) -> dict[str, Any]:
        """Wrap the worker's model for the blend pass (called through the worker extension)."""
        from ..models.vllm import VLLMDecoder

        decoder = VLLMDecoder(model)
        extra = self.extra
        store = ChunkStore(
            extra["store_path"],
            size_limit_bytes=int(extra["store_size_limit_bytes"]),
            memory_limit_bytes=int(extra["store_memory_limit_bytes"]),
        )
        self.blender = Blender(
            decoder, store, BlendConfig(**extra["blend_config"]),
            fingerprint=extra["fingerprint"], bos_token_id=extra["bos_token_id"],
        )
        self._layer_names = decoder.attention_layer_names()
        return {"num_layers": decoder.num_layers, "dtype": str(decoder.dtype), "device": str(decoder.device)}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = kv_caches

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._save_unsaved()
        meta = self._get_connector_metadata()
        if not isinstance(meta, BlendConnectorMetadata) or not meta.jobs:
            return
        if self.blender is None:
            raise RuntimeError(
                "the blend connector has no model: call collective_rpc('blend_attach') once after the engine "
                "starts (load_engine(..., backend='vllm') does), with "
                "worker_extension_cls='blend_integrations.engines.vllm_connector.BlendWorkerExtension'"
            )
        for job in meta.jobs:
            self._run(job, forward_context)

    def _run(self, job: BlendJob, forward_context) -> None:
        blender = self.blender
        n = len(job.token_ids)
        cache = KVCache.allocate(blender.model, n)
        _, stats = blender.prefill(
            cache, job.token_ids, job.chunk_spans, mode=job.mode, recompute_ratio=job.ratio, logits=False
        )
        device = blender.model.device
        positions = torch.arange(n, device=device)
        blocks = torch.tensor(job.block_ids, device=device, dtype=torch.long)
        slots = blocks[positions // self.block_size] * self.block_size + positions % self.block_size
        for i, name in enumerate(self._layer_names):
            layer = forward_context.no_compile_layers[name]
            key = cache.k[i][:, :n].transpose(0, 1).contiguous()  # [n, kv_heads, head_dim]
            value = cache.v[i][:, :n].transpose(0, 1).contiguous()
            layer.impl.do_kv_cache_update(layer, key, value, self._kv_caches[name], slots)
        # Missed chunks are saved at the next step, after this step's first
        # token is out: off the time-to-first-token path.
        self._unsaved.append(stats)
        usage = asdict(stats)
        usage.pop("missed")
        self._done[job.req_id] = usage
        if job.client_id is not None:
            self._recent[job.client_id] = usage
        while len(self._recent) > RECENT_USAGE:
            self._recent.popitem(last=False)

    def _save_unsaved(self) -> None:
        while self._unsaved:
            self.blender.save_missed(self._unsaved.pop())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # the blend pass is synchronous

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # chunks are saved with the standalone recipe, not from vLLM's cache

    def wait_for_save(self) -> None:
        return

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._done:
            return None
        meta, self._done = BlendWorkerMetadata(self._done), {}
        return meta

    def shutdown(self) -> None:
        if self.blender is not None:
            self._save_unsaved()


class BlendWorkerExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``); its methods run in
    every worker through ``LLM.collective_rpc``."""

    def blend_attach(self) -> dict[str, Any]:
        return get_kv_transfer_group().attach_model(self.get_model())

    def blend_warm(self, chunks: list[list[int]]) -> int:
        connector = get_kv_transfer_group()
        connector._save_unsaved()
        return sum(connector.blender.ensure(ids) for ids in chunks)

    def blend_usage(self, req_ids: list[str]) -> dict[str, dict[str, int] | None]:
        recent = get_kv_transfer_group()._recent
        return {rid: recent.get(rid) for rid in req_ids}

    def blend_flush(self) -> None:
        get_kv_transfer_group()._save_unsaved()
