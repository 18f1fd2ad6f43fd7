"""What the vLLM connector's scheduler side answers for a request, and when:
a blend pass's report sets the walk's own numbers over the plan's, also for a
request that finished earlier in the same step (its answer is amended in
place, before vLLM sends it), and each request is counted once, after its
step's reports are in. The engine tests run this in vLLM
(tests/integration/test_calibration.py: the guard on vLLM)."""

from __future__ import annotations

import pytest
import torch

from blend_integrations.calibration import RankShares
from blend_integrations.engines import stream_usage
from blend_integrations.engines.vllm_answers import Answers, PassReport, RecentAnswers, blend_details
from blend_integrations.fusion import PrefillPlan, PrefillStats
from blend_integrations.fusion.plan import LOAD, ChunkPlan

PLAN = PrefillPlan(
    "blend", 0.1, (ChunkPlan(2, 12, "a", LOAD), ChunkPlan(12, 22, "b", LOAD)), 0, ratio_source="calibrated"
)
SHARES = RankShares.of(torch.arange(20, dtype=torch.float32))


def guarded_pass(details: bool = True) -> PassReport:
    """The report of a pass whose guard raised the ratio from 0.1 to 0.3."""
    stats = PrefillStats(
        cached_tokens=20,
        recomputed_tokens=6,
        chunks_hit=2,
        recompute_ratio=0.3,
        ratio_source="guard",
        ranking_captured=SHARES(0.3),
        ranking_share=SHARES,
        reused_spans=((2, 12), (12, 22)),
        recomputed_positions=(3, 5, 8, 13, 17, 21),
    )
    return PassReport.of(stats, details)


def test_a_report_before_the_request_finishes_is_in_its_answer():
    answers = Answers()
    answers.planned["r"] = PLAN
    answers.report("r", guarded_pass())
    answer = answers.finish("r", None)
    assert answer is not None
    assert (answer["blend"]["ratio_source"], answer["blend"]["recompute_ratio"]) == ("guard", 0.3)
    assert answer["blend"]["recomputed_tokens"] == 6 and answer["blend"]["chunks_hit"] == 2
    assert answer["blend_details"]["recomputed_positions"] == [3, 5, 8, 13, 17, 21]
    answers.settle()
    assert answers.take_counters().guard_raised == 1
    assert set(answers.pending().values()) == {0}


def test_a_report_after_the_request_finished_in_the_same_step_amends_the_answer_vllm_holds(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    token = stream_usage.new_token()
    answers = Answers()
    answers.planned["r"] = PLAN
    held = answers.finish("r", {"blend": {}, stream_usage.TOKEN_KEY: token})  # vLLM puts this dict in its output
    assert (
        held is not None and held["blend"]["ratio_source"] == "calibrated" and held["blend"]["recomputed_tokens"] == 2
    )
    assert answers.pending()["finishing"] == 1
    answers.report("r", guarded_pass(details=False))
    assert (held["blend"]["ratio_source"], held["blend"]["recompute_ratio"]) == ("guard", 0.3)
    assert held["blend"]["recomputed_tokens"] == 6 and "blend_details" not in held
    answers.settle()  # counted, and a stream's answer written, once the step's reports are in
    assert stream_usage.take_answer(token) == (True, held)
    counters = answers.take_counters()
    assert counters.guard_raised == 1 and counters.ratios == [0.3]
    answers.report("r", guarded_pass())  # a report on a settled request changes nothing
    assert "blend_details" not in held and set(answers.pending().values()) == {0}


def test_a_fallen_back_request_drops_its_report_and_says_why():
    answers = Answers()
    answers.planned["r"] = PLAN
    answers.report("r", guarded_pass())
    answers.fall_back("r", "the blend pass failed: boom", "blend_pass_failed")
    answer = answers.finish("r", None)
    assert answer is not None and answer["blend_fallback"] == "the blend pass failed: boom"
    assert answer["blend"]["cached_tokens"] == 0 and "blend_details" not in answer
    assert answers.finish("unknown", None) is None  # not a blend request


def test_details_travel_as_plain_lists_and_are_checked():
    report = guarded_pass()
    answer = {"blend_details": report.details}
    spans, positions, shares = blend_details(answer, prompt_len=30)
    assert spans == ((2, 12), (12, 22)) and positions == (3, 5, 8, 13, 17, 21)
    assert shares is not None and [shares(r) for r in (0.05, 0.3, 1.0)] == [SHARES(r) for r in (0.05, 0.3, 1.0)]
    assert blend_details({"blend": {}}, prompt_len=30) is None
    bad = [
        ({"reused_spans": [[2, 40]]}, "reused_spans"),  # past the prompt
        ({"reused_spans": [[12, 2]]}, "reused_spans"),
        ({"reused_spans": "x"}, "reused_spans"),
        ({"recomputed_positions": [1]}, "recomputed_positions"),  # not reused
        ({"recomputed_positions": [3.0]}, "recomputed_positions"),
        ({"ranking_shares": [0.5, float("nan")]}, "ranking_shares"),
        ({"ranking_shares": [2.0]}, "ranking_shares"),
    ]
    for change, field in bad:
        with pytest.raises(ValueError, match=field):
            blend_details({"blend_details": report.details | change}, prompt_len=30)
    with pytest.raises(ValueError, match="must be a dict"):
        blend_details({"blend_details": [1]}, prompt_len=30)


def test_an_older_connectors_deviation_shares_are_read_as_ranking_shares():
    details = guarded_pass().details
    assert details is not None
    old = {**details, "deviation_shares": details["ranking_shares"]}
    del old["ranking_shares"]
    read = blend_details({"blend_details": old}, prompt_len=30)
    assert read is not None and read[2] == SHARES


def test_ranking_shares_are_the_top_tokens_share_of_the_total():
    shares = RankShares.of(torch.tensor([1.0, 3.0, 0.0, 4.0]))
    assert [shares(r) for r in (0.0, 0.25, 0.5, 1.0)] == [0.0, 0.5, pytest.approx(0.875), pytest.approx(1.0)]
    assert RankShares.of(torch.zeros(3))(0.2) == 1.0  # nothing deviates: any share holds all of it
    assert RankShares.of(torch.zeros(0))(0.5) == 1.0


def test_recent_answers_are_found_by_the_callers_id_and_bounded():
    recent = RecentAnswers(size=2)
    recent.keep("blend-1-0a1b2c3d", {"blend": {"cached_tokens": 1}})
    recent.keep("blend-12-9f8e7d6c", {"blend": {"cached_tokens": 12}})
    assert recent.find("blend-12") == {"blend": {"cached_tokens": 12}}  # vLLM's core id: the caller's + a suffix
    assert recent.find("blend-1") == {"blend": {"cached_tokens": 1}}  # not blend-12's
    assert recent.find("blend-12-9f8e7d6c") == {"blend": {"cached_tokens": 12}}
    recent.keep("cmpl-5f3a-0-00000000", {"blend": {"cached_tokens": 3}})  # the API server's: prompt 0 of cmpl-5f3a
    assert recent.find("blend-1") is None and recent.find("cmpl-5f3a-0") is not None  # the oldest is dropped
    # only vLLM's own suffix matches: not another request whose id starts with this one's
    assert recent.find("cmpl-5f3a") is None and recent.find("cmpl-5f") is None and recent.find("blend") is None
    recent.keep("chatcmpl-ab-1-00000001", {"blend": {"cached_tokens": 4}})  # a client chose "ab-1"
    assert recent.find("chatcmpl-ab") is None and recent.find("chatcmpl-ab-1") is not None
