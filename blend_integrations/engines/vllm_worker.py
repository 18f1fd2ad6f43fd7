"""Engines layer: the blend worker extension, which vLLM mixes into its
workers (``worker_extension_cls``): methods ``LLM.collective_rpc`` runs in
every worker, on that worker's blend connector."""

from __future__ import annotations

from vllm.distributed.kv_transfer import get_kv_transfer_group

from .vllm_check import SteppedCheck
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

    def blend_check_start(self, token_ids: list[int], tokens: int) -> None:
        """Begin a live check's full prefill on this worker (``vllm_check``); one at a time."""
        self.blend_check_stop()
        self._blend_check: SteppedCheck | None = SteppedCheck(
            get_kv_transfer_group()._attach().model, token_ids, tokens
        )

    def blend_check_advance(self, layers: int) -> list[int] | None:
        """Run the check ``layers`` layers on; its tokens once it has them all (then it is gone)."""
        check = getattr(self, "_blend_check", None)
        if check is None:
            raise RuntimeError("no live check was started on this worker")
        try:
            result = check.advance(layers)
        except BaseException:
            self.blend_check_stop()
            raise
        if result is not None:
            self.blend_check_stop()
        return result

    def blend_check_stop(self) -> None:
        """End the check in flight, if any, and free what it holds."""
        check = getattr(self, "_blend_check", None)
        self._blend_check = None
        if check is not None:
            check.stop()

    def blend_answer(self, request_id: str) -> dict | None:
        """The connector's answer for the request the caller named
        ``request_id``, if this worker blended it lately (``RecentAnswers``)."""
        return get_kv_transfer_group().recent.find(request_id)

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
