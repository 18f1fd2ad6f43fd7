"""The live check's state (``calibration/live_check.py``): the rule that moves "auto" up and down
the ladder, kept in a real chunk store (disk, and Redis across stores), read by every engine's
``Calibrations``, and refused when damaged."""

from __future__ import annotations

import json
import logging

import pytest

from blend_integrations.calibration import Calibrations, Guard, RatioChoice, wilson_lower
from blend_integrations.calibration.live_check import (
    STEP_DOWN_WINDOWS,
    WINDOW,
    LiveCheckError,
    LiveState,
    policy_key,
    rungs_above,
    state_name,
    window_size,
)
from blend_integrations.calibration.records import max_misses
from blend_integrations.store import ChunkStore

FALLBACK = RatioChoice(0.15, "fallback")
ALLOWED = max_misses(WINDOW, 0.95, 0.8)  # 3: 97 of 100 has a lower bound of at least 0.95 at 0.8
FINGERPRINT = "f" * 64


def calibrations(store: ChunkStore) -> Calibrations:
    return Calibrations(store, FINGERPRINT, "float32", engine="transformers", label="test-model")


def state(base: float = 0.15) -> LiveState:
    return LiveState(policy_key(FALLBACK), base, base, 0.95, 0.8)


def test_a_window_allows_the_misses_that_still_show_the_target():
    assert window_size(0.95, 0.8) == WINDOW and ALLOWED == 3
    assert wilson_lower(97, 100, 0.8) >= 0.95 > wilson_lower(96, 100, 0.8)
    # a target so high that a window of WINDOW could not allow one miss gets a longer window
    assert window_size(0.99, 0.8) > WINDOW and max_misses(window_size(0.99, 0.8), 0.99, 0.8) >= 1


def test_the_miss_a_window_cannot_allow_steps_up_at_once_and_the_log_says_why():
    s = state()
    for _ in range(40):
        assert s.judge(True) is None
    for _ in range(ALLOWED):
        assert s.judge(False) is None and s.rung == 0.15
    step = s.judge(False)
    assert step is not None and (step["from"], step["to"]) == (0.15, 0.2) and s.rung == 0.2
    assert "4 of 44 checked answers at ratio 0.15 disagreed" in step["why"] and "may miss" in s.why
    assert s.rungs["0.15"].failed == 1 and s.rungs["0.15"].checked == 44 and s.rungs["0.15"].agreed == 40
    # a fresh window on the new rung
    assert s.counts().window_checked == 0


def test_answers_that_keep_disagreeing_climb_to_full_prefill_and_stop_there():
    s = state()
    for _ in range((ALLOWED + 1) * len(rungs_above(0.15))):
        s.judge(False)
    assert s.rung == 1.0 and [x["to"] for x in s.steps] == rungs_above(0.15)
    assert s.judge(False) is None and s.rung == 1.0


def test_a_holding_rung_never_moves_and_a_raised_one_steps_down_after_windows_that_show_the_target():
    s = state()
    for _ in range(5 * WINDOW):
        assert s.judge(True) is None
    assert s.rung == 0.15 and s.rungs["0.15"].passed_in_a_row == 5  # never below the calibrated policy
    s = state()
    for _ in range(ALLOWED + 1):
        s.judge(False)
    assert s.rung == 0.2
    # the rung below failed once: twice STEP_DOWN_WINDOWS windows before it is tried again
    for _ in range(2 * STEP_DOWN_WINDOWS * WINDOW - 1):
        assert s.judge(True) is None
    step = s.judge(True)
    assert step is not None and (step["from"], step["to"]) == (0.2, 0.15) and "trying 0.15 again" in step["why"]
    # a window with ALLOWED misses still shows the target: it counts as passed
    s = state(0.5)
    s.rung = 0.7
    for i in range(WINDOW):
        s.judge(i >= ALLOWED)
    assert s.rungs["0.7"].passed_in_a_row == 1 and s.rung == 0.7


def test_a_state_round_trips_and_a_damaged_or_foreign_one_is_refused():
    s = state()
    for _ in range(ALLOWED + 1):
        s.judge(False)
    again = LiveState.from_bytes(s.to_bytes())
    assert again == s
    data = json.loads(s.to_bytes())
    bad = [
        b"not json",
        json.dumps({**data, "kind": "blend-calibration"}).encode(),
        json.dumps({**data, "version": 99}).encode(),
        json.dumps({**data, "rung": 0.33}).encode(),  # not on the ladder
        json.dumps({**data, "rungs": {"0.15": {**data["rungs"]["0.15"], "agreed": 500}}}).encode(),
        json.dumps({k: v for k, v in data.items() if k != "target"}).encode(),
    ]
    for raw in bad:
        with pytest.raises(LiveCheckError):
            LiveState.from_bytes(raw)


def test_checks_kept_in_the_store_move_auto_for_every_engine_on_it(tmp_path, caplog):
    with ChunkStore(tmp_path / "store", remote="") as store, caplog.at_level(logging.WARNING):
        mine, other = calibrations(store), calibrations(store)
        base = mine.calibrated_choice()
        assert base == RatioChoice(0.15, "fallback") and mine.choice() == base
        for _ in range(ALLOWED + 1):
            mine.record_check(base, 0.15, False)
        assert mine.choice() == RatioChoice(0.2, "checked")
        assert other.choice() == RatioChoice(0.2, "checked")  # another engine reads the store's state
        assert any('the live check moved "auto" from ratio 0.15 to 0.2' in r.getMessage() for r in caplog.records)
        # a check of a request served on the old rung is dropped; a failed check is counted, not judged
        mine.record_check(base, 0.15, False)
        mine.record_check(base, 0.2, None)
        summary = mine.live.summary()
        assert summary["ratio"] == 0.2 and summary["failed_checks"] == 1
        assert summary["rungs"]["0.15"] == {"checked": ALLOWED + 1, "agreed": 0, "lower_bound": 0.0}
        raw = store.get_record(state_name(FINGERPRINT, "float32", "transformers", None))
        assert raw is not None and LiveState.from_bytes(raw).rung == 0.2


def test_a_new_calibrated_policy_starts_afresh_and_a_guard_keeps_its_threshold_on_the_raised_rung(tmp_path):
    with ChunkStore(tmp_path / "store", remote="") as store:
        live = calibrations(store).live
        guarded = RatioChoice(0.1, "calibrated", Guard(0.1, 0.8), {"selection": "query"}, "bfloat16")
        for _ in range(ALLOWED + 1):
            live.record(guarded, 0.1, False, 0.95, 0.8)
        raised = live.apply(guarded)
        assert raised == RatioChoice(0.12, "checked", Guard(0.12, 0.8), {"selection": "query"}, "bfloat16")
        # the fallback is another policy: the state does not apply to it, and its first check starts a new one
        assert live.apply(FALLBACK) == FALLBACK
        live.record(FALLBACK, 0.15, True, 0.95, 0.8)
        assert live.state is not None and live.state.policy == policy_key(FALLBACK) and live.state.rung == 0.15


def test_a_damaged_state_in_the_store_is_said_once_and_auto_runs_the_calibrated_policy(tmp_path, caplog):
    with ChunkStore(tmp_path / "store", remote="") as store, caplog.at_level(logging.WARNING):
        store.put_record(state_name(FINGERPRINT, "float32", "transformers", None), b'{"kind": "blend-quality-check"}')
        mine = calibrations(store)
        assert mine.choice() == FALLBACK
        said = [r.getMessage() for r in caplog.records if "live-check state" in r.getMessage()]
        assert len(said) == 1 and "is not used" in said[0]
        mine.record_check(FALLBACK, 0.15, True)  # a check replaces it with a sound state
        assert LiveState.from_bytes(store.get_record(mine.live.name)).rungs["0.15"].checked == 1


def test_the_state_crosses_machines_through_redis(tmp_path, redis_url):
    with ChunkStore(tmp_path / "a", remote=redis_url) as a, ChunkStore(tmp_path / "b", remote=redis_url) as b:
        here, there = calibrations(a), calibrations(b)
        for _ in range(ALLOWED + 1):
            here.record_check(FALLBACK, 0.15, False)
        assert there.choice() == RatioChoice(0.2, "checked")


def test_where_the_answers_hold_the_share_checked_falls_to_an_eighth(tmp_path):
    with ChunkStore(tmp_path / "store", remote="") as store:
        live = calibrations(store).live
        assert live.share(FALLBACK, 0.05) == 0.05  # no state yet
        shares = []
        for _ in range(5):
            for _ in range(WINDOW):
                live.record(FALLBACK, 0.15, True, 0.95, 0.8)
            shares.append(live.share(FALLBACK, 0.05))
        assert shares == [0.025, 0.0125, 0.00625, 0.00625, 0.00625]
        # a window that fails (a step up) checks the new rung at the full share again
        for _ in range(ALLOWED + 1):
            live.record(FALLBACK, 0.15, False, 0.95, 0.8)
        assert live.apply(FALLBACK).ratio == 0.2 and live.share(FALLBACK, 0.05) == 0.05
        # another policy's state says nothing about this one; a calibrated policy (its calibration showed
        # the target) starts at the floor, and a miss in its window brings the whole share back
        calibrated = RatioChoice(0.3, "calibrated")
        assert live.share(calibrated, 0.05) == 0.00625
        live.record(calibrated, 0.3, True, 0.95, 0.8)
        assert live.share(calibrated, 0.05) == 0.00625
        live.record(calibrated, 0.3, False, 0.95, 0.8)
        assert live.share(calibrated, 0.05) == 0.05
        for _ in range(ALLOWED):
            live.record(calibrated, 0.3, False, 0.95, 0.8)
        # the rung it was raised to, which no window has passed yet, is checked at the whole share
        assert live.apply(calibrated).ratio == 0.5 and live.share(calibrated, 0.05) == 0.05
