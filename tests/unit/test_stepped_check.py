"""A live check's walk a slice of layers at a time (``engines.vllm_check``), on the transformers
decoder of the tiny llama: the same walk the vLLM workers run on theirs."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from blend_integrations.engines.vllm_check import MAX_SLICE, SLICE_S, SteppedCheck, next_slice
from blend_integrations.models import HFDecoder


@pytest.fixture(scope="module")
def hf_model(model_dirs):
    return AutoModelForCausalLM.from_pretrained(model_dirs("llama"), dtype=torch.float32).eval()


def greedy(hf_model, ids: list[int], tokens: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return out[0, len(ids) :].tolist()


def test_a_check_runs_only_the_layers_it_is_given_and_gives_full_prefills_tokens(hf_model):
    model = HFDecoder(hf_model)
    ids = torch.randint(0, 2048, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    check = SteppedCheck(model, ids, 3)
    try:
        walked = 0
        while (result := check.advance(1)) is None:
            walked += 1
            assert not check.done
        # every layer of the prompt's pass, and of the two tokens' after it, one slice each
        assert walked == 3 * model.num_layers - 1
        assert result == greedy(hf_model, ids, 3)
    finally:
        check.stop()
    # a slice larger than what is left ends it
    big = SteppedCheck(model, ids, 2)
    assert big.advance(1000) == result[:2]
    big.stop()


def test_a_check_stopped_midway_ends_its_thread(hf_model):
    model = HFDecoder(hf_model)
    check = SteppedCheck(model, list(range(1, 40)), 4)
    assert check.advance(2) is None
    check.stop()
    assert check.done and check.result is None
    assert not any(t.name == "blend-live-check" and t.is_alive() for t in threading.enumerate())


def test_a_failing_walk_is_raised_where_the_engine_advances_it(hf_model):
    model = HFDecoder(hf_model)
    check = SteppedCheck(model, [1, 10**6], 2)  # a token id past the vocabulary
    with pytest.raises(IndexError):
        check.advance(1)
    check.stop()
    for bad in ([], [-1], ["a"]):
        with pytest.raises(ValueError, match="token_ids must be"):
            SteppedCheck(model, bad, 2)
    with pytest.raises(ValueError, match="tokens must be an int >= 1"):
        SteppedCheck(model, [1, 2], 0)


def test_slices_grow_while_quick_and_shrink_while_slow():
    assert next_slice(4, SLICE_S / 4) == 8
    assert next_slice(4, SLICE_S * 0.75) == 4
    assert next_slice(4, SLICE_S * 3) == 2
    assert next_slice(1, SLICE_S * 3) == 1
    assert next_slice(MAX_SLICE, 0.0) == MAX_SLICE
