"""Engines layer: the live check (``BlendConfig.quality_check``): a share of ``"auto"``'s
blended answers is checked against full prefill after it is answered, off its path.

``offer`` is handed the answers that may be checked (``Engine._answered``: greedy, blended
under ``"auto"`` from stored chunk KV) and picks every ``1 / share``-th of them, counted, not
drawn, so a share is exact over any run (a share the live-check state lowers where the answers
held: ``LiveCheck.share``). A picked answer's prompt waits in a short queue (an offer to a full
one is dropped and counted) for a thread that runs full prefill for its first tokens once the
engine is idle, compares them with the blend's, and adds the result to the model's live-check
state in the store (``calibration.live_check``), which may move ``"auto"`` for every engine on
the store. A check that fails is counted, never raised: the answer was already given.

A check waits for a lull: the engine is idle, and at the rate users have been arriving
(``arrived``), one is unlikely (``BlendConfig.quality_check_risk``, 5%) to come before a check of
the usual length ends. So under steady traffic checks take about ``risk`` of the time or less, and
they run in its pauses. A user's request that arrives during a check preempts it
(``CheckPreempted``; the check runs again later): on the transformers engine before the check's
next layer (``TransformersEngine._give_way``), on the embedded vLLM engine at the next slice of a
walk on its workers (``VLLMEngine.full_prefill_tokens``, ``vllm_check``).
The blend server hands it the answers it serves as text (``http_checks``): there the first tokens'
text of full prefill must begin the blend's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import queue
import threading
import time
import weakref
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..calibration import Calibrations, RatioChoice

logger = logging.getLogger(__name__.rsplit(".", 2)[0])

QUEUE = 8  # checks waiting for an idle engine; more are dropped (counted)
TOKENS = 4  # the first tokens compared, where no calibration record says (``CalibrationRecord.tokens``)
TOKENS_MAX = 1 << 16
RETRIES = 3  # times a preempted check runs again before it is dropped
IDLE_POLL_S = 0.02
WAKE_S = 5.0  # how often an idle check thread looks whether its engine is gone
SMOOTHING = 0.3  # the weight of the newest gap between arrivals, and of the newest check's seconds


class Checkable(Protocol):
    """What the live check needs of an engine (``engines.base.Engine`` offers it)."""

    @property
    def calibrations(self) -> Calibrations: ...

    def idle(self) -> bool: ...

    def full_prefill_tokens(self, prompt: Any, tokens: int) -> Sequence[int] | str: ...


class CheckPreempted(Exception):
    """A user's request arrived while a check ran: the check gives way and runs again later."""


def agrees(full: Sequence[int] | str, blended: tuple[int, ...] | str) -> bool:
    """Whether full prefill's first tokens are the blend's: as token ids, or (the server's answers) as
    text, where the text of full prefill's first tokens begins the blend's whole answer (a character cut
    at the last token is decoded as U+FFFD, and left out)."""
    if isinstance(blended, str):
        return isinstance(full, str) and blended.startswith(full.rstrip("\ufffd"))
    return not isinstance(full, str) and tuple(full[: len(blended)]) == blended


def smoothed(mean: float, new: float) -> float:
    return (1 - SMOOTHING) * mean + SMOOTHING * new


@dataclass(frozen=True)
class Check:
    prompt: Any  # what the engine's ``full_prefill_tokens`` runs: a TokenizedPrompt (the server: a request)
    blended: tuple[int, ...] | str  # the blend's first ``tokens`` tokens, or (the server) its answer's text
    tokens: int  # how many of full prefill's first tokens are compared
    base: RatioChoice  # the calibrated policy the request was served under
    rung: float  # the ratio "auto" was on (the live check's rung)
    tries: int = 0


class QualityChecker:
    """One engine's live checks: ``offer`` after each answer, a thread that runs them."""

    def __init__(self, engine: Checkable, share: float, risk: float) -> None:
        # weakly: an engine dropped without close() is freed, and then this thread ends
        self._engine, self.share, self.risk = weakref.ref(engine), share, risk
        self._last_arrival: float | None = None
        self.mean_gap_s = math.inf  # between users' arrivals (smoothed); none yet: no traffic seen
        self.check_s: float | None = None  # a check's run (smoothed); none yet: the first runs when idle
        self._due = 0.0
        self._queue: queue.Queue[Check | None] = queue.Queue(maxsize=QUEUE)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        # offered (eligible requests), picked, checked, agreed, failed, dropped (queue full), preempted, given_up
        # (preempted RETRIES times); seconds: the checks' compute
        self.counts: Counter = Counter()
        self.seconds = 0.0

    def offer(self, prompt: Any, answer: Sequence[int] | str, most: int | None = None) -> bool:
        """Whether this answer (an eligible one: ``Engine._answered``) is checked (``Usage.quality_checked``):
        its token ids, or its text (the server); ``most``: the tokens it was allowed (fewer are compared)."""
        if self.share <= 0:
            return False
        calibrations = self.engine.calibrations
        base = calibrations.calibrated_choice()
        rung = calibrations.live.apply(base).ratio
        share = calibrations.live.share(base, self.share)
        record = calibrations.record()
        tokens = min(record.tokens if record is not None else TOKENS, most or TOKENS_MAX)
        blended = answer if isinstance(answer, str) else tuple(answer[:tokens])
        with self._lock:
            self.counts["offered"] += 1
            self._due += share
            if self._due < 1.0 or self._closed:
                return False
            self._due -= 1.0
            try:
                self._queue.put_nowait(Check(prompt, blended, tokens, base, rung))
            except queue.Full:
                self.counts["dropped"] += 1
                return False
            self.counts["picked"] += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="blend-quality-check", daemon=True)
                self._thread.start()
        return True

    def arrived(self) -> None:
        """A user's request came (the engines call it): the arrival rate a check's start weighs."""
        now = time.monotonic()
        with self._lock:
            if self._last_arrival is not None:
                gap = now - self._last_arrival
                self.mean_gap_s = gap if math.isinf(self.mean_gap_s) else smoothed(self.mean_gap_s, gap)
            self._last_arrival = now

    def lull(self) -> bool:
        """Whether a check of the usual length is unlikely (``risk``) to meet a user's arrival now: with
        arrivals at random at the rate seen, one comes within ``t`` seconds with chance 1 - exp(-t / gap).
        A quiet spell longer than the usual gap counts as the gap: traffic that stopped is no traffic."""
        with self._lock:
            if self.check_s is None or self._last_arrival is None or self.risk >= 1.0:
                return True
            quiet = max(self.mean_gap_s, time.monotonic() - self._last_arrival)
        return -math.expm1(-self.check_s / quiet) <= self.risk

    @property
    def engine(self) -> Checkable:
        engine = self._engine()
        if engine is None:
            raise ReferenceError("the engine these live checks ran on is gone")
        return engine

    def _work(self) -> None:
        while not self._closed:
            try:
                check = self._queue.get(timeout=WAKE_S)
            except queue.Empty:
                if self._engine() is None:
                    return
                continue
            engine = self._engine()
            try:
                if check is None or engine is None:
                    return
                self._check(engine, check)
            finally:
                del engine  # before the check counts as done: a dropped engine is then free (wait)
                self._queue.task_done()

    def _check(self, engine: Checkable, check: Check) -> None:
        while not self._closed and not (engine.idle() and self.lull()):
            time.sleep(IDLE_POLL_S)
        if self._closed:
            return
        started = time.perf_counter()
        agreed: bool | None
        try:
            agreed = agrees(engine.full_prefill_tokens(check.prompt, check.tokens), check.blended)
        except CheckPreempted:
            self.seconds += time.perf_counter() - started
            self.counts["preempted"] += 1
            try:
                if check.tries + 1 >= RETRIES:
                    raise queue.Full
                self._queue.put_nowait(dataclasses.replace(check, tries=check.tries + 1))
            except queue.Full:
                self.counts["given_up"] += 1
            return
        except Exception as e:  # the answer was given: a failed check is counted, never raised
            self.counts["failed"] += 1
            logger.warning(
                "a live quality check failed (%s: %s); the answer it checked was not affected",
                type(e).__name__,
                str(e)[:200],
            )
            agreed = None
        took = time.perf_counter() - started
        self.seconds += took
        if agreed is not None:
            with self._lock:
                self.check_s = took if self.check_s is None else smoothed(self.check_s, took)
            self.counts["checked"] += 1
            self.counts["agreed"] += agreed
        try:
            engine.calibrations.record_check(check.base, check.rung, agreed)
        except Exception as e:  # a store problem: the check is lost, counted
            self.counts["failed"] += 1
            logger.warning("a live quality check could not be stored (%s: %s)", type(e).__name__, str(e)[:200])

    def wait(self, timeout: float = 60.0) -> bool:
        """Wait until every picked check has run and its thread holds the engine no more (tests,
        benchmarks); False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0:  # a check that is run again is queued before it is done
                return True
            time.sleep(IDLE_POLL_S)
        return False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            with contextlib.suppress(queue.Full):  # a full queue: the thread sees _closed at its next check
                self._queue.put_nowait(None)
            thread.join(timeout=30)

    def stats(self) -> dict:
        """The checks so far (this engine's), and the live-check state in use (the store's)."""
        calibrations = self.engine.calibrations
        return {
            "share": self.share,
            "share_now": calibrations.live.share(calibrations.calibrated_choice(), self.share),
            **{
                k: self.counts[k]
                for k in ("offered", "picked", "checked", "agreed", "failed", "dropped", "preempted", "given_up")
            },
            "seconds": round(self.seconds, 3),
            "waiting": self._queue.unfinished_tasks,  # picked, not yet run: waiting for a lull
            "check_s": None if self.check_s is None else round(self.check_s, 4),
            "mean_gap_s": None if math.isinf(self.mean_gap_s) else round(self.mean_gap_s, 4),
            "state": self.engine.calibrations.live.summary(),
        }
