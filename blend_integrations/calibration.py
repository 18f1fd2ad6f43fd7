"""Calibration: the recompute ratio a model needs, measured on the user's own documents, stored, and used.

The ratio that keeps a model's answers depends on the model: blend at 0.15
keeps nearly every answer of the bundled reader and loses a third of
SmolLM2-135M's (docs/results/calibration.md). ``calibrate`` measures it:

1. Probe prompts from the user's documents (random subsets in random orders,
   with a question about one of them, through the model's chat template),
   or the user's own prompts; a fixed seed.
2. Policies: one ratio for every request, with the engine's own blend
   settings or another (``variants``: gradual check layers, query-aware
   selection, key deviation, sink tokens); and the per-request *guard*: at
   the check layer the walk knows how much of the reused tokens' deviation
   the top ``base`` share of them holds; when that is below ``threshold``,
   the request gets the next ratio of the ladder whose top share holds it
   (up to 1.0, full prefill). A blended reply reports that share for every
   ratio (``Generation.deviation_share``), so which ratio the guard gives
   each probe is known from one reply, without running the guard.
3. Each prompt's full prefill, then the policies on the engine being
   calibrated, cheapest first (by the computed share of the reused
   token-layers, ``config.computed_share``), each on the hardest probes
   first. A blended reply *agrees* when its first ``tokens`` greedy tokens
   are full prefill's. A policy stops at the disagreement that rules the
   target out, and policies costlier than one that met it are not run
   (``exhaustive=True`` runs everything, for the whole curve). The first
   token's KL divergence from full prefill's (over full prefill's top
   ``KL_TOP`` tokens and the rest as one bucket) and the time to first token
   are recorded too.
4. The cheapest policy whose agreement meets ``target`` with a one-sided
   Wilson lower bound at ``confidence``, and which is measured at least
   ``min_speedup`` times sooner than full prefill, wins.
   If none below 1.0 does, the record says so: blending cannot hold that
   target on this model, and ``"auto"`` recomputes everything.

The record (``CalibrationRecord``) goes into the chunk store (disk and
Redis, ``ChunkStore.put_record``) under the model's fingerprint and dtype,
so every engine opened on that store, in any process, uses it: the ratio
with the blend settings it was measured under. A record of another model or
dtype, or a damaged one, is refused with a warning, and the fallback ratio
is used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import json
import logging
import math
import os
import random
import re
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import TYPE_CHECKING, Any

from .config import FALLBACK_RATIO, SETTINGS, BlendConfig, check_kv_codec, check_ratio, computed_share
from .store import ChunkStore
from .store.format import dtype_name

if TYPE_CHECKING:
    from .engines.base import Engine, Generation
    from .prompt import PromptInput

logger = logging.getLogger(__name__)

RECORD_VERSION = 2
# Ratios measured; 1.0 is full prefill's equal and is not run.
LADDER: tuple[float, ...] = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.7, 0.9)
KL_TOP = 20  # the first token's KL is over full prefill's top KL_TOP tokens and the rest as one bucket
# What a query-aware selection's reuse pass adds to a policy's cost (it computes the prompt's new tokens once more).
QUERY_PASS_COST = 0.05
# How often an engine looks for a new calibration record in its store (another process may write one).
RELOAD_S = 1.0


class CalibrationError(ValueError):
    """Calibration cannot run as asked; the message says why."""


def record_name(fingerprint: str, dtype: Any, kv_codec: str | None = None) -> str:
    """The store record of a model's calibration: one per checkpoint, KV
    dtype and the store's KV codec (a lossy codec may need another ratio)."""
    name = dtype if isinstance(dtype, str) else dtype_name(dtype)
    return f"calibration.{fingerprint[:64]}.{name}" + (f".{kv_codec}" if kv_codec is not None else "")


@dataclass(frozen=True)
class Guard:
    """Recompute more for a request whose deviation is spread out: when the
    top ``base`` share of its reused tokens holds less than ``threshold`` of
    their deviation at the check layer, use the first ratio of ``ladder``
    above ``base`` whose top share holds ``threshold`` (1.0 if none does)."""

    base: float
    threshold: float
    ladder: tuple[float, ...] = LADDER

    def ratio(self, captured: Callable[[float], float]) -> float:
        """The request's ratio, given ``captured(r)``: the share of its
        deviation the top ``r`` of its reused tokens hold."""
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


@dataclass(frozen=True)
class CalibrationRecord:
    """What calibration measured and chose for one model and dtype.

    ratio: the cheapest single ratio meeting the target (1.0 if none below
    does), with ``settings``, the blend settings (``config.SETTINGS``) it was
    measured under; guard: the guard policy, when cheaper than ``ratio`` at
    the target, under ``guard_settings`` (engines that run the walk
    in-process use it; the vLLM engine, whose worker cannot report a
    per-request ratio for every request yet, uses ``ratio``). curve: every
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

    def holds_under(self, kv_codec: str | None) -> bool:
        """Whether ``"auto"`` may use this record in a store of ``kv_codec``."""
        return kv_codec == self.kv_codec or kv_codec in self.codecs_checked

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
        Records from before KV codecs (no ``kv_codec``) were measured raw."""
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
                    if f.name != "guard" and (f.name in data or f.name not in ("kv_codec", "codecs_checked"))
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

    def choice(self, *, guard: bool = True, source: str = "calibrated") -> RatioChoice:
        if guard and self.guard is not None and self.meets_target:
            return RatioChoice(self.guard.base, source, self.guard, self.guard_settings)
        return RatioChoice(self.ratio, source, settings=self.settings)


PACKAGED_KIND = "blend-packaged-calibration"
PACKAGED_VERSION = 1
# The calibrations shipped with the package: one file per shipped model and engine.
PACKAGED_DIR = Path(__file__).parent / "data" / "calibrations"


def packaged_name(label: str, engine: str) -> str:
    return f"{label}-{engine}.json"


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

    def meaning(self) -> str:
        """What the packaged ratio means for this model, in one plain sentence of measured numbers."""
        r, held = self.record, self.held_out
        cal, fb = held["calibrated"], held["fallback"]
        n, tokens = held["questions"], held["tokens"]
        label = settings_label(r.settings)
        settings = "" if label == "default" else f" ({label})"
        if r.ratio >= 1.0 and r.guard is None:
            head = (
                f"{r.model} needs full recompute to keep full prefill's first {tokens} tokens on {r.target:.0%} "
                f"of prompts (calibrated on {r.n} prompts)"
            )
        else:
            head = (
                f"{r.model} keeps full prefill's first {tokens} tokens on {cal['agreement']:.0%} of {n} held-out "
                f"questions at ratio {cal['ratio']:g}{settings}, {cal['ttft_speedup']:.2f}x sooner"
            )
        if r.guard is None and r.ratio == fb["ratio"] and not settings:
            return f"{head} ({r.engine} engine, {self.cpu})."
        changed = 1.0 - fb["agreement"]
        plain = " with the default settings" if settings else ""
        return (
            f"{head}; at ratio {fb['ratio']:g}{plain} it is {fb['ttft_speedup']:.2f}x sooner but changes {changed:.0%} "
            f"of {n} held-out answers' first {tokens} tokens ({r.engine} engine, {self.cpu})."
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
        r = packaged.record
        found[(r.fingerprint, r.dtype, r.engine)] = packaged
    return found


class Calibrations:
    """One model's calibration as its engine sees it: the store's record (the
    user's own calibration), read again at most every ``RELOAD_S`` seconds
    (another process may have calibrated), and checked; else the calibration
    this package ships for the model on this ``engine``, if any. Says once
    per problem why a record is not used."""

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

    @property
    def name(self) -> str:
        """The record's name in the store: its codec's (``record_name``)."""
        return record_name(self.fingerprint, self.dtype, self.store.kv_codec)

    def use_store(self, store: ChunkStore) -> None:
        with self._lock:
            self.store, self._record, self._read_at = store, None, -math.inf

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
            return self._record, self._source

    def packaged(self) -> PackagedCalibration | None:
        """The calibration this package ships for this model and engine, if any."""
        packaged = packaged_calibrations().get((self.fingerprint, self.dtype, self.engine))
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

    def choice(self, *, guard: bool = True) -> RatioChoice:
        """The ratio ``"auto"`` gives a request now: the user's calibration, else the packaged one, else the fallback."""
        record, source = self.current()
        if record is None:
            return self.fallback()
        return record.choice(guard=guard, source=source)

    def set(self, record: CalibrationRecord) -> None:
        """Use ``record`` now (just written by ``calibrate``)."""
        with self._lock:
            self._record, self._source, self._read_at = record, "calibrated", time.monotonic()

    def _read(self) -> tuple[CalibrationRecord | None, str]:
        own = self._read_store()
        if own is not None:
            return own, "calibrated"
        packaged = self.packaged()
        if packaged is not None:
            return packaged.record, "packaged"
        return None, "fallback"

    def _read_store(self) -> CalibrationRecord | None:
        try:
            raw = self.store.get_record(self.name)
        except Exception as e:  # a store problem is a miss, never a failed request
            self._say(f"reading the calibration record failed ({type(e).__name__}: {e})")
            return None
        if raw is None:
            return None
        try:
            record = CalibrationRecord.from_bytes(
                raw, fingerprint=self.fingerprint, dtype=self.dtype, num_layers=self.num_layers
            )
        except CalibrationError as e:
            self._say(f"the store's calibration record is refused: {e}")
            return None
        if record.kv_codec != self.store.kv_codec:
            self._say(
                f"the store's calibration record {self.name} is refused: it was measured on "
                f"{record.kv_codec or 'raw'} chunks, not {self.store.kv_codec or 'raw'} ones"
            )
            return None
        return record

    def _say(self, why: str) -> None:
        if why not in self._said:
            self._said.add(why)
            logger.warning("model %s: %s", self.label, why)

    def fallback(self) -> RatioChoice:
        self._say(
            f"no calibration for this model in the store {self.store.path}, and none ships with this package "
            f"for it on the {self.engine} engine: blending at the fallback ratio "
            f"{FALLBACK_RATIO}, which may cost answers on small models. Calibrate once: "
            f"engine.calibrate(documents) or `python -m blend_integrations.calibrate MODEL --store "
            f"{self.store.path} --documents DIR`"
        )
        return RatioChoice(FALLBACK_RATIO, "fallback")


def choose_ratio(
    request_ratio: float | str | None, config: BlendConfig, calibrations: Calibrations | None, *, guard: bool = True
) -> RatioChoice:
    """The ratio a blend request is planned with: the request's own, else the
    config's, else (``"auto"``) the calibrated one, else ``FALLBACK_RATIO``
    (logged once). ``guard``: the engine can run the per-request guard."""
    if request_ratio is not None and request_ratio != "auto":
        return RatioChoice(float(request_ratio), "request")
    if request_ratio is None and config.recompute_ratio != "auto":
        return RatioChoice(float(config.recompute_ratio), "config")
    if calibrations is not None:
        return calibrations.choice(guard=guard)
    return RatioChoice(FALLBACK_RATIO, "fallback")


# -- measuring ---------------------------------------------------------------

QUESTIONS = (
    "What do the documents say about {topic}?",
    "According to the documents, what is true of {topic}?",
    "Which document mentions {topic}, and what does it say?",
    "Answer briefly: what is said about {topic}?",
)
MIN_PROBE_TOKENS = 8  # a document shorter than this (alone) tells nothing about blending


def wilson_lower(successes: int, n: int, confidence: float) -> float:
    """One-sided Wilson score lower bound of a proportion (0 for no trials)."""
    if n == 0:
        return 0.0
    z = NormalDist().inv_cdf(confidence)
    p = successes / n
    centre = p + z * z / (2 * n)
    margin = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, (centre - margin) / (1 + z * z / n))


def _topic(document: str, rng: random.Random) -> str:
    """A few words from one sentence of ``document``: what a probe asks about."""
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", document) if len(s.split()) >= 3]
    words = rng.choice(sentences).split() if sentences else document.split()
    start = rng.randrange(max(1, len(words) - 3))
    return " ".join(words[start : start + 4]).strip(" ,.;:!?\"'()")


def probe_prompts(engine: Engine, documents: Sequence[str], count: int, seed: int, per_prompt: int = 4) -> list:
    """``count`` probe prompts from ``documents``: random subsets of up to
    ``per_prompt`` in random orders, each with a question about one of them,
    in the RAG layout of the integrations (``chat.rag_prompt``)."""
    from .chat import rag_prompt

    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        docs = rng.sample(list(documents), min(per_prompt, len(documents)))
        question = rng.choice(QUESTIONS).format(topic=_topic(rng.choice(docs), rng))
        prompts.append(rag_prompt(docs, question, engine.tokenizer, engine.config.separator))
    return prompts


def _agree(full: Generation, blend: Generation, tokens: int) -> bool:
    return full.token_ids[:tokens] == blend.token_ids[:tokens]


def _first_token_kl(full: Generation, blend: Generation) -> float | None:
    """KL(full || blend) of the first token over full's top KL_TOP tokens and
    the rest as one bucket (a lower bound on the whole-vocabulary KL)."""
    if not full.logprobs or not blend.logprobs:
        return None
    p, q = full.logprobs[0], blend.logprobs[0]
    floor = min(q.values()) if q else -30.0  # a token outside blend's top-k has at most its smallest probability
    kl, p_rest, q_rest = 0.0, 1.0, 1.0
    for token, lp in p.items():
        lq = q.get(token, floor)
        kl += math.exp(lp) * (lp - lq)
        p_rest -= math.exp(lp)
        q_rest -= math.exp(lq)
    p_rest, q_rest = max(p_rest, 1e-12), max(q_rest, 1e-12)
    return max(0.0, kl + p_rest * math.log(p_rest / q_rest))


@dataclass(frozen=True)
class _Policy:
    """A candidate: one ratio for every request (``kind="ratio"``), or the
    guard from base ``ratio`` at ``threshold``; ``rungs``: the ratio each
    probe runs at under it (1.0: full prefill, nothing to run)."""

    kind: str
    settings: int  # index into the settings tried
    ratio: float
    threshold: float | None
    rungs: tuple[float, ...]
    cost: float


class _Replies:
    """Each probe's full prefill, and its blended replies under each setting
    and ratio, each run once, when a policy first needs it."""

    def __init__(self, probes: list, fulls: list, blend: Callable, settings: list[dict]) -> None:
        self.probes, self.fulls, self.blend, self.settings = probes, fulls, blend, settings
        self.runs: dict[tuple[int, float, int], Generation] = {}

    def has(self, settings: int, ratio: float, j: int) -> bool:
        return ratio >= 1.0 or (settings, ratio, j) in self.runs

    def get(self, settings: int, ratio: float, j: int) -> Generation | None:
        return None if ratio >= 1.0 else self.blended(settings, ratio, j)  # None: full prefill itself

    def blended(self, settings: int, ratio: float, j: int) -> Generation:
        key = (settings, ratio, j)
        if key not in self.runs:
            self.runs[key] = self.blend(self.probes[j], ratio, self.settings[settings])
        return self.runs[key]

    def reorder(self, order: list[int]) -> None:
        """Index the probes in ``order`` from now on."""
        at = {j: i for i, j in enumerate(order)}
        self.probes = [self.probes[j] for j in order]
        self.fulls = [self.fulls[j] for j in order]
        self.runs = {(s, r, at[j]): g for (s, r, j), g in self.runs.items()}


def default_variants(config: BlendConfig, num_layers: int | None) -> list[dict]:
    """The blend settings calibration tries besides the engine's own: gradual
    filtering over two check layers, the other selection, the other
    deviation, and sink tokens (each one change from ``config``)."""
    first = config.check_layers[0]
    variants: list[dict] = []
    if len(config.check_layers) == 1 and (num_layers is None or first + 1 < num_layers):
        variants.append({"check_layers": [first, first + 1]})
    variants.append({"selection": "query" if config.selection == "deviation" else "deviation"})
    variants.append({"deviation": "k" if config.deviation == "v" else "v"})
    if config.sink_tokens == 0:
        variants.append({"sink_tokens": 2})
    return variants


def _label(settings: dict, base: dict) -> str:
    changed = {k: v for k, v in settings.items() if base.get(k) != v}
    return ", ".join(f"{k}={v}" for k, v in changed.items()) or "default"


def policy_cost(settings: dict, ratio: float, num_layers: int) -> float:
    """What a policy computes: the share of the reused token-layers
    (``config.computed_share``), plus a query-aware selection's reuse pass."""
    share = computed_share(tuple(settings["check_layers"]), ratio, num_layers)
    return share + (QUERY_PASS_COST if settings["selection"] != "deviation" else 0.0)


def _prompts_needed(target: float, confidence: float) -> int | None:
    """The fewest prompts that, all agreeing, show ``target`` (None: no number does, as for 1.0)."""
    if target >= 1.0:
        return None
    z = NormalDist().inv_cdf(confidence)
    n = max(1, math.ceil(target * z * z / (1 - target)))  # all agreeing, the Wilson bound is n / (n + z^2)
    while wilson_lower(n, n, confidence) < target:  # float rounding at the boundary
        n += 1
    return n


def _max_misses(n: int, target: float, confidence: float) -> int:
    """The most disagreements out of ``n`` that still meet ``target`` (-1: none does)."""
    return max((f for f in range(n + 1) if wilson_lower(n - f, n, confidence) >= target), default=-1)


@contextlib.contextmanager
def exclusive(store: ChunkStore, name: str) -> Iterator[None]:
    """One calibration of a model per store directory at a time."""
    path = Path(store.path) / f".{name}.lock"
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CalibrationError(
                f"another process is calibrating this model on the store {store.path} (lock {path}); "
                "wait for it: its record is used by every engine on the store"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def check_target(target: Any, name: str = "target") -> float:
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0.0 < target <= 1.0:
        raise CalibrationError(f"{name} must be a number in (0, 1], got {target!r:.40}")
    return float(target)


def calibrate(
    engine: Engine,
    documents: Sequence[str] | None = None,
    *,
    prompts: Sequence[PromptInput] | None = None,
    target: float = 0.95,
    confidence: float = 0.8,
    tokens: int = 4,
    num_prompts: int = 48,
    ratios: Sequence[float] = LADDER,
    variants: Sequence[dict] | None = None,
    seed: int = 0,
    min_speedup: float = 1.1,
    progress: bool | None = None,
    plot: str | os.PathLike | None = None,
    save: bool = True,
    exhaustive: bool = False,
) -> CalibrationRecord:
    """Measure the recompute policy this engine's model needs to agree with
    full prefill on ``target`` of the prompts, store it, and return the record.
    ``variants``: blend settings tried besides the engine's own, each a dict
    of ``config.SETTINGS`` changes (None: ``default_variants``; ``[]``: only
    the engine's own). See the module docstring for the method; ``prompts``
    replaces the probes built from ``documents``. ``min_speedup``: a policy
    measured less than this many times sooner than full prefill is not worth
    its risk: when none meeting the target is faster, the record chooses full
    prefill. Policies are measured cheapest first and stop early (see
    ``_measure``); ``exhaustive`` measures every one on every probe, for the
    whole curve (slower; the same choice). Prints a table; ``plot``: also
    write a PNG of agreement and TTFT speedup against the ratio."""
    from tqdm.auto import tqdm

    from . import __version__

    target = check_target(target)
    confidence = check_target(confidence, "confidence")
    if isinstance(min_speedup, bool) or not isinstance(min_speedup, (int, float)) or not min_speedup > 0:
        raise CalibrationError(f"min_speedup must be a positive number, got {min_speedup!r:.40}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise CalibrationError(f"tokens must be a positive integer, got {tokens!r:.40}")
    if not isinstance(exhaustive, bool):
        raise CalibrationError(f"exhaustive must be True or False, got {exhaustive!r:.40}")
    if isinstance(num_prompts, bool) or not isinstance(num_prompts, int) or num_prompts < 2:
        raise CalibrationError(f"num_prompts must be an integer >= 2, got {num_prompts!r:.40}")
    ladder = sorted({check_ratio(r) for r in ratios} - {1.0})
    if not ladder:
        raise CalibrationError("ratios must hold at least one ratio below 1.0")
    config, num_layers = engine.config, engine.num_layers
    if num_layers is None:
        raise CalibrationError(
            f"the {engine.backend} engine does not know its model's layers here: calibrate where it runs"
        )
    base = config.settings()
    tried = [base]
    for v in default_variants(config, num_layers) if variants is None else variants:
        try:
            settings = config.with_settings(v, num_layers=num_layers).settings()
        except (TypeError, ValueError) as e:
            raise CalibrationError(f"variant {v!r:.80}: {e}") from None
        if settings not in tried:
            tried.append(settings)
    if prompts is not None:
        probes = [engine.tokenize(p) for p in prompts]
        source = f"{len(probes)} given prompts"
    else:
        if documents is None:
            documents = engine.stored_documents()
            if not documents:
                raise CalibrationError(
                    "calibration needs documents (or prompts) to probe with, and none were given: pass the "
                    "documents your RAG application retrieves, or warm the store with them first (calibration "
                    f"then reads this model's chunks from {engine.store.path})"
                )
        if isinstance(documents, str):
            raise CalibrationError("documents must be a list of texts, not one string")
        docs = [d for d in documents if isinstance(d, str) and d.strip()]
        usable = [d for d in docs if len(engine.tokenizer.encode(d, add_special_tokens=False)) >= MIN_PROBE_TOKENS]
        if len(usable) < 2:
            raise CalibrationError(
                f"calibration needs at least 2 documents of {MIN_PROBE_TOKENS} tokens or more to blend; "
                f"got {len(docs)} text(s), {len(usable)} long enough"
            )
        probes = probe_prompts(engine, usable, num_prompts, seed)
        source = f"{len(probes)} probes from {len(usable)} documents"
    probes = [p for p in probes if p.chunk_spans]
    if len(probes) < 2:
        raise CalibrationError("calibration needs at least 2 prompts with retrieved documents (chunks) in them")
    name = record_name(engine.fingerprint, engine.dtype_name, engine.kv_codec)
    show = progress if progress is not None else True
    started = time.perf_counter()
    n = len(probes)

    def blend(tp, ratio: float, settings: dict) -> Generation:
        return engine.generate(tp, mode="blend", recompute_ratio=ratio, **settings, max_tokens=tokens, logprobs=KL_TOP)

    with engine.calibration_lock(name):
        chunks = {tuple(p.token_ids[a:b]) for p in probes for a, b in p.chunk_spans}
        engine.warm([list(c) for c in chunks], progress=show)
        first = f"calibrating ({source}): full prefill and ratio {ladder[0]}"
        with tqdm(total=2 * n, desc=first, unit="run", disable=not show) as bar:
            fulls = []
            for tp in probes:
                fulls.append(engine.generate(tp, mode="full", max_tokens=tokens, logprobs=KL_TOP))
                bar.update()
            replies = _Replies(probes, fulls, blend, tried)
            for j in range(n):
                replies.blended(0, ladder[0], j)
                bar.update()
        curve = _measure(
            replies,
            ladder,
            tried,
            num_layers,
            tokens,
            target=target,
            confidence=confidence,
            min_speedup=min_speedup,
            exhaustive=exhaustive,
            progress=show,
        )
        record = _choose(
            curve,
            base=base,
            ladder=ladder,
            min_speedup=min_speedup,
            target=target,
            confidence=confidence,
            tokens=tokens,
            n=n,
            engine=engine,
            version=__version__,
            seconds=time.perf_counter() - started,
        )
        if save:
            engine.keep_calibration(record)
    print(report(record))
    if plot is not None:
        write_plot(record, plot)
    return record


def _row(
    fulls: list[Generation],
    per_probe: list[tuple[float, Generation | None]],
    tokens: int,
    confidence: float,
    n: int,
    **fields,
) -> dict:
    """One policy's measures over the probes it ran on (the first ``len(per_probe)``);
    a None generation is full prefill (the guard's 1.0)."""
    measured = fulls[: len(per_probe)]
    agree = sum(g is None or _agree(f, g, tokens) for f, (_, g) in zip(measured, per_probe))
    kls = [k for f, (_, g) in zip(measured, per_probe) if g is not None and (k := _first_token_kl(f, g)) is not None]
    ttft = [g.ttft_s if g is not None else f.ttft_s for f, (_, g) in zip(measured, per_probe)]
    return {
        **fields,
        "mean_ratio": round(statistics.fmean(r for r, _ in per_probe), 4),
        "n": len(per_probe),
        "agreement": round(agree / len(per_probe), 4),
        # a policy stopped early is short of n probes: it cannot meet the target
        "lower_bound": round(wilson_lower(agree, n, confidence), 4) if len(per_probe) == n else 0.0,
        "kl": round(statistics.fmean(kls), 4) if kls else None,
        "ttft_speedup": round(statistics.fmean(f.ttft_s for f in measured) / statistics.fmean(ttft), 3),
    }


def _candidates(replies: _Replies, ladder: list[float], tried: list[dict], num_layers: int, n: int) -> list[_Policy]:
    """Every policy, cheapest first: each setting at each ratio, and (where
    the engine reports ``Generation.deviation_share``) the guard from each
    base ratio at each threshold the probes' shares at that base suggest.
    A guard's rungs come from the probes' cheapest runs with the engine's own
    settings: the share does not depend on the ratio a walk ran at."""
    policies = [
        _Policy("ratio", i, r, None, (r,) * n, policy_cost(settings, r, num_layers))
        for i, settings in enumerate(tried)
        for r in ladder
    ]
    shares = [share for j in range(n) if (share := replies.blended(0, ladder[0], j).deviation_share) is not None]
    if len(shares) == n:
        for r0 in ladder:
            for threshold in sorted({round(share(r0), 3) for share in shares})[1:]:
                guard = Guard(r0, threshold, tuple(ladder))
                rungs = tuple(guard.ratio(share) for share in shares)
                cost = statistics.fmean(policy_cost(tried[0], r, num_layers) for r in rungs)
                policies.append(_Policy("guard", 0, r0, threshold, rungs, cost))
    return sorted(policies, key=lambda p: (p.cost, p.kind != "ratio", p.settings, p.ratio, p.threshold or 0.0))


def _measure(
    replies: _Replies,
    ladder: list[float],
    tried: list[dict],
    num_layers: int,
    tokens: int,
    *,
    target: float,
    confidence: float,
    min_speedup: float,
    exhaustive: bool,
    progress: bool = False,
) -> list[dict]:
    """Measure the policies cheapest first, each on the probes hardest first,
    and return their rows. Every probe's reply at the cheapest ratio comes
    first: it orders the probes (disagreeing, then by first-token KL) and gives
    the guard its shares. A policy stops at the disagreement that rules the
    target out, and is not run at all once a cheaper one met the target (a
    single ratio only for a cheaper single ratio: engines without the guard
    need one) or one as costly was measured too slow to be worth it. The
    choice is the one measuring everything would make; ``exhaustive`` does,
    for the whole curve."""
    n, base = len(replies.fulls), tried[0]
    first = [replies.blended(0, ladder[0], j) for j in range(n)]
    hardness = [(_agree(f, g, tokens), -(_first_token_kl(f, g) or 0.0)) for f, g in zip(replies.fulls, first)]
    replies.reorder(sorted(range(n), key=lambda j: hardness[j]))
    misses_allowed = _max_misses(n, target, confidence)
    best_single = best_any = too_slow = math.inf
    rows = []
    from tqdm.auto import tqdm

    bar = tqdm(
        _candidates(replies, ladder, tried, num_layers, n),
        desc="calibrating: policies, cheapest first",
        unit="policy",
        disable=not progress,
    )
    for policy in bar:
        bar.set_postfix(runs=len(replies.runs), refresh=False)
        settings = tried[policy.settings]
        cheaper_met = best_single if policy.kind == "ratio" else best_any
        measured = all(replies.has(policy.settings, r, j) for j, r in enumerate(policy.rungs))
        if not (exhaustive or measured) and (misses_allowed < 0 or policy.cost >= min(cheaper_met, too_slow)):
            continue  # its row costs nothing to give when its replies are all there
        per_probe, misses = [], 0
        for j, r in enumerate(policy.rungs):
            # past the miss that rules the target out, only replies already measured are counted
            if misses > misses_allowed and not exhaustive and not replies.has(policy.settings, r, j):
                break
            g = replies.get(policy.settings, r, j)
            per_probe.append((r, g))
            misses += g is not None and not _agree(replies.fulls[j], g, tokens)
        fields = {"threshold": policy.threshold} if policy.kind == "guard" else {}
        row = _row(
            replies.fulls,
            per_probe,
            tokens,
            confidence,
            n,
            policy=policy.kind,
            variant=_label(settings, base),
            settings=settings,
            ratio=policy.ratio,
            **fields,
            cost=round(policy.cost, 4),
        )
        rows.append(row)
        if row["n"] == n and row["ttft_speedup"] < min_speedup:
            too_slow = min(too_slow, policy.cost)
        if _meets(row, target, n, min_speedup):
            best_any = min(best_any, policy.cost)
            if policy.kind == "ratio":
                best_single = min(best_single, policy.cost)
    return rows


def _meets(row: dict, target: float, n: int, min_speedup: float) -> bool:
    return row["n"] == n and row["lower_bound"] >= target and row["ttft_speedup"] >= min_speedup


def _choose(
    curve: list[dict], *, base, ladder, target, confidence, tokens, n, min_speedup, engine, version, seconds
) -> CalibrationRecord:
    """The cheapest policy meeting the target: the single ratio (with its
    settings) for every engine, and the guard when it is cheaper still; each
    only if measured at least ``min_speedup`` times sooner than full prefill,
    else full prefill."""
    meeting = [c for c in curve if c["n"] == n and c["lower_bound"] >= target]
    cost = lambda c: (c["cost"], c["ratio"])  # noqa: E731
    worth = [c for c in meeting if c["ttft_speedup"] >= min_speedup]  # confirmed by measured TTFT
    uniform = min((c for c in worth if c["policy"] == "ratio"), key=cost, default=None)
    guarded = min((c for c in worth if c["policy"] == "guard"), key=cost, default=None)
    if guarded is not None and uniform is not None and cost(guarded) >= cost(uniform):
        guarded = None  # the guard only when it is cheaper than one ratio for every request
    if _max_misses(n, target, confidence) < 0:
        needed = _prompts_needed(target, confidence)
        why = (
            f"{n} prompts cannot show agreement {target} at {confidence:.0%} confidence even if every one agrees "
            + (f"(that takes {needed} or more)" if needed else "(no number of prompts can: lower the target)")
            + ": full prefill"
        )
    elif not meeting:
        why = f"no policy below ratio 1.0 meets the target {target}: blending cannot hold it here; full prefill"
    elif uniform is None and guarded is None:
        best = min(meeting, key=cost)
        why = (
            f"the cheapest policy meeting the target (computed share {best['cost']}) was measured only "
            f"{best['ttft_speedup']:.2f}x sooner than full prefill, under min_speedup {min_speedup}: full prefill"
        )
    else:
        chosen = guarded if guarded is not None else uniform
        assert chosen is not None  # one of the two, by the branch above
        why = (
            f"the cheapest policy meeting the target: computed share {chosen['cost']}, mean ratio "
            f"{chosen['mean_ratio']}, {chosen['ttft_speedup']:.2f}x sooner than full prefill"
        )
    return CalibrationRecord(
        model=engine.model_name,
        fingerprint=engine.fingerprint,
        dtype=engine.dtype_name,
        settings=uniform["settings"] if uniform is not None else base,
        ratio=uniform["ratio"] if uniform is not None else 1.0,
        guard=None if guarded is None else Guard(guarded["ratio"], guarded["threshold"], tuple(ladder)),
        guard_settings=None if guarded is None else guarded["settings"],
        meets_target=bool(meeting),
        target=target,
        confidence=confidence,
        tokens=tokens,
        n=n,
        curve=curve,
        date=time.strftime("%Y-%m-%d"),
        package_version=version,
        engine=engine.backend,
        seconds=round(seconds, 1),
        why=why,
        min_speedup=min_speedup,
        kv_codec=engine.kv_codec,
    )


def curve_table(curve: list[dict], n: int) -> list[str]:
    """The single-ratio policies measured, as a Markdown table."""
    lines = [
        "| settings | ratio | computed share | agreement | lower bound | first-token KL | TTFT full / blend |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in curve:
        if c["policy"] == "ratio":
            kl = "-" if c["kl"] is None else f"{c['kl']:.4f}"
            agreement = f"{c['agreement']:.3f}" + ("" if c["n"] == n else f" (stopped after {c['n']})")
            lines.append(
                f"| {c['variant']} | {c['ratio']:.2f} | {c['cost']:.3f} | {agreement} | {c['lower_bound']:.3f} | "
                f"{kl} | {c['ttft_speedup']:.2f}x |"
            )
    return lines


def settings_label(settings: dict, base: dict | None = None) -> str:
    """``settings`` in words: those that differ from ``base`` (None: from ``BlendConfig()``'s)."""
    return _label(settings, BlendConfig().settings() if base is None else base)


def report(record: CalibrationRecord) -> str:
    """The calibration as a table and the choice, in words."""
    lines = [
        f"Calibration of {record.model} ({record.dtype}, {record.engine} engine): {record.n} prompts, "
        f"agreement = the first {record.tokens} greedy tokens equal full prefill's; target {record.target} "
        f"(lower bound at {record.confidence:.0%} confidence); {record.seconds:.0f} s",
        "",
        *curve_table(record.curve, record.n),
    ]
    if any(c["n"] < record.n for c in record.curve):
        lines.append(
            "\nPolicies ran cheapest first, each on the hardest probes first: one stopped early could no "
            "longer meet the target, and those costlier than a policy that met it were not run "
            "(calibrate(..., exhaustive=True) runs them all)."
        )
    guards = [c for c in record.curve if c["policy"] == "guard" and c["lower_bound"] >= record.target]
    if guards:
        best = min(guards, key=lambda c: c["cost"])
        lines.append(
            f"\nguard: base {best['ratio']:.2f}, threshold {best['threshold']:.3f} -> mean ratio "
            f"{best['mean_ratio']:.3f}, agreement {best['agreement']:.3f}, {best['ttft_speedup']:.2f}x"
        )
    if not record.meets_target:
        lines.append(f'\nChosen: full prefill ("auto" runs it): {record.why}. Lower the target, or pass a ratio.')
    elif record.ratio >= 1.0 and record.guard is None:
        lines.append(f'\nChosen: full prefill ("auto" runs it): {record.why}.')
    elif record.guard is not None:
        lines.append(
            f"\nChosen: the guard (base ratio {record.guard.base}, threshold {record.guard.threshold}); "
            f"engines that cannot run the guard use the single ratio {record.ratio}"
            + (" (no single ratio below 1.0 meets the target)." if record.ratio >= 1.0 else ".")
        )
    else:
        lines.append(
            f"\nChosen: ratio {record.ratio} ({settings_label(record.settings)} settings), the cheapest meeting "
            "the target."
        )
    return "\n".join(lines)


def write_plot(record: CalibrationRecord, path: str | os.PathLike) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    speed = ax.twinx()
    variants = list(dict.fromkeys(c["variant"] for c in record.curve if c["policy"] == "ratio"))
    for i, v in enumerate(variants):
        rows = [c for c in record.curve if c["policy"] == "ratio" and c["variant"] == v]
        xs = [c["ratio"] for c in rows]
        color = f"C{i}"
        whole = [c for c in rows if c["n"] == record.n]
        stopped = [c for c in rows if c["n"] < record.n]
        ax.plot(
            [c["ratio"] for c in whole],
            [c["agreement"] for c in whole],
            "o-" if i == 0 else "x",
            color=color,
            label=f"agreement ({v})",
        )
        if stopped:  # measured on the hardest probes only, until they ruled the target out
            ax.plot(
                [c["ratio"] for c in stopped],
                [c["agreement"] for c in stopped],
                "v" if i == 0 else "1",
                color=color,
                label=f"stopped early ({v})",
            )
        if i == 0:
            ax.plot(
                [c["ratio"] for c in whole], [c["lower_bound"] for c in whole], ":", color=color, label="lower bound"
            )
            speed.plot(xs, [c["ttft_speedup"] for c in rows], "s--", color="grey", label="TTFT full / blend")
    ax.axhline(record.target, color="red", lw=0.8, label=f"target {record.target}")
    ax.set_xlabel("recompute ratio")
    ax.set_ylabel(f"agrees with full prefill (first {record.tokens} tokens)")
    speed.set_ylabel("TTFT speedup")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{Path(record.model).name}: {record.n} prompts, chosen {record.ratio}", fontsize=9)
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
