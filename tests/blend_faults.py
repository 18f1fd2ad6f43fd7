"""The tests' vLLM worker extension (``worker_extension_cls``): fault injection
that makes the blend pass of chosen requests fail for real, inside the worker,
and a probe that runs the walk there with each attention."""

from __future__ import annotations

import dataclasses
import logging

import torch

from blend_integrations.engines import vllm_connector
from blend_integrations.engines.vllm_connector import BlendConnector
from blend_integrations.engines.vllm_worker import BlendWorkerExtension


def _holds(ids: list[int], part: list[int]) -> bool:
    return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.levelname} {record.getMessage()}")


_records = _Records()
_lost_reads: list[str] = []  # the keys blend_lose_on_rank's fault answered as missing, one per read


class FaultInjection(BlendWorkerExtension):
    def blend_fail_on(self, chunk_ids: list[int] | None) -> None:
        """From now on, the blend pass of a prompt that holds ``chunk_ids`` fails
        half-way: it writes the KV of other tokens (the prompt reversed) into
        the request's blocks, then runs out of memory. None: no more faults."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        connector = get_kv_transfer_group()
        connector.__dict__.pop("_run", None)
        logger = logging.getLogger(vllm_connector.__name__)
        logger.removeHandler(_records)
        if chunk_ids is None:
            return
        _records.messages.clear()
        logger.addHandler(_records)  # every record of the connector, the scheduler side's too

        def failing(job):
            if not _holds(job.token_ids, list(chunk_ids)):
                return BlendConnector._run(connector, job)
            wrong = dataclasses.replace(job.plan, mode="full", chunks=())
            BlendConnector._run(connector, dataclasses.replace(job, token_ids=job.token_ids[::-1], plan=wrong))
            raise torch.OutOfMemoryError("injected fault: out of memory in the blend pass")

        connector._run = failing

    def blend_fault_log(self) -> list[str]:
        """What the connector logged since faults were switched on."""
        return list(_records.messages)

    def blend_lose_on_rank(self, rank: int, chunk_ids: list[int] | None) -> None:
        """From now on, the store of tensor-parallel rank ``rank`` alone no
        longer finds the chunk ``chunk_ids`` (as if evicted between two ranks'
        reads). None: it finds everything again; ``blend_lost_reads`` still
        says how often the last fault fired."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        from vllm.distributed.parallel_state import get_tp_group

        connector = get_kv_transfer_group()
        store = connector.store
        store.__dict__.pop("get", None)
        if chunk_ids is None:
            return
        _lost_reads.clear()
        if get_tp_group().rank_in_group != rank:
            return
        lost = connector.planner.keys(chunk_ids)

        def get(key, **kwargs):
            if key != lost:
                return type(store).get(store, key, **kwargs)
            _lost_reads.append(key)
            return None

        store.get = get

    def blend_lost_reads(self) -> int:
        """How many reads of the lost chunk this rank's store answered as a
        miss since ``blend_lose_on_rank`` last set a fault: a test sees that
        its fault fired."""
        return len(_lost_reads)

    def blend_break_on_rank(self, rank: int, where: str | None) -> None:
        """From now on, tensor-parallel rank ``rank`` alone fails, in the
        blend pass or in saving missed chunks: "lease" (no memory for the
        pass's dense cache), "read" (the store raises on a read) or "save"
        (no memory for a missed chunk's buffers). None: no more faults."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        from vllm.distributed.parallel_state import get_tp_group

        from blend_integrations.fusion import blender as blender_module
        from blend_integrations.fusion.walk import KVCache

        connector = get_kv_transfer_group()
        blender = connector._attach()
        blender.request_caches.__dict__.pop("lease", None)
        connector.store.__dict__.pop("get", None)
        blender_module.KVCache = KVCache
        if where is None or get_tp_group().rank_in_group != rank:
            return
        if where == "lease":

            def lease(capacity):
                raise torch.OutOfMemoryError(f"injected fault: no memory for a {capacity}-token cache")

            blender.request_caches.lease = lease
        elif where == "read":

            def get(key, **kwargs):
                raise OSError(5, "injected fault: input/output error reading a chunk")

            connector.store.get = get
        elif where == "save":

            class NoMemory(KVCache):
                @classmethod
                def allocate(cls, model, capacity):
                    raise torch.OutOfMemoryError("injected fault: no memory for a chunk's buffers")

            blender_module.KVCache = NoMemory
        else:
            raise ValueError(f"unknown fault {where!r}")

    def blend_choose_attention(self, walk_attention: str = "auto", broken_kernel: bool = False) -> dict:
        """Make this worker choose how connector jobs attend as
        ``walk_attention`` does (timing the kernel and SDPA, and checking that
        they agree), then restore the engine's own setting. ``broken_kernel``:
        the backend's kernel answers 10% off for the choice (a kernel that
        reads the cache otherwise than the walk writes it). Returns the choice
        and what was measured."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        model = get_kv_transfer_group()._attach().model
        setting = model.walk_attention, model._kernel, model.attention_probe
        model.walk_attention, model._kernel = walk_attention, None
        impls = {id(m.impl): m.impl for m in model.attn_modules}.values()
        if broken_kernel:
            for impl in impls:
                forward = impl.forward

                def off(*args, forward=forward, **kwargs):
                    out = forward(*args, **kwargs)
                    out.mul_(1.1)
                    return out

                impl.forward = off
        try:
            return {"kernel": model.attends_with_kernel(), "probe": model.attention_probe}
        finally:
            for impl in impls:
                impl.__dict__.pop("forward", None)
            model.walk_attention, model._kernel, model.attention_probe = setting

    def blend_walk_both_ways(self, token_ids: list[int], spans: list[tuple[int, int]], ratio: float, selection: str):
        """The walk over a prompt whose chunks are reused, run in this worker
        twice: attending in vLLM's paged cache with the backend's kernel (as a
        connector job does, in free blocks of the idle engine), and with SDPA
        over the dense cache alone. Returns what each kept after the check
        layer and the largest difference between their dense K and V."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        from blend_integrations.fusion.walk import KVCache, ReusedSpan, forward
        from blend_integrations.models.vllm import PagedCache

        connector = get_kv_transfer_group()
        blender = connector._attach()
        model = blender.model
        heads = model.tp.kv_heads if model.tp is not None else slice(None)
        reused = [ReusedSpan(a, blender.compute_chunk(token_ids[a:b]).kv[:, :, heads]) for a, b in spans]
        blocks = list(range(1, 1 + -(-len(token_ids) // connector.block_size)))  # block 0 is vLLM's null block
        paged = PagedCache([connector._kv_caches[n] for n in connector._layer_names], blocks, connector.block_size)
        kept, caches = [], []
        # the paged run drives the kernel, whatever walk_attention chose for connector jobs (its
        # probe, run to check the kernel, is the engine's own again after)
        chosen = model.walk_attention, model._kernel, model.attention_probe
        model.walk_attention, model._kernel = "kernel", None
        try:
            assert model.attends_with_kernel()
            for target in (paged, None):
                cache = KVCache.allocate(model, len(token_ids))
                with torch.inference_mode():
                    _, stats = forward(
                        model,
                        cache,
                        torch.tensor(token_ids, device=model.device),
                        reused=reused,
                        schedule=[(1, ratio)],
                        selection=selection,
                        query_start=spans[-1][1],
                        logits=False,
                        kv_target=target,
                    )
                kept.append(list(stats.kept))
                caches.append(torch.stack([torch.stack(cache.k), torch.stack(cache.v)]).float())
        finally:
            model.walk_attention, model._kernel, model.attention_probe = chosen
        return kept[0], kept[1], float((caches[0] - caches[1]).abs().max())

    def blend_model_runner(self) -> dict:
        """Which of vLLM's model runners this worker runs, and what its
        environment says (``VLLM_USE_V2_MODEL_RUNNER``)."""
        import os

        runner = type(self.model_runner)
        return {"runner": f"{runner.__module__}.{runner.__name__}", "env": os.environ.get("VLLM_USE_V2_MODEL_RUNNER")}

    def blend_memory_limit(self, limit: int | None, rank: int | None = None) -> None:
        """From now on, the blend pass of tensor-parallel rank ``rank`` (every
        rank: None) may allocate at most ``limit`` bytes beyond vLLM's budget,
        as ``kv_connector_extra_config.blend_memory_limit_bytes`` would set it;
        None: the engine's own setting again."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        from vllm.distributed.parallel_state import get_tp_group

        from blend_integrations.engines.vllm_served import ServedModel

        connector = get_kv_transfer_group()
        if limit is None:
            connector.memory_limit_bytes = ServedModel.of(connector._vllm_config).memory_limit_bytes
        elif rank is None or get_tp_group().rank_in_group == rank:
            connector.memory_limit_bytes = limit
