"""Calibration, policy: the calibration a model's engine uses at request time (the store's
record, else the packaged one, else the fallback), and the ratio each blend request gets."""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

from ..config import FALLBACK_RATIO, BlendConfig
from ..store import ChunkStore
from ..store.format import dtype_name
from .live_check import DEFAULT_CONFIDENCE, DEFAULT_TARGET, LiveCheck, state_name
from .packaged import PackagedCalibration, packaged_calibrations
from .records import CalibrationError, CalibrationRecord, RatioChoice, record_name

logger = logging.getLogger(__name__.rsplit(".", 1)[0])

# How often an engine looks for a new calibration record in its store (another process may write one).
RELOAD_S = 1.0
# A calibration measured in one of these serves the same model and engine in the others, where none
# measured in that dtype exists: a CPU without bfloat16 instructions runs a bfloat16 checkpoint in
# float32, and there Qwen2.5-Coder-1.5B's bfloat16 policy beat the fallback on SQuAD
# (docs/calibration.md#dtypes).
SERVES_DTYPES: tuple[str, ...] = ("bfloat16", "float32", "float16")


class Calibrations:
    """One model's calibration as its engine sees it: the store's record (the
    user's own calibration), read again at most every ``RELOAD_S`` seconds
    (another process may have calibrated), and checked; else the calibration
    this package ships for the model on this ``engine``, if any; each
    measured in this dtype, else in another floating-point one
    (``SERVES_DTYPES``). Says once per problem why a record is not used.
    ``live``: the live check's state (``live_check``), read with the record,
    which may have put ``"auto"`` on a higher rung than the calibrated one."""

    def __init__(
        self,
        store: ChunkStore,
        fingerprint: str,
        dtype: Any,
        *,
        engine: str,
        num_layers: int | None = None,
        label: str = "",
    ) -> None:
        self.store = store
        self.fingerprint = fingerprint
        self.dtype = dtype if isinstance(dtype, str) else dtype_name(dtype)
        self.engine = engine
        self.num_layers = num_layers
        self.label = label or fingerprint[:12]
        self._record: CalibrationRecord | None = None
        self._source = "fallback"
        self._read_at = -math.inf
        self._said: set[str] = set()
        self._lock = threading.Lock()
        self.live = LiveCheck(store, self._state_name(), self.label)

    @property
    def name(self) -> str:
        """The record's name in the store: its codec's (``record_name``)."""
        return self._name(self.dtype)

    def use_store(self, store: ChunkStore) -> None:
        with self._lock:
            self.store, self._record, self._read_at = store, None, -math.inf
            self.live = LiveCheck(store, self._state_name(), self.label)

    def _state_name(self) -> str:
        return state_name(self.fingerprint, self.dtype, self.engine, self.store.kv_codec)

    def record(self) -> CalibrationRecord | None:
        return self.current()[0]

    def source(self) -> str:
        """Where the record in use comes from: "calibrated" (the store), "packaged", or "fallback" (none)."""
        return self.current()[1]

    def current(self) -> tuple[CalibrationRecord | None, str]:
        with self._lock:
            if time.monotonic() - self._read_at >= RELOAD_S:
                self._read_at = time.monotonic()
                self._record, self._source = self._read()
                self.live.reload()
            return self._record, self._source

    def packaged(self) -> PackagedCalibration | None:
        """The calibration this package ships for this model and engine, if
        any: measured in this dtype, else in another (``dtypes``)."""
        for dtype in self.dtypes():
            packaged = self._packaged(dtype)
            if packaged is not None:
                return packaged
        return None

    def _packaged(self, dtype: str) -> PackagedCalibration | None:
        packaged = packaged_calibrations().get((self.fingerprint, dtype, self.engine))
        if packaged is not None and not packaged.record.holds_under(self.store.kv_codec):
            self._say(
                f"the packaged calibration {packaged.path.name} was measured on a {packaged.record.kv_codec or 'raw'} "
                f"store, and is not shown to hold for this store's {self.store.kv_codec} chunks: calibrate under it"
            )
            return None
        if packaged is not None and self.num_layers is not None:
            try:  # its settings must fit this model (a record of the same fingerprint always does)
                BlendConfig().with_settings(packaged.record.settings, num_layers=self.num_layers)
            except (TypeError, ValueError) as e:
                self._say(f"the packaged calibration {packaged.path.name} is refused: {e}")
                return None
        return packaged

    def choice(self) -> RatioChoice:
        """The ratio ``"auto"`` gives a request now: the user's calibration, else
        the packaged one, else the fallback; on the rung the live check put it on."""
        return self.live.apply(self.calibrated_choice())

    def calibrated_choice(self) -> RatioChoice:
        """``choice`` before the live check: the policy the checks are judged against."""
        record, source = self.current()
        if record is None:
            return self.fallback()
        return record.choice(source=source)

    def record_check(self, base: RatioChoice, rung: float, agreed: bool | None) -> None:
        """One live check of a request served at ``rung`` under ``base``
        (``calibrated_choice``): it agreed with full prefill, or not, or (None)
        could not run. Judged against the record's target (the fallback: 0.95)."""
        record = self.record()
        target = record.target if record is not None else DEFAULT_TARGET
        confidence = record.confidence if record is not None else DEFAULT_CONFIDENCE
        self.live.record(base, rung, agreed, target, confidence)

    def set(self, record: CalibrationRecord) -> None:
        """Use ``record`` now (just written by ``calibrate``)."""
        with self._lock:
            self._record, self._source, self._read_at = record, "calibrated", time.monotonic()

    def _read(self) -> tuple[CalibrationRecord | None, str]:
        for dtype in self.dtypes():
            record, source, where = self._read_store(dtype), "calibrated", f"the store's {self._name(dtype)}"
            if record is None:
                packaged = self._packaged(dtype)
                if packaged is None:
                    continue
                record, source, where = packaged.record, "packaged", f"the packaged {packaged.path.name}"
            if dtype != self.dtype:
                self._say(
                    f"no calibration was measured in {self.dtype} for this model on the {self.engine} engine; "
                    f'"auto" runs {where}, measured in {dtype} (a policy serves every floating-point dtype '
                    f"of its model and engine: docs/calibration.md#dtypes)",
                    level=logging.INFO,
                )
            return record, source
        return None, "fallback"

    def dtypes(self) -> tuple[str, ...]:
        """The dtypes whose calibration ``"auto"`` may use, in order: this
        engine's own, then the other floating-point ones (``SERVES_DTYPES``)."""
        return (
            (self.dtype, *(d for d in SERVES_DTYPES if d != self.dtype))
            if self.dtype in SERVES_DTYPES
            else (self.dtype,)
        )

    def _name(self, dtype: str) -> str:
        return record_name(self.fingerprint, dtype, self.store.kv_codec)

    def _read_store(self, dtype: str) -> CalibrationRecord | None:
        name = self._name(dtype)
        try:
            raw = self.store.get_record(name)
        except Exception as e:  # a store problem is a miss, never a failed request
            self._say(f"reading the calibration record failed ({type(e).__name__}: {e})")
            return None
        if raw is None:
            return None
        try:
            record = CalibrationRecord.from_bytes(
                raw, fingerprint=self.fingerprint, dtype=dtype, num_layers=self.num_layers
            )
        except CalibrationError as e:
            self._say(f"the store's calibration record {name} is refused: {e}")
            return None
        if record.kv_codec != self.store.kv_codec:
            self._say(
                f"the store's calibration record {name} is refused: it was measured on "
                f"{record.kv_codec or 'raw'} chunks, not {self.store.kv_codec or 'raw'} ones"
            )
            return None
        return record

    def _say(self, why: str, level: int = logging.WARNING) -> None:
        if why not in self._said:
            self._said.add(why)
            logger.log(level, "model %s: %s", self.label, why)

    def fallback(self) -> RatioChoice:
        self._say(
            f"no calibration for this model in the store {self.store.path} applies, and {self._why_no_packaged()}: "
            f"blending at the fallback ratio {FALLBACK_RATIO}, which may cost answers on small models. Calibrate "
            f"once: engine.calibrate(documents) or `python -m blend_integrations.calibrate MODEL --store "
            f"{self.store.path} --documents DIR`"
        )
        return RatioChoice(FALLBACK_RATIO, "fallback")

    def _why_no_packaged(self) -> str:
        """Why no packaged calibration applies: the real reason, for the fallback's message."""
        shipped = [p for (fingerprint, _, _), p in packaged_calibrations().items() if fingerprint == self.fingerprint]
        if not shipped:
            models = sorted({p.record.model for p in packaged_calibrations().values()})
            return (
                f"none ships for this checkpoint (fingerprint {self.fingerprint[:12]}...; the package ships them for "
                f"{', '.join(models) or 'no model'}, and a checkpoint converted, quantized or saved another way is "
                f"another checkpoint)"
            )
        here = [p for p in shipped if p.record.engine == self.engine]
        if not here:
            engines = sorted({p.record.engine for p in shipped})
            return (
                f"the package ships one for this checkpoint on the {' and '.join(engines)} engine, not on {self.engine}"
            )
        names = ", ".join(p.path.name for p in here)
        if self.dtype not in SERVES_DTYPES or not any(p.record.dtype in self.dtypes() for p in here):
            measured = ", ".join(sorted({p.record.dtype for p in here}))
            return f"the packaged {names} was measured in {measured}, which does not serve {self.dtype}"
        if not any(p.record.holds_under(self.store.kv_codec) for p in here):
            return (
                f"the packaged {names} was not shown to hold on this store's {self.store.kv_codec or 'raw'} chunks "
                f"(open a store with another kv_codec, or calibrate under this one)"
            )
        return f"the packaged {names} is refused (the warning above says why)"


def choose_ratio(
    request_ratio: float | str | None, config: BlendConfig, calibrations: Calibrations | None
) -> RatioChoice:
    """The ratio a blend request is planned with: the request's own, else the
    config's, else (``"auto"``) the calibrated one, with its per-request guard
    where it has one, else ``FALLBACK_RATIO`` (logged once)."""
    if request_ratio is not None and request_ratio != "auto":
        return RatioChoice(float(request_ratio), "request")
    if request_ratio is None and config.recompute_ratio != "auto":
        return RatioChoice(float(config.recompute_ratio), "config")
    if calibrations is not None:
        return calibrations.choice()
    return RatioChoice(FALLBACK_RATIO, "fallback")
