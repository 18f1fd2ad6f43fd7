"""Engines layer: a live check's full prefill on a vLLM worker, run a slice at a time between the
engine's steps.

A check sent to vLLM as a request would run its whole prefill in one engine step, and a user's
request that came meanwhile would wait for that step. Here the check walks the worker's own model
(the blend pass's ``VLLMDecoder``) on a dense KV cache of its own, in a thread that runs only while
the engine hands it a slice of layers (``advance``, through a collective RPC) and waits before
every layer otherwise. ``SlicedWalk`` hands out slices only while no user's request is in flight,
sized to take about ``SLICE_S``, so a user who comes waits for one slice, not a prefill. It drives
the embedded engine's checks (``VLLMEngine.full_prefill_tokens``, through ``LLM.collective_rpc``)
and the server's (``http_checks``, through the API server's engine client).

The thread never runs beside vLLM's own step: each slice is an RPC the worker's main thread waits
in. Under tensor parallelism every rank's thread walks the same layers in the same slices (a count
of layers, never a time each rank would judge apart), so their collectives pair up as a walk's
always do.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..fusion.layers import LayerModel, agreed
from ..fusion.walk import KVCache, forward

SLICE_S = 0.02  # the engine sizes a slice of layers to take about this long
MAX_SLICE = 1 << 12  # layers in a slice at most


def next_slice(layers: int, seconds: float) -> int:
    """The layers of the next slice, after one of ``layers`` took ``seconds``: twice as many
    where it took under half of ``SLICE_S``, half as many (one at least) where it took more."""
    if seconds < SLICE_S / 2:
        return min(2 * layers, MAX_SLICE)
    if seconds > SLICE_S:
        return max(1, layers // 2)
    return layers


class _Stopped(Exception):
    """The engine stopped the check (a user came, or the engine closes)."""


class SteppedCheck:
    """Full prefill's first ``tokens`` greedy tokens of ``token_ids`` on ``model``, walked in a
    thread that runs a layer only when ``advance`` lets it."""

    def __init__(self, model: LayerModel, token_ids: Sequence[int], tokens: int) -> None:
        if not (isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 1):
            raise ValueError(f"tokens must be an int >= 1; got {tokens!r:.40}")
        if not token_ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in token_ids):
            raise ValueError("token_ids must be a non-empty list of token ids")
        self.model = model
        self.token_ids = list(token_ids)
        self.tokens = tokens
        self.result: list[int] | None = None
        self.error: BaseException | None = None
        self.done = False
        self._stopping = False
        self._go = threading.Semaphore(0)  # one layer may run
        self._paused = threading.Semaphore(0)  # the thread waits before a layer, or has ended
        self._thread = threading.Thread(target=self._run, name="blend-live-check", daemon=True)
        self._thread.start()
        self._paused.acquire()  # it allocated its cache and waits before its first layer

    def _before_layer(self) -> None:
        self._paused.release()
        self._go.acquire()
        if self._stopping:
            raise _Stopped

    def _run(self) -> None:
        m = self.model
        try:
            if m.device.type == "cuda":
                torch.cuda.set_device(m.device)  # a new thread starts on the first GPU
            with agreed(m.tp):
                cache = KVCache.allocate(m, len(self.token_ids) + self.tokens)
            out: list[int] = []
            ids = torch.tensor(self.token_ids, dtype=torch.long, device=m.device)
            with torch.inference_mode():
                while True:
                    logits, _ = forward(m, cache, ids, before_layer=self._before_layer)
                    assert logits is not None
                    out.append(int(torch.argmax(logits)))
                    if len(out) == self.tokens:
                        break
                    ids = torch.tensor(out[-1:], dtype=torch.long, device=m.device)
            self.result = out
        except _Stopped:
            pass
        except BaseException as e:  # handed to the engine by ``advance``
            self.error = e
        finally:
            self.done = True
            self._paused.release()

    def advance(self, layers: int) -> list[int] | None:
        """Run up to ``layers`` more layers; the tokens once there are all of them, else None.
        Raises what the walk raised."""
        for _ in range(layers):
            if self.done:
                break
            self._go.release()
            self._paused.acquire()
        if self.error is not None:
            raise self.error
        return self.result if self.done else None

    def stop(self) -> None:
        """End the walk where it waits, and free its cache."""
        if not self.done:
            self._stopping = True
            self._go.release()
        self._thread.join()


class SlicedWalk:
    """Drives a live check's walk on the workers (``blend_check_start``, ``_advance``, ``_stop`` of
    ``vllm_worker.BlendWorkerExtension``), a slice of layers at a time, each slice sized from the
    last one's time (``next_slice``)."""

    def __init__(self) -> None:
        self.layers = 1  # the next slice's layers

    def run(self, call: Callable[[str, tuple], Any], stop: Callable[[], None], token_ids: list[int], tokens: int):
        """Full prefill's first ``tokens`` greedy tokens of ``token_ids``. ``call(method, args)`` runs a
        worker method on every rank and gives the first rank's result, or raises ``CheckPreempted``
        where a user's request is in flight, before it runs anything; ``stop()`` ends the walk on
        every rank, and runs once it was started, however it ends."""
        call("blend_check_start", (list(token_ids), tokens))
        try:
            while True:
                started = time.perf_counter()
                result = call("blend_check_advance", (self.layers,))
                self.layers = next_slice(self.layers, time.perf_counter() - started)
                if result is not None:
                    return result
        finally:
            stop()
