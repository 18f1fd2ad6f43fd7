"""The calibration benchmark's held-out answers, kept while it runs, are taken up by a run resumed
on another day (the record is replayed from the journal with that day's date), and by no run whose
policy, questions or modes differ (the key also holds the machine, which one process cannot vary)."""

from __future__ import annotations

import dataclasses

from benchmarks.calibration import held_out_key
from blend_integrations.calibration import PACKAGED_DIR, PackagedCalibration

MODES = ["full", "default (calibrated)", "fallback (0.15)"]
ASKED = [[[1, 2, 3], [4, 5]], [[6, 7]]]


def record():
    path = PACKAGED_DIR / "qwen2.5-coder-1.5b-transformers.json"
    return PackagedCalibration.from_bytes(path.read_bytes(), path).record


def test_a_run_resumed_on_another_day_takes_up_its_answers():
    made = record()
    replayed = dataclasses.replace(made, date="2031-01-02", seconds=made.seconds + 17.5)
    assert held_out_key(replayed, ASKED, MODES) == held_out_key(made, ASKED, MODES)


def test_answers_to_another_policy_questions_or_modes_are_not_taken_up():
    made = record()
    key = held_out_key(made, ASKED, MODES)
    assert held_out_key(dataclasses.replace(made, ratio=0.5), ASKED, MODES) != key
    assert held_out_key(made, [[[1, 2, 3], [4, 6]], [[6, 7]]], MODES) != key
    assert held_out_key(made, ASKED, MODES[:2]) != key
