"""Calibration layer: the recompute ratio a model needs, measured on the user's own documents, stored, and used.

The ratio that keeps a model's answers depends on the model: blend at 0.15
keeps nearly every answer of the bundled reader and loses a third of
SmolLM2-135M's (docs/results/calibration.md). ``calibrate`` measures it:

1. Probe prompts from the user's documents (random subsets in random orders,
   with a question about one of them, through the model's chat template),
   or the user's own prompts; a fixed seed.
2. Policies: one ratio for every request, with the engine's own blend
   settings or another (``variants``: gradual check layers, query-aware
   selection, key deviation, sink tokens); and, under each of them, the
   per-request *guard*: at the check layer the walk knows how much of the
   score it ranks the reused tokens by (their deviation; for a selection by
   the query, the query's attention) the top ``base`` share of them holds;
   when that is below ``threshold``, the request gets the next ratio of the
   ladder whose top share holds it (up to 1.0, full prefill). A blended
   reply reports that share for every ratio (``Generation.ranking_share``),
   so which ratio the guard gives each probe is known from one reply,
   without running the guard.
3. Each prompt's full prefill, then the policies on the engine being
   calibrated, cheapest first (by the cost model of ``blend_integrations.cost``
   on the probes' own shapes: ``choice.Costs``), each on the hardest probes
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
with the blend settings it was measured under. A record of another model, or a
damaged one, is refused with a warning, and the fallback ratio is used. A
record measured in one floating-point dtype serves the same model
and engine in another (``SERVES_DTYPES``: a CPU without bfloat16 instructions
runs a bfloat16 checkpoint in float32) where none measured in that dtype
exists; the usage names the dtype it was measured in (``calibration_dtype``).

The package, one job per module:

- ``records``: the record, the guard and the ratio choice, and a record's name;
- ``packaged``: the calibrations this package ships;
- ``policy``: the calibration an engine uses at request time, and each request's ratio;
- ``probes``: the probe prompts;
- ``choice``: the policies measured, their cost, and the choice among them;
- ``measure``: ``calibrate``, which drives an engine through ``Calibratable``;
- ``report``: a record as a table and a plot.

None of them imports an engine: the engines import ``measure`` for
``Engine.calibrate``, and ``fusion`` imports ``policy``.
"""

from .choice import default_variants, policy_cost
from .measure import KL_TOP, Calibratable, calibrate, check_target, exclusive
from .packaged import (
    PACKAGED_DIR,
    PackagedCalibration,
    held_out_bounds,
    held_out_shortfalls,
    packaged_calibrations,
    packaged_name,
)
from .policy import RELOAD_S, SERVES_DTYPES, Calibrations, choose_ratio
from .probes import MIN_PROBE_TOKENS, QUESTIONS, probe_prompts
from .records import (
    LADDER,
    RECORD_VERSION,
    CalibrationError,
    CalibrationRecord,
    Guard,
    RankShares,
    RatioChoice,
    record_name,
    settings_label,
    wilson_lower,
)
from .report import curve_table, report, write_plot

__all__ = [
    "KL_TOP",
    "LADDER",
    "MIN_PROBE_TOKENS",
    "PACKAGED_DIR",
    "QUESTIONS",
    "RECORD_VERSION",
    "RELOAD_S",
    "SERVES_DTYPES",
    "Calibratable",
    "CalibrationError",
    "CalibrationRecord",
    "Calibrations",
    "Guard",
    "PackagedCalibration",
    "RankShares",
    "RatioChoice",
    "calibrate",
    "check_target",
    "choose_ratio",
    "curve_table",
    "default_variants",
    "exclusive",
    "held_out_bounds",
    "held_out_shortfalls",
    "packaged_calibrations",
    "packaged_name",
    "policy_cost",
    "probe_prompts",
    "record_name",
    "report",
    "settings_label",
    "wilson_lower",
    "write_plot",
]
