"""Who may attend to whom in the tuning's block reading, with the stored
recipe's lone BOS before each chunk or a longer lead (APE's shared prefix)."""

from __future__ import annotations

import pytest

from blend_integrations.prompt import TokenizedPrompt
from blend_integrations.tune.readings import block_reading, full_reading

# prefix 10 11 12 | chunk 20 21 | separator 30 | chunk 40 41 42 | question 50
PROMPT = TokenizedPrompt([10, 11, 12, 20, 21, 30, 40, 41, 42, 50], [(3, 5), (6, 9)])
BOS = 1


def rows(reading, ids):
    return [reading.ids.index(t) for t in ids]


def sees(reading, q: int, ks) -> bool:
    return all(bool(reading.allowed[q, k]) for k in ks)


def blind(reading, q: int, ks) -> bool:
    return not any(bool(reading.allowed[q, k]) for k in ks)


@pytest.mark.parametrize("lead", [None, [10, 11, 12]])
def test_each_chunk_reads_its_lead_and_itself_and_the_rest_reads_everything_but_the_leads(lead):
    reading = block_reading(PROMPT, [60], BOS, lead=lead)
    copy = [BOS] if lead is None else lead
    n = len(copy)
    # each chunk gets its own copy of the lead, at the positions just before it
    assert len(reading.ids) == len(PROMPT) + 2 * n + 1
    assert reading.ids[3 : 3 + n] == copy and reading.positions[3 : 3 + n] == list(range(3 - n, 3))
    assert len(reading.leads) == 2 * n
    first_lead = list(range(3, 3 + n))
    chunk0 = [3 + n, 4 + n]
    chunk1_lead = list(range(6 + n, 6 + 2 * n))
    chunk1 = [6 + 2 * n, 7 + 2 * n, 8 + 2 * n]
    question, answer = len(reading.ids) - 2, len(reading.ids) - 1
    assert reading.positions[chunk1[0]] == 6 and reading.positions[answer] == len(PROMPT)
    # a chunk token: its lead and its own chunk's earlier tokens, nothing else
    assert sees(reading, chunk1[2], chunk1_lead + chunk1) and blind(reading, chunk1[2], [0, 1, 2, *first_lead, *chunk0])
    # a lead's token: its lead's earlier tokens only
    assert sees(reading, chunk1_lead[-1], chunk1_lead) and blind(reading, chunk1_lead[-1], [0, 1, 2, *chunk0])
    # the question and the reply: every earlier row but the leads' copies
    for q in (question, answer):
        assert sees(reading, q, [0, 1, 2, *chunk0, *chunk1, q]) and blind(reading, q, sorted(reading.leads))
    assert reading.predicts == [question]
    assert set(reading.groups[i] for i in chunk1_lead + chunk1) == {1} and reading.groups[question] == -1


def test_the_full_reading_is_causal_and_a_chunk_needs_room_for_its_lead():
    full = full_reading(PROMPT, [60, 61])
    assert full.allowed.sum() == sum(range(1, 13)) and full.predicts == [9, 10]
    with pytest.raises(ValueError, match="no position for its BOS"):
        block_reading(TokenizedPrompt([20, 21, 50], [(0, 2)]), [], BOS)
