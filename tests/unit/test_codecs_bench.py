"""``benchmarks codecs --package``: which codecs the packaged calibration may be used under."""

from __future__ import annotations

import dataclasses
import shutil

from benchmarks.codecs import chosen, write_checked
from blend_integrations.calibration.packaged import PACKAGED_DIR, PackagedCalibration

# a packaged file that ships a policy below full prefill: SmolLM2's guard from 0.9 on vLLM
SHIPPED_MODEL, ENGINE = "smollm2", "vllm"


def _copy(tmp_path):
    shutil.copy(PACKAGED_DIR / f"{SHIPPED_MODEL}-{ENGINE}.json", tmp_path)
    path = tmp_path / f"{SHIPPED_MODEL}-{ENGINE}.json"
    return path, chosen(PackagedCalibration.from_bytes(path.read_bytes(), path).record)


def test_codecs_that_choose_the_packaged_policy_are_written_and_the_rest_are_not(tmp_path):
    path, shipped = _copy(tmp_path)
    other = {**shipped, "ratio": 1.0}
    choices = {"raw": {"choice": shipped}, "fp8": {"choice": other}, "int8": {"choice": dict(shipped)}}
    assert write_checked(choices, SHIPPED_MODEL, ENGINE, tmp_path) == ["int8"]
    written = PackagedCalibration.from_bytes(path.read_bytes(), path)
    assert written.record.codecs_checked == ["int8"]
    assert written.record.holds_under("int8") and not written.record.holds_under("fp8")
    # nothing else in the file moved
    original = PackagedCalibration.from_bytes((PACKAGED_DIR / path.name).read_bytes(), path)
    assert dataclasses.replace(written.record, codecs_checked=original.record.codecs_checked) == original.record
    assert (written.held_out, written.cpu) == (original.held_out, original.cpu)


def test_nothing_is_written_when_the_raw_store_chose_another_policy_here(tmp_path):
    path, shipped = _copy(tmp_path)
    original = path.read_bytes()
    other = {**shipped, "settings": {**shipped["settings"], "sink_tokens": 7}}
    assert write_checked({"raw": {"choice": other}, "int8": {"choice": other}}, SHIPPED_MODEL, ENGINE, tmp_path) == []
    assert path.read_bytes() == original
