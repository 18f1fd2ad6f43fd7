"""Engines layer: what the blend connector's scheduler side answers for each
request in its finished ``kv_transfer_params``, and when.

The answer is the request's usage (``"blend"``), the loading controller's
decisions (``"blend_loading"``), why it was computed in full when it was
(``"blend_fallback"``), and, when the request asked (``details``), which of
its tokens came from the store and which of those were recomputed
(``"blend_details"``).

What the blend pass did (the ratio a per-request guard raised, the tokens it
recomputed) is known in the worker only. The worker reports it with its step's
output (``PassReport``, in ``BlendWorkerMetadata``), and the scheduler side
keeps it until the request finishes. A request that finishes in the step its
pass ran in is the one case where the report comes later: vLLM 0.32 and 0.33
call ``request_finished`` for it in ``Scheduler.update_from_output`` before
``update_connector_output`` in the same call, and send the step's outputs
only after that call returns (tests/unit/test_vllm_versions.py reads this
order in both). So ``Answers.finish`` hands vLLM the answer made from the
plan, and ``Answers.report`` amends that very dict in place when the report
comes. Its counts and a stream's answer file are written once the step's
reports are in (``settle``), before its outputs go out.

A request vLLM's front end stops on a stop string is aborted in the engine
core: vLLM drops what ``request_finished`` answers for it, so its last output
carries no ``kv_transfer_params``. The worker keeps the answers of its latest
blend passes (``RecentAnswers``) for the embedded engine and the server's
middleware to ask for then.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..calibration import RankShares, RatioChoice
from ..fusion import PrefillPlan, PrefillStats
from . import stream_usage
from .blend_metrics import BlendCounters
from .vllm_contract import not_blended

# The usage fields a blend pass's report sets over its plan's (the walk's own numbers).
WALK_USAGE = ("cached_tokens", "recomputed_tokens", "recompute_ratio", "ratio_source", "ranking_captured")


@dataclass(frozen=True)
class PassReport:
    """What one request's blend pass did, as the worker tells the scheduler."""

    usage: dict[str, Any]  # WALK_USAGE
    details: dict[str, Any] | None = None  # reused_spans, recomputed_positions, ranking_shares (when asked)

    @classmethod
    def of(cls, stats: PrefillStats, details: bool) -> PassReport:
        shares = stats.ranking_share
        return cls(
            {name: getattr(stats, name) for name in WALK_USAGE},
            {
                "reused_spans": [list(span) for span in stats.reused_spans],
                "recomputed_positions": list(stats.recomputed_positions),
                "ranking_shares": list(shares.cumulative) if shares is not None else None,
            }
            if details
            else None,
        )


def answer_of(plan: PrefillPlan, report: PassReport | None) -> dict[str, Any]:
    """A planned request's answer: the plan's usage, with its pass's own numbers where reported."""
    answer: dict[str, Any] = {"blend": plan.usage() | (report.usage if report is not None else {})}
    if plan.loading is not None:
        answer["blend_loading"] = dataclasses.asdict(plan.loading)
    if report is not None and report.details is not None:
        answer["blend_details"] = report.details
    return answer


class RecentAnswers:
    """The worker side's answers of its latest blend passes, by vLLM's request
    id: for a request whose finished output lost its answer (stopped on a stop
    string). Bounded: the oldest is dropped, so unlike the per-request maps
    it may outlive its requests."""

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._answers: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def keep(self, req_id: str, answer: dict[str, Any]) -> None:
        self._answers[req_id] = answer
        self._answers.move_to_end(req_id)
        while len(self._answers) > self.size:
            self._answers.popitem(last=False)

    def find(self, request_id: str) -> dict[str, Any] | None:
        """The answer of the request the caller named ``request_id``: vLLM's
        engine core knows it as that id plus ``-`` and 8 random hex digits.
        Only that suffix matches, so the id of another request that merely
        starts with this one (a client may choose ids) is never taken for it."""
        core_id = re.compile(re.escape(request_id) + r"-[0-9a-f]{8}")
        for req_id in reversed(self._answers):
            if req_id == request_id or core_id.fullmatch(req_id):
                return self._answers[req_id]
        return None


class Answers:
    """The scheduler side's per-request state of what it will answer: each
    request is in at most one of ``planned``, ``fallbacks``, ``in_full``
    until it finishes, and in ``finishing`` until its step is settled."""

    def __init__(self) -> None:
        self.planned: dict[str, PrefillPlan] = {}  # req_id -> its plan, whose usage it reports
        self.reports: dict[str, PassReport] = {}  # req_id -> its pass's report, until it finishes
        self.fallbacks: dict[str, tuple[str, str]] = {}  # req_id -> (why, REASONS' name)
        self.in_full: dict[
            str, RatioChoice
        ] = {}  # req_id -> the calibration's choice, for a request it computes in full
        # req_id -> (its answer, its plan, its kv_transfer_params): finished, until the step settles
        self._finishing: dict[str, tuple[dict | None, PrefillPlan | None, Any]] = {}
        self.counters = BlendCounters()  # settled requests since vLLM last asked

    def fall_back(self, req_id: str, why: str, reason: str) -> None:
        self.fallbacks[req_id] = (why, reason)
        self.planned.pop(req_id, None)
        self.reports.pop(req_id, None)

    def report(self, req_id: str, report: PassReport) -> None:
        """A blend pass's report: kept for a request still running, written
        into the answer of one that finished in this step. A report on a
        request that is neither (aborted, or fallen back) changes nothing."""
        if req_id in self.planned:
            self.reports[req_id] = report
        elif req_id in self._finishing:
            answer, plan, _ = self._finishing[req_id]
            if answer is not None and plan is not None:
                answer.update(answer_of(plan, report))

    def finish(self, req_id: str, kv_transfer_params: Any) -> dict | None:
        """The answer vLLM sends with the finished request (None: not blended)."""
        fallback = self.fallbacks.pop(req_id, None)
        plan = self.planned.pop(req_id, None)
        report = self.reports.pop(req_id, None)
        calibration = self.in_full.pop(req_id, None)
        if fallback is not None:
            answer: dict | None = not_blended(*fallback)
        elif plan is not None:
            answer = answer_of(plan, report)
            plan = plan if report is None else None  # reported already: nothing left to amend
        elif calibration is not None:
            full = PrefillPlan("full", 1.0, (), 0, ratio_source=calibration.source, calibration_dtype=calibration.dtype)
            answer = {"blend": full.usage()}
        else:
            answer = None
        self._finishing[req_id] = (answer, plan, kv_transfer_params)
        return answer

    def settle(self) -> None:
        """Count the finished requests and keep streams' answers, now that
        their step's reports are in."""
        finishing, self._finishing = self._finishing, {}
        for answer, _, params in finishing.values():
            self.counters.add(answer)  # here, once per request, whatever the ranks
            stream_usage.write_answer(params, answer)  # for a stream's end

    def take_counters(self) -> BlendCounters:
        self.settle()
        counters, self.counters = self.counters, BlendCounters()
        return counters

    def pending(self) -> dict[str, int]:
        maps = ("planned", "reports", "fallbacks", "in_full", "_finishing")
        return {name.strip("_"): len(getattr(self, name)) for name in maps}


def blend_details(
    params: Any, prompt_len: int
) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...], RankShares | None] | None:
    """The reused spans, the recomputed positions and the ranking shares a
    finished request's ``kv_transfer_params["blend_details"]`` carries, checked
    against the prompt's ``prompt_len`` tokens; None when it carries none."""
    details = params.get("blend_details") if isinstance(params, dict) else None
    if details is None:
        return None
    where = "kv_transfer_params['blend_details']"
    if not isinstance(details, dict):
        raise ValueError(f"{where} must be a dict, got {type(details).__name__}")
    spans, positions = details.get("reused_spans"), details.get("recomputed_positions")
    shares = details.get("ranking_shares", details.get("deviation_shares"))  # the older connector's name
    if not isinstance(spans, list) or not all(
        isinstance(s, (list, tuple))
        and len(s) == 2
        and all(type(x) is int for x in s)
        and 0 <= s[0] < s[1] <= prompt_len
        for s in spans
    ):
        raise ValueError(f"{where}['reused_spans'] must be [start, end) pairs within the prompt's {prompt_len} tokens")
    reused = tuple((int(a), int(b)) for a, b in spans)
    inside = {i for a, b in reused for i in range(a, b)}
    if not isinstance(positions, list) or not all(type(p) is int and p in inside for p in positions):
        raise ValueError(f"{where}['recomputed_positions'] must be positions of the reused spans")
    if shares is not None and (
        not isinstance(shares, list)
        or not all(isinstance(x, float) and math.isfinite(x) and 0.0 <= x <= 1.0 + 1e-6 for x in shares)
    ):
        raise ValueError(f"{where}['ranking_shares'] must be a list of shares between 0 and 1")
    return reused, tuple(positions), None if shares is None else RankShares(tuple(shares))
