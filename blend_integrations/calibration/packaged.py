"""Calibration, policy: the calibrations this package ships (``data/calibrations/``), measured
on held-out questions by ``benchmarks calibration --package``, with what the benchmark measured of them."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from .records import CalibrationError, CalibrationRecord, settings_label, wilson_lower

logger = logging.getLogger(__name__.rsplit(".", 1)[0])

PACKAGED_KIND = "blend-packaged-calibration"
# How a file's ``why`` begins and ends where the shipping rule replaced its policy with full prefill.
HELD_OUT_SHORT = "held out, the chosen policy falls short of the target"
NOT_SHIPPED = ": not shipped; full prefill"
PACKAGED_VERSION = 1
# The calibrations shipped with the package: one file per shipped model and engine.
PACKAGED_DIR = Path(__file__).parent.parent / "data" / "calibrations"


def packaged_name(label: str, engine: str) -> str:
    return f"{label}-{engine}.json"


def held_out_bounds(rows: dict[str, dict], confidence: float) -> dict[str, dict]:
    """The chosen policy's row for each held-out kind of question (``agreement``, ``n`` questions, and
    ``agreement_lower`` where it was measured) with its lower bound: computed here where it is missing,
    so that a row without one never passes the shipping rule by default."""
    return {
        name: {**row, "agreement_lower": row.get("agreement_lower")}
        if row.get("agreement_lower") is not None
        else {**row, "agreement_lower": wilson_lower(round(row["agreement"] * row["n"]), row["n"], confidence)}
        for name, row in rows.items()
    }


def held_out_shortfalls(rows: dict[str, dict], target: float, confidence: float) -> dict[str, dict]:
    """The rule a blending policy ships by: on every held-out kind of question, its agreement with
    full prefill meets ``target`` at its lower bound (``held_out_bounds``). Returns the kinds that
    fall short, each row with its bound."""
    return {name: r for name, r in held_out_bounds(rows, confidence).items() if r["agreement_lower"] < target}


@dataclass(frozen=True)
class PackagedCalibration:
    """A calibration this package ships for a model it ships (``PACKAGED_DIR``),
    measured by ``python -m benchmarks calibration --package`` on one engine,
    with what the benchmark measured on held-out questions (``held_out``:
    ``questions``, ``tokens``, and for ``"calibrated"`` and ``"fallback"`` the
    ``ratio``, ``agreement`` with full prefill, share answered ``right`` and
    ``ttft_speedup``; ``full_right``)."""

    record: CalibrationRecord
    held_out: dict
    cpu: str
    path: Path

    def to_bytes(self) -> bytes:
        data = {
            "kind": PACKAGED_KIND,
            "version": PACKAGED_VERSION,
            "record": json.loads(self.record.to_bytes()),
            "held_out": self.held_out,
            "cpu": self.cpu,
        }
        return (json.dumps(data, indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def from_bytes(cls, raw: bytes, path: Path) -> PackagedCalibration:
        """Parse and check a packaged file; raises CalibrationError naming what is wrong."""
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CalibrationError(f"{path.name} is not JSON ({e})") from None
        if not isinstance(data, dict) or data.get("kind") != PACKAGED_KIND:
            raise CalibrationError(f"{path.name} is not a packaged blend calibration")
        if data.get("version") != PACKAGED_VERSION:
            raise CalibrationError(
                f"{path.name}: version {data.get('version')!r}; this package reads {PACKAGED_VERSION}"
            )
        record = data.get("record")
        held = data.get("held_out")
        if not isinstance(record, dict) or not isinstance(held, dict):
            raise CalibrationError(f"{path.name} is damaged: it needs a record and held_out")
        parsed = CalibrationRecord.from_bytes(
            json.dumps(record).encode(), fingerprint=str(record.get("fingerprint")), dtype=str(record.get("dtype"))
        )
        try:
            for part in ("calibrated", "fallback"):
                row = held[part]
                for field in ("ratio", "agreement", "right", "ttft_speedup"):
                    value = row[field]
                    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                        raise ValueError(f"held_out.{part}.{field} must be a finite number")
            if not isinstance(held["questions"], int) or not isinstance(held["tokens"], int):
                raise ValueError("held_out.questions and held_out.tokens must be integers")
        except (KeyError, TypeError, ValueError) as e:
            raise CalibrationError(f"{path.name} is damaged: {type(e).__name__}: {e}") from None
        return cls(parsed, held, str(data.get("cpu", "")), path)

    def shortfalls(self) -> dict[str, dict]:
        """The held-out kinds of question on which this file's blending policy breaks the shipping rule
        (``held_out_shortfalls``); none for full prefill. Files from before SQuAD was held out
        measured the generated kind alone."""
        r, held = self.record, self.held_out
        if r.ratio >= 1.0 and r.guard is None:
            return {}
        tasks = held.get("tasks") or {"generated": held}
        rows = {name: {**t["calibrated"], "n": t["questions"]} for name, t in tasks.items()}
        return held_out_shortfalls(rows, r.target, r.confidence)

    def under_shipping_rule(self) -> PackagedCalibration:
        """This calibration, or, where its policy breaks the shipping rule, full prefill, saying why."""
        short = self.shortfalls()
        if not short:
            return self
        fell = "; ".join(
            f"{name}: {row['agreement']:.3f} agree (at least {row['agreement_lower']:.3f}) of {row['n']}"
            for name, row in short.items()
        )
        why = f"{HELD_OUT_SHORT} {self.record.target} at its lower bound ({fell}){NOT_SHIPPED}"
        record = dataclasses.replace(
            self.record, ratio=1.0, guard=None, guard_settings=None, meets_target=False, why=why
        )
        return dataclasses.replace(self, record=record)

    def meaning(self) -> str:
        """What the packaged ratio means for this model, in one plain sentence of measured numbers."""
        r, held = self.record, self.held_out
        cal, fb = held["calibrated"], held["fallback"]
        n, tokens = held["questions"], held["tokens"]
        choice = r.choice()  # what "auto" runs: the guard, when there is one
        label = settings_label(choice.settings or r.settings)
        notes = ([] if r.guard is None else [f"a guard from {r.guard.base:g}"]) + (
            [] if label == "default" else [label]
        )
        settings = f" ({'; '.join(notes)})" if notes else ""
        at = f"ratio {cal['ratio']:g}" if r.guard is None else f"a mean ratio of {cal['ratio']:g}"
        if r.ratio >= 1.0 and r.guard is None and r.why.startswith(HELD_OUT_SHORT):
            head = f"{r.model} runs full prefill: {r.why.removesuffix(NOT_SHIPPED)}"
        elif r.ratio >= 1.0 and r.guard is None:
            head = (
                f"{r.model} needs full recompute to keep full prefill's first {tokens} tokens on {r.target:.0%} "
                f"of prompts (calibrated on {r.n} prompts)"
            )
        else:
            lower = wilson_lower(round(cal["agreement"] * n), n, r.confidence)
            head = (
                f"{r.model} keeps full prefill's first {tokens} tokens on {cal['agreement']:.0%} (at least "
                f"{lower:.0%}, at {r.confidence:.0%} confidence) of {n} held-out questions at {at}{settings}, "
                f"{cal['ttft_speedup']:.2f}x sooner"
            )
        if r.guard is None and r.ratio == fb["ratio"] and not settings:
            return f"{head} ({r.engine} engine, {r.dtype}, {self.cpu})."
        changed = 1.0 - fb["agreement"]
        plain = " with the default settings" if settings else ""
        return (
            f"{head}; at ratio {fb['ratio']:g}{plain} it is {fb['ttft_speedup']:.2f}x sooner but changes {changed:.0%} "
            f"of {n} held-out answers' first {tokens} tokens ({r.engine} engine, {r.dtype}, {self.cpu})."
        )


@functools.lru_cache(maxsize=1)
def packaged_calibrations() -> dict[tuple[str, str, str], PackagedCalibration]:
    """Every packaged calibration by (fingerprint, dtype, engine); a damaged file is refused with a warning."""
    found: dict[tuple[str, str, str], PackagedCalibration] = {}
    for path in sorted(PACKAGED_DIR.glob("*.json")):
        try:
            packaged = PackagedCalibration.from_bytes(path.read_bytes(), path)
        except (OSError, CalibrationError) as e:
            logger.warning("the packaged calibration %s is refused: %s", path.name, e)
            continue
        if packaged.shortfalls():  # never blend on a policy its own held-out numbers do not back
            packaged = packaged.under_shipping_rule()
            logger.warning("the packaged calibration %s runs full prefill: %s", path.name, packaged.record.why)
        r = packaged.record
        found[(r.fingerprint, r.dtype, r.engine)] = packaged
    return found
