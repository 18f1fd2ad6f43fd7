"""Calibration, live check: how often ``"auto"``'s blended answers agreed with full prefill on
the user's own traffic (``BlendConfig.quality_check``), kept in the chunk store beside the
calibration record, and the rung of the ladder that evidence puts ``"auto"`` on.

Each rung (a ratio, the calibrated policy's own or one of ``LADDER`` above it, then 1.0) is
judged over windows of ``window`` checked answers, by the rule calibration chooses by: a
window must be able to show the target at ``confidence`` with its Wilson lower bound
(``choice.max_misses``). The moment a window's misses rule that out, ``"auto"`` steps up one
rung. A raised rung that passes ``STEP_DOWN_WINDOWS`` windows in a row steps back down one
(twice as many for each time the rung below failed), never below the calibrated policy. Where
the answers hold, the checks cost less (``LiveCheck.share``): each window a rung passes in a
row halves the share of requests checked, down to ``MIN_SHARE_FACTOR`` of it, and a policy a
calibration measured starts there, until a window of its checks misses.

The state is one JSON record per model, dtype, engine and codec, for one calibrated policy
(another policy, e.g. after a new calibration, starts afresh). Every process and machine on
the store reads it within ``RELOAD_S`` and adds its checks to it: read, change and write under a
file lock in the store's directory (processes on one machine; across machines through Redis a
check written at the same instant as another's may be lost, never a step taken twice).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..store import ChunkStore
from .records import LADDER, RatioChoice, max_misses, wilson_lower

logger = logging.getLogger(__name__.rsplit(".", 1)[0])

STATE_VERSION = 1
WINDOW = 100  # checked answers a rung is judged over (at 0.95 and 0.8: 3 misses allowed)
STEP_DOWN_WINDOWS = 2  # windows a raised rung passes in a row before the rung below is tried again
KEEP_STEPS = 20  # the latest steps a state keeps, for operators
# A rung whose windows showed the target in a row is checked less: the share halves per window, down to this.
MIN_SHARE_FACTOR = 1 / 8
# The sources of a policy a calibration measured to show the target (the user's, or the packaged one with its
# held-out lower bound): checked at MIN_SHARE_FACTOR of the share from the start, until a window misses.
VOUCHED = ("calibrated", "packaged")
DEFAULT_TARGET, DEFAULT_CONFIDENCE = 0.95, 0.8  # what a fallback (no calibration) is held to


class LiveCheckError(ValueError):
    """A stored live-check state is damaged or foreign; the message says what."""


def state_name(fingerprint: str, dtype: str, engine: str, kv_codec: str | None) -> str:
    """The store record of a model's live-check state on one engine (beside ``records.record_name``)."""
    return f"quality-check.{fingerprint[:64]}.{dtype}.{engine}" + (f".{kv_codec}" if kv_codec is not None else "")


def policy_key(choice: RatioChoice) -> str:
    """What identifies the calibrated policy a state extends: its ratio, guard, settings, dtype and source."""
    guard = None if choice.guard is None else [choice.guard.base, choice.guard.threshold, list(choice.guard.ladder)]
    raw = json.dumps([choice.source, choice.ratio, guard, choice.settings, choice.dtype], sort_keys=True)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def window_size(target: float, confidence: float) -> int:
    """``WINDOW``, or more where a target so high needs it for a window to allow one miss."""
    n = WINDOW
    while max_misses(n, target, confidence) < 1 and n < 20 * WINDOW:
        n += WINDOW
    return n


def rungs_above(base: float) -> list[float]:
    """The ratios a policy at ``base`` steps up through: ``LADDER``'s above it, then 1.0 (full prefill)."""
    return [r for r in LADDER if r > base] + ([1.0] if base < 1.0 else [])


@dataclass
class Rung:
    """One rung's checks: in all, in the current window, and its windows."""

    checked: int = 0
    agreed: int = 0
    window_checked: int = 0
    window_missed: int = 0
    passed_in_a_row: int = 0  # windows that showed the target, in a row
    failed: int = 0  # times "auto" stepped up from it


@dataclass
class LiveState:
    """A model's live-check state for one calibrated policy (``policy``, ``policy_key``)."""

    policy: str
    base: float  # the calibrated policy's ratio: the floor
    rung: float  # the ratio "auto" uses now
    target: float
    confidence: float
    rungs: dict[str, Rung] = field(default_factory=dict)
    steps: list[dict] = field(default_factory=list)  # the latest KEEP_STEPS steps, oldest first
    failed_checks: int = 0  # checks that could not run (counted, never judged)
    updated: float = 0.0

    def counts(self, rung: float | None = None) -> Rung:
        return self.rungs.setdefault(f"{self.rung if rung is None else rung:g}", Rung())

    @property
    def why(self) -> str:
        """Why "auto" is on this rung, in words: the latest step's reason, or that none was taken."""
        return self.steps[-1]["why"] if self.steps else "the calibrated policy: no check has moved it"

    def to_bytes(self) -> bytes:
        return json.dumps(
            {"kind": "blend-quality-check", "version": STATE_VERSION, **dataclasses.asdict(self)}
        ).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> LiveState:
        try:
            data = json.loads(raw)
            if not isinstance(data, dict) or data.get("kind") != "blend-quality-check":
                raise LiveCheckError("the record is not a live-check state")
            if data.get("version") != STATE_VERSION:
                raise LiveCheckError(f"live-check state version {data.get('version')!r}; this package reads 1")
            rungs = {
                str(k): Rung(**{f: int(v[f]) for f in Rung.__dataclass_fields__}) for k, v in data["rungs"].items()
            }
            state = cls(
                policy=str(data["policy"]),
                base=float(data["base"]),
                rung=float(data["rung"]),
                target=float(data["target"]),
                confidence=float(data["confidence"]),
                rungs=rungs,
                steps=[dict(s) for s in data["steps"]][-KEEP_STEPS:],
                failed_checks=int(data["failed_checks"]),
                updated=float(data["updated"]),
            )
        except LiveCheckError:
            raise
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise LiveCheckError(f"the live-check state is damaged: {type(e).__name__}: {e}") from None
        ladder = [state.base, *rungs_above(state.base)]
        if not (0.0 <= state.base <= 1.0 and state.rung in ladder and 0.0 < state.target <= 1.0):
            raise LiveCheckError(f"the live-check state's rung {state.rung} is not on its ladder from {state.base}")
        if not 0.0 < state.confidence < 1.0 or any(
            r.agreed > r.checked or r.window_missed > r.window_checked or min(dataclasses.astuple(r)) < 0
            for r in rungs.values()
        ):
            raise LiveCheckError("the live-check state's counts are inconsistent")
        return state

    def judge(self, agreed: bool) -> dict | None:
        """Add one check of the rung in use; return the step it takes, if any."""
        here = self.counts()
        here.checked += 1
        here.agreed += agreed
        here.window_checked += 1
        here.window_missed += not agreed
        self.updated = time.time()
        window = window_size(self.target, self.confidence)
        allowed = max_misses(window, self.target, self.confidence)
        if here.window_missed > allowed:
            above = rungs_above(self.rung)
            bound = wilson_lower(here.window_checked - here.window_missed, here.window_checked, self.confidence)
            why = (
                f"{here.window_missed} of {here.window_checked} checked answers at ratio {self.rung:g} disagreed with "
                f"full prefill (lower bound {bound:.3f}), more than the {allowed} a window of {window} may miss to "
                f"show {self.target:g} at {self.confidence:g}"
            )
            here.failed += 1
            self._reset_window(here)
            return self._step(above[0], why) if above else None
        if here.window_checked < window:
            return None
        here.passed_in_a_row += 1
        bound = wilson_lower(window - here.window_missed, window, self.confidence)
        self._reset_window(here, keep_streak=True)
        if self.rung <= self.base:
            return None
        below = max([self.base, *(r for r in LADDER if self.base < r < self.rung)])
        need = STEP_DOWN_WINDOWS * 2 ** self.counts(below).failed
        if here.passed_in_a_row < need:
            return None
        here.passed_in_a_row = 0
        why = (
            f"{need} windows of {window} checked answers at ratio {self.rung:g} in a row showed {self.target:g} "
            f"(the last: lower bound {bound:.3f}): trying {below:g} again"
        )
        return self._step(below, why)

    @staticmethod
    def _reset_window(rung: Rung, keep_streak: bool = False) -> None:
        rung.window_checked = rung.window_missed = 0
        if not keep_streak:
            rung.passed_in_a_row = 0

    def _step(self, to: float, why: str) -> dict:
        step = {"from": self.rung, "to": to, "why": why, "at": time.time()}
        self.rung = to
        self._reset_window(self.counts())
        self.steps = [*self.steps, step][-KEEP_STEPS:]
        return step


class LiveCheck:
    """A model's live-check state as one engine sees it: read with the
    calibration (``Calibrations``), applied to the ratio ``"auto"`` chooses,
    and changed by each check this process ran (``record``)."""

    def __init__(self, store: ChunkStore, name: str, label: str) -> None:
        self.store, self.name, self.label = store, name, label
        self.state: LiveState | None = None
        self._said: set[str] = set()

    def reload(self) -> None:
        self.state = self._read()

    def _read(self) -> LiveState | None:
        try:
            raw = self.store.get_record(self.name)
            return None if raw is None else LiveState.from_bytes(raw)
        except Exception as e:  # a damaged state is a fresh start, never a failed request
            self._say(f"the live-check state {self.name} is not used: {e}")
            return None

    def apply(self, base: RatioChoice) -> RatioChoice:
        """``base`` (the calibrated policy, or the fallback) on the rung the checks put it on."""
        state = self.state
        if state is None or state.policy != policy_key(base) or state.rung <= base.ratio:
            return base
        guard = None
        if base.guard is not None and state.rung < 1.0:  # the guard still raises a request above the rung
            guard = dataclasses.replace(base.guard, base=state.rung)
        return RatioChoice(state.rung, "checked", guard, base.settings, base.dtype)

    def record(self, base: RatioChoice, rung: float, agreed: bool | None, target: float, confidence: float) -> None:
        """One check of a request ``"auto"`` served at ``rung`` under ``base``: it agreed,
        disagreed, or (None) could not run. A check of a rung no longer in use is dropped."""
        key = policy_key(base)
        with self._locked():
            state = self._read()
            if state is None or state.policy != key:
                state = LiveState(key, base.ratio, base.ratio, target, confidence)
            if agreed is None:
                state.failed_checks += 1
                step = None
            elif rung != state.rung:
                return  # served before a step another check took
            else:
                step = state.judge(agreed)
            self.store.put_record(self.name, state.to_bytes())
            self.state = state
        if step is not None:
            logger.warning(
                'model %s: the live check moved "auto" from ratio %g to %g: %s',
                self.label,
                step["from"],
                step["to"],
                step["why"],
            )

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        path = Path(self.store.path) / f".{self.name}.lock"
        with open(path, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def share(self, base: RatioChoice, configured: float) -> float:
        """The share of requests to check now. ``configured`` where the rung in use is in doubt: a
        miss in its current window, a rung the checks raised that no window has passed yet, or the
        fallback; halved for each window it passed in a row, down to ``MIN_SHARE_FACTOR`` of it. A
        calibrated policy on its own rung starts at that floor: its calibration showed the target."""
        state = self.state if self.state is not None and self.state.policy == policy_key(base) else None
        here = state.counts() if state is not None else Rung()
        if here.window_missed:
            return configured
        if base.source in VOUCHED and (state is None or state.rung <= state.base):
            return configured * MIN_SHARE_FACTOR
        return configured * max(MIN_SHARE_FACTOR, 0.5**here.passed_in_a_row)

    def summary(self) -> dict[str, Any] | None:
        """The state in use: the rung, why, and each rung's running agreement with its lower bound."""
        state = self.state
        if state is None:
            return None
        return {
            "ratio": state.rung,
            "base": state.base,
            "why": state.why,
            "failed_checks": state.failed_checks,
            "rungs": {
                k: {
                    "checked": r.checked,
                    "agreed": r.agreed,
                    "lower_bound": round(wilson_lower(r.agreed, r.checked, state.confidence), 4),
                }
                for k, r in state.rungs.items()
                if r.checked
            },
        }

    def _say(self, why: str) -> None:
        if why not in self._said:
            self._said.add(why)
            logger.warning("model %s: %s", self.label, why)
