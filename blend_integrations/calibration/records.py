"""Calibration, policy: what a calibration measured and chose (``CalibrationRecord``), the
per-request guard and the ratio choice a request gets, and the record's name in a store."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist
from typing import TYPE_CHECKING, Any

from ..config import SETTINGS, BlendConfig, check_kv_codec, check_ratio
from ..store.format import dtype_name

if TYPE_CHECKING:
    import torch

RECORD_VERSION = 2
# Ratios calibration measures, and the ladder a guard climbs; 1.0 is full prefill's equal and is not run.
LADDER: tuple[float, ...] = (0.05, 0.1, 0.12, 0.15, 0.2, 0.3, 0.5, 0.7, 0.9)


class CalibrationError(ValueError):
    """Calibration cannot run as asked; the message says why."""


def record_name(fingerprint: str, dtype: Any, kv_codec: str | None = None) -> str:
    """The store record of a model's calibration: one per checkpoint, KV
    dtype and the store's KV codec (a lossy codec may need another ratio)."""
    name = dtype if isinstance(dtype, str) else dtype_name(dtype)
    return f"calibration.{fingerprint[:64]}.{name}" + (f".{kv_codec}" if kv_codec is not None else "")


def wilson_lower(successes: int, n: int, confidence: float) -> float:
    """One-sided Wilson score lower bound of a proportion (0 for no trials)."""
    if n == 0:
        return 0.0
    z = NormalDist().inv_cdf(confidence)
    p = successes / n
    centre = p + z * z / (2 * n)
    margin = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, (centre - margin) / (1 + z * z / n))


def max_misses(n: int, target: float, confidence: float) -> int:
    """The most disagreements out of ``n`` that still meet ``target`` (-1: none does)."""
    return max((f for f in range(n + 1) if wilson_lower(n - f, n, confidence) >= target), default=-1)


@dataclass(frozen=True)
class RankShares:
    """``shares(r)``: the part of the total score the first check layer ranks
    the reused tokens by (their deviation; for a selection by the query, the
    query's attention) that the top ``r`` of them hold: how concentrated the
    ranking is, which the calibration's guard reads. ``cumulative[i]`` is
    that part for the top ``i + 1`` tokens (empty when every score is 0: every
    share is 1.0); plain floats, so it travels from vLLM's worker as it is."""

    cumulative: tuple[float, ...]

    @classmethod
    def of(cls, scores: torch.Tensor) -> RankShares:  # the walk's scores (fusion.selection)
        summed = scores.float().sort(descending=True).values.cumsum(0)
        total = float(summed[-1]) if summed.numel() else 0.0
        return cls(tuple((summed / total).tolist()) if total > 0 else ())  # (): every share is 1.0

    @classmethod
    def even(cls, n: int) -> RankShares:
        """A ranking that tells nothing: every one of ``n`` tokens scores the same, so the top
        ``r`` hold ``r`` of the score (the guard raises the ratio as far as it may)."""
        return cls(tuple((i + 1) / n for i in range(n)))

    def __call__(self, r: float) -> float:
        n = len(self.cumulative)
        count = min(round(r * n), n)
        return 1.0 if n == 0 else (self.cumulative[count - 1] if count else 0.0)


@dataclass(frozen=True)
class Guard:
    """Recompute more for a request whose ranking is spread out: when the
    top ``base`` share of its reused tokens holds less than ``threshold`` of
    the score the check layer ranks them by (their deviation; for a selection
    by the query, its attention), use the first ratio of ``ladder`` above
    ``base`` whose top share holds ``threshold`` (1.0 if none does)."""

    base: float
    threshold: float
    ladder: tuple[float, ...] = LADDER

    def ratio(self, captured: Callable[[float], float]) -> float:
        """The request's ratio, given ``captured(r)``: the share of its
        ranking's score the top ``r`` of its reused tokens hold."""
        for r in (r for r in (*self.ladder, 1.0) if r >= self.base):
            if r >= 1.0 or captured(r) >= self.threshold:
                return r
        return 1.0


@dataclass(frozen=True)
class RatioChoice:
    """The recompute ratio a request is planned with, where it came from, and
    the guard that may raise it in the walk."""

    ratio: float
    source: str  # config.RATIO_SOURCES
    guard: Guard | None = None
    settings: dict | None = None  # the blend settings it was calibrated under (``config.SETTINGS``); None: the config's
    dtype: str | None = None  # the dtype its calibration was measured in; None: not from a calibration


@dataclass(frozen=True)
class CalibrationRecord:
    """What calibration measured and chose for one model and dtype.

    ratio: the cheapest single ratio meeting the target (1.0 if none below
    does), with ``settings``, the blend settings (``config.SETTINGS``) it was
    measured under; guard: the guard policy, when cheaper than ``ratio`` at
    the target, under ``guard_settings`` (every engine runs it: on vLLM,
    in the worker, ``engines/vllm_answers.py``). curve: every
    policy measured, with its cost, agreement, lower bound, KL, mean ratio
    and TTFT speedup. kv_codec: the store's KV codec it was measured under
    (None: raw); codecs_checked: other codecs whose own calibration chose
    the same policy, so that ``"auto"`` may use this record under them too.
    A record is used under no other codec."""

    model: str
    fingerprint: str
    dtype: str
    settings: dict
    ratio: float
    guard: Guard | None
    meets_target: bool
    target: float
    confidence: float
    tokens: int
    n: int
    curve: list[dict]
    date: str
    package_version: str
    engine: str
    seconds: float = 0.0
    why: str = ""  # how the choice was made, in words
    min_speedup: float = 1.0  # a policy measured less sooner than full prefill than this is not chosen
    guard_settings: dict | None = None
    kv_codec: str | None = None
    codecs_checked: list[str] = dataclasses.field(default_factory=list)
    # the kinds of question the probes came from, each with its probe count: a policy meets the
    # target only where it meets it on every one of them (the worst decides)
    tasks: dict[str, int] = dataclasses.field(default_factory=dict)

    def holds_under(self, kv_codec: str | None) -> bool:
        """Whether ``"auto"`` may use this record in a store of ``kv_codec``. One
        that chose full prefill holds under every codec: it is run as full
        prefill (``in_full``) and reads no stored KV."""
        runs_in_full = self.ratio >= 1.0 and self.guard is None
        return runs_in_full or kv_codec == self.kv_codec or kv_codec in self.codecs_checked

    def to_bytes(self) -> bytes:
        data = dataclasses.asdict(self)
        data["guard"] = dataclasses.asdict(self.guard) if self.guard is not None else None
        return json.dumps({"kind": "blend-calibration", "version": RECORD_VERSION, **data}, sort_keys=True).encode()

    @classmethod
    def from_bytes(
        cls, raw: bytes, *, fingerprint: str, dtype: str, num_layers: int | None = None
    ) -> CalibrationRecord:
        """Parse and check a stored record (its check layers against the
        model's ``num_layers``); raises CalibrationError naming what is wrong.
        Records from before KV codecs (no ``kv_codec``) were measured raw;
        those from before tasks (no ``tasks``) on one kind of question."""
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CalibrationError(f"the calibration record is not JSON ({e})") from None
        if not isinstance(data, dict) or data.get("kind") != "blend-calibration":
            raise CalibrationError("the record is not a blend calibration record")
        if data.get("version") != RECORD_VERSION:
            raise CalibrationError(
                f"calibration record version {data.get('version')!r}; this package reads {RECORD_VERSION}"
            )
        if data.get("fingerprint") != fingerprint or data.get("dtype") != dtype:
            raise CalibrationError(
                f"the calibration record is for another model or dtype ({str(data.get('fingerprint'))[:12]}... "
                f"{data.get('dtype')}), not this one ({fingerprint[:12]}... {dtype})"
            )
        try:
            guard = data["guard"]
            record = cls(
                **{
                    f.name: data[f.name]
                    for f in dataclasses.fields(cls)
                    if f.name != "guard" and (f.name in data or f.name not in ("kv_codec", "codecs_checked", "tasks"))
                },
                guard=None
                if guard is None
                else Guard(float(guard["base"]), float(guard["threshold"]), tuple(float(r) for r in guard["ladder"])),
            )
            check_ratio(record.ratio)
            check_kv_codec(record.kv_codec)
            if not isinstance(record.codecs_checked, list):
                raise ValueError("codecs_checked must be a list")
            for codec in record.codecs_checked:
                check_kv_codec(codec)
            if not isinstance(record.tasks, dict) or not all(
                isinstance(k, str) and type(v) is int and v > 0 for k, v in record.tasks.items()
            ):
                raise ValueError("tasks must map names to probe counts")
            if record.guard is not None:
                check_ratio(record.guard.base)
                check_ratio(record.guard.threshold, name="guard threshold")
                if not record.guard.ladder or list(record.guard.ladder) != sorted(record.guard.ladder):
                    raise ValueError("the guard's ladder must be increasing")
                for r in record.guard.ladder:
                    check_ratio(r, name="guard ladder ratio")
            for settings in (record.settings, record.guard_settings):
                if settings is None and settings is record.guard_settings and record.guard is None:
                    continue
                if not isinstance(settings, dict) or set(settings) != set(SETTINGS):
                    raise ValueError(f"settings must name {', '.join(SETTINGS)}")
                BlendConfig().with_settings(settings, num_layers=num_layers)
        except (KeyError, TypeError, ValueError) as e:
            raise CalibrationError(f"the calibration record is damaged: {type(e).__name__}: {e}") from None
        return record

    def choice(self, *, source: str = "calibrated") -> RatioChoice:
        if self.guard is not None and self.meets_target:
            return RatioChoice(self.guard.base, source, self.guard, self.guard_settings, self.dtype)
        return RatioChoice(self.ratio, source, settings=self.settings, dtype=self.dtype)


def settings_label(settings: dict, base: dict | None = None) -> str:
    """``settings`` in words: those that differ from ``base`` (None: from ``BlendConfig()``'s)."""
    base = BlendConfig().settings() if base is None else base
    changed = {k: v for k, v in settings.items() if base.get(k) != v}
    return ", ".join(f"{k}={v}" for k, v in changed.items()) or "default"
