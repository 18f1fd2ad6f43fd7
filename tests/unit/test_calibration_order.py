"""Which policies calibration runs (``calibration.measure._measure``): cheapest first by the cost model,
and none that the model predicts too slow to be worth it by more than its tolerance. The replies here
are made up (each probe's time is its token-layers, so the fitted cost model is exact) to put the
policies where the rule decides; calibrations on a real engine are in tests/integration/test_calibration.py."""

from __future__ import annotations

from dataclasses import dataclass

from blend_integrations.calibration.measure import _measure, _Replies
from blend_integrations.config import check_schedule
from blend_integrations.cost import PREDICTION_TOLERANCE, Shape, full_token_layers, token_layers
from blend_integrations.prompt import TokenizedPrompt

LAYERS = 4
LADDER = [0.1, 0.3, 0.5, 0.9]
SETTINGS = {"check_layers": [1], "selection": "deviation", "sink_tokens": 0}
# 100 tokens, 80 of them in two chunks after a 10-token system prompt: at check layer 1 of 4 a blend
# at ratio r costs (100 + 3 * (20 + 80 r)) / 400 = 0.4 + 0.6 r of full prefill (0.46, 0.58, 0.7, 0.94)
PROBE = TokenizedPrompt(list(range(100)), [(10, 50), (50, 90)])
RIGHT = [1, 2, 3, 4]


@dataclass
class Made:
    token_ids: list[int]
    ttft_s: float
    logprobs: None = None
    ranking_share: None = None


def measured(min_speedup: float) -> list[float]:
    """The ratios blended, in order, when answers agree from ratio 0.5 up."""
    shape, asked = Shape.of(100, PROBE.chunk_spans), []

    def blend(prompt, ratio, settings):
        asked.append(ratio)
        seconds = token_layers(shape, LAYERS, check_schedule((1,), ratio)) * 1e-4
        return Made(RIGHT if ratio >= 0.5 else [9, 9, 9, 9], seconds)

    full = Made(RIGHT, full_token_layers(shape, LAYERS) * 1e-4)
    replies = _Replies([PROBE] * 6, [full] * 6, blend, [SETTINGS], ["generated"] * 6)
    options = dict(target=0.5, confidence=0.5, min_speedup=min_speedup, exhaustive=False)
    _measure(replies, LADDER, [SETTINGS], LAYERS, 4, **options)
    return asked


def test_a_policy_the_cost_model_predicts_too_slow_is_not_run():
    # 0.7 of full prefill at 0.5: 1.43x sooner, under 1.6x; run, then found too slow
    assert 0.5 in measured(1.6)
    # hopeless from 0.65 of full prefill (1.15 / 1.77): the cost model rules 0.5 out before it runs
    hopeless = measured(PREDICTION_TOLERANCE / 0.65)
    assert 0.5 not in hopeless and 0.3 in hopeless  # 0.58 of full prefill: run, and ruled out by disagreeing
