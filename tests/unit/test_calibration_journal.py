"""The calibration journal keeps a reply's guard shares at the ladder's rungs alone, exactly."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from blend_integrations.calibration import Guard
from blend_integrations.calibration.journal import Journal, RungShares
from blend_integrations.calibration.records import RankShares

LADDER = (0.05, 0.1, 0.15, 0.3)
IDENTITY = {"fingerprint": "f" * 64, "cpu": "this CPU"}


@dataclass
class Reply:  # what the engines' Generation gives calibration
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    ttft_s: float
    ranking_share: RankShares | None


def reply(scores: list[float]) -> Reply:
    return Reply([5, 6], [{5: -0.1, 7: -2.5}, {6: -0.2}], 0.25, RankShares.of(torch.tensor(scores)))


def test_a_resumed_run_reads_the_shares_and_guard_ratios_a_whole_ranking_gives(tmp_path):
    scores = [float((7 * i) % 23 + 1) for i in range(200)]  # a ranking of 200 reused tokens
    live = reply(scores)
    journal = Journal(tmp_path / "journal.jsonl", IDENTITY, LADDER)
    journal.put("a" * 64, live, wall_s=0.3)
    line = json.loads((tmp_path / "journal.jsonl").read_text().splitlines()[1])
    assert len(line["shares"]) == len(LADDER)  # a value per rung, not one per token
    kept = Journal(tmp_path / "journal.jsonl", IDENTITY, LADDER).get("a" * 64)
    assert kept is not None and isinstance(kept.ranking_share, RungShares)
    assert [kept.ranking_share(r) for r in LADDER] == [live.ranking_share(r) for r in LADDER]
    for base in LADDER:
        for threshold in (0.1, 0.2, 0.4, 0.6, 0.99):
            guard = Guard(base, threshold, LADDER)
            assert guard.ratio(kept.ranking_share) == guard.ratio(live.ranking_share)
    with pytest.raises(ValueError, match="not at 0.2"):
        kept.ranking_share(0.2)


def test_a_journal_of_another_ladder_or_with_bad_shares_is_not_used(tmp_path):
    path = tmp_path / "journal.jsonl"
    Journal(path, IDENTITY, LADDER).put("a" * 64, reply([3.0, 2.0, 1.0, 1.0]))
    assert Journal(path, IDENTITY, (0.05, 0.3)).get("a" * 64) is None  # started afresh: another ladder
    journal = Journal(path, IDENTITY, LADDER)
    journal.put("b" * 64, reply([3.0, 2.0, 1.0, 1.0]))
    header, line = path.read_text().splitlines()
    for shares in ([0.5, 0.9], [0.5, 0.4, 0.9, 1.0], [0.1, 0.2, 0.3, 1.5]):  # too few, falling, above 1
        path.write_text("\n".join([header, json.dumps(json.loads(line) | {"shares": shares})]) + "\n")
        assert Journal(path, IDENTITY, LADDER).get("b" * 64) is None, shares
