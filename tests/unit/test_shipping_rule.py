"""The rule a packaged calibration ships by (``calibration.packaged``): a blending policy only where
its held-out agreement with full prefill meets the target at its lower bound on every kind of
question. The shipped files keep it; a file that breaks it runs as full prefill, saying why, and
``benchmarks calibration --rejudge`` rewrites it so."""

from __future__ import annotations

import json
import logging

from benchmarks.calibration import rejudge
from blend_integrations import calibration as cal
from blend_integrations.calibration import (
    PACKAGED_DIR,
    PackagedCalibration,
    held_out_bounds,
    held_out_shortfalls,
    packaged_calibrations,
)

QWEN15_TRANSFORMERS = "qwen2.5-coder-1.5b-transformers.json"


def test_every_shipped_calibration_keeps_the_rule():
    paths = sorted(PACKAGED_DIR.glob("*.json"))
    assert len(paths) == 10
    for path in paths:
        packaged = PackagedCalibration.from_bytes(path.read_bytes(), path)
        assert packaged.shortfalls() == {}, path.name
        assert packaged.under_shipping_rule() is packaged, path.name


def test_a_bound_is_computed_where_none_was_measured_and_the_worst_kind_decides():
    # 56 of 60 agree (93%): at least 0.901 at 80% confidence, under 0.95; a row without a bound never passes
    short = held_out_shortfalls({"generated": {"agreement": 56 / 60, "n": 60}}, 0.95, 0.8)
    assert round(short["generated"]["agreement_lower"], 3) == 0.901
    assert held_out_shortfalls({"generated": {"agreement": 1.0, "n": 60}}, 0.95, 0.8) == {}
    # a measured bound stands as it is
    rows = {
        "generated": {"agreement": 1.0, "agreement_lower": 0.9883, "n": 60},
        "squad-dev": {"agreement": 0.9167, "agreement_lower": 0.8816, "n": 60},
    }
    assert held_out_bounds(rows, 0.8) == rows
    assert list(held_out_shortfalls(rows, 0.95, 0.8)) == ["squad-dev"]
    assert list(held_out_shortfalls(rows, 0.85, 0.8)) == []


def blending(agreement: float) -> dict:
    """The 1.5B model's transformers file as it shipped before the rule (query selection at 0.15, chosen
    on generated probes alone), with ``agreement`` on its 60 held-out generated questions."""
    data = json.loads((PACKAGED_DIR / QWEN15_TRANSFORMERS).read_text())
    data["record"].update(ratio=0.15, meets_target=True, why="the cheapest policy meeting the target")
    held = data["held_out"]
    held.pop("tasks", None)  # a file from before SQuAD was held out: the generated kind alone, no bound
    held["questions"] = 60
    held["calibrated"] = {k: v for k, v in held["calibrated"].items() if k != "agreement_lower"}
    held["calibrated"]["agreement"] = agreement
    return data


def test_a_policy_its_held_out_numbers_do_not_back_runs_full_prefill(tmp_path, monkeypatch, caplog):
    packaged = PackagedCalibration.from_bytes(json.dumps(blending(56 / 60)).encode(), tmp_path / "x.json")
    assert packaged.record.ratio == 0.15 and list(packaged.shortfalls()) == ["generated"]
    judged = packaged.under_shipping_rule()
    assert (judged.record.ratio, judged.record.guard, judged.record.meets_target) == (1.0, None, False)
    assert (
        "falls short of the target 0.95 at its lower bound (generated: 0.933 agree (at least 0.901) of 60)"
        in judged.record.why
    )
    assert judged.record.why.endswith("not shipped; full prefill")
    assert judged.meaning().startswith(
        "Qwen2.5-Coder-1.5B-Instruct runs full prefill: held out, the chosen policy falls short of the target 0.95"
    )
    assert judged.held_out == packaged.held_out and judged.shortfalls() == {}
    backed = PackagedCalibration.from_bytes(json.dumps(blending(1.0)).encode(), tmp_path / "y.json")
    assert backed.under_shipping_rule() is backed and backed.record.ratio == 0.15

    # the package reads a file that breaks the rule as full prefill, and says why
    (tmp_path / QWEN15_TRANSFORMERS).write_text(json.dumps(blending(56 / 60)))
    monkeypatch.setattr(cal.packaged, "PACKAGED_DIR", tmp_path)
    packaged_calibrations.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cal.__name__):
            (found,) = packaged_calibrations().values()
        assert found.record.ratio == 1.0 and found.record.guard is None
        assert f"the packaged calibration {QWEN15_TRANSFORMERS} runs full prefill: held out" in caplog.text
    finally:
        packaged_calibrations.cache_clear()


def test_rejudge_rewrites_only_a_file_that_breaks_the_rule(tmp_path):
    short, backed = tmp_path / "short.json", tmp_path / "backed.json"
    short.write_text(json.dumps(blending(56 / 60)))
    backed.write_text(json.dumps(blending(1.0)))
    before = backed.read_bytes()
    assert rejudge(short) and not rejudge(backed)
    assert backed.read_bytes() == before
    rewritten = PackagedCalibration.from_bytes(short.read_bytes(), short)
    assert rewritten.record.ratio == 1.0 and "(at least 0.901) of 60" in rewritten.record.why
    assert not rejudge(short)  # once rewritten, it keeps the rule
