"""Engines layer: the blend worker extension, which vLLM mixes into its
workers (``worker_extension_cls``): methods ``LLM.collective_rpc`` runs in
every worker, on that worker's blend connector."""

from __future__ import annotations

from vllm.distributed.kv_transfer import get_kv_transfer_group

from .vllm_connector import CONNECTORS
from .vllm_host import process_allocator


class BlendWorkerExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``); its methods run in
    every worker through ``LLM.collective_rpc``."""

    def blend_warm(self, chunks: list[list[int]]) -> int:
        connector = get_kv_transfer_group()
        blender = connector._attach()
        connector.save_unsaved()
        return sum(blender.ensure(ids) for ids in chunks)

    def blend_attention(self) -> dict:
        """How this worker's blend pass attends: vLLM's attention backend,
        whether the pass drives its kernel (else SDPA), and what "auto"
        measured to choose (``probe``, ms)."""
        decoder = get_kv_transfer_group()._attach().model
        backend = decoder.attn_modules[0].attn_backend.get_name()
        return {"backend": backend, "kernel": decoder.attends_with_kernel(), "probe": decoder.attention_probe}

    def blend_pass_seconds(self, context: int, tokens: int = 1, scored: int = 0) -> float:
        """``Blender.pass_seconds`` on this worker's model: a walk pass's time."""
        return get_kv_transfer_group()._attach().pass_seconds(context, tokens=tokens, scored=scored)

    def blend_allocator(self) -> str:
        """The malloc this worker runs on ("tcmalloc", "jemalloc" or "system")."""
        return process_allocator()

    def blend_pending(self) -> list[dict]:
        """``BlendConnector.pending`` of each connector in this worker's
        process, with its side: the scheduler's is there too when vLLM runs
        its engine core and worker in one process (``vllm_connector.CONNECTORS``)."""
        return [{"side": c._role.name.lower(), **c.pending()} for c in list(CONNECTORS)]

    def blend_flush(self) -> None:
        connector = get_kv_transfer_group()
        if connector.blender is not None:
            connector.save_unsaved()
