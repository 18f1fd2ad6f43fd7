"""The server's live check (``http_checks``): which requests it may check, how it reads an answer
streamed or not, completion or chat, and when the connector's answer says "auto" blended it.
The checks themselves run against a real server in tests/integration/test_live_check.py."""

from __future__ import annotations

import json

import pytest

from blend_integrations.engines.quality_check import agrees
from blend_integrations.http_checks import answer_of, answer_text, blended_by_auto, checkable

BLEND = {"blend": {"mode": "blend", "ratio": "auto", "chunk_spans": [[1, 5]], "num_tokens": 9}}
GREEDY = {"prompt": list(range(10)), "temperature": 0, "kv_transfer_params": BLEND}
AUTO = {"blend": {"recompute_ratio": 0.15, "ratio_source": "fallback", "cached_tokens": 4, "recomputed_tokens": 1}}


@pytest.mark.parametrize(
    ("path", "change", "expected"),
    [
        ("/v1/completions", {}, True),
        ("/v1/completions", {"prompt": "a text prompt"}, True),
        ("/v1/chat/completions", {"prompt": None, "messages": [{"role": "user", "content": "hi"}]}, True),
        ("/v1/embeddings", {}, False),
        ("/v1/completions", {"temperature": 0.7}, False),  # sampled: another answer each time
        ("/v1/completions", {"temperature": None}, False),  # vLLM's default may not be greedy
        ("/v1/completions", {"n": 2}, False),
        ("/v1/completions", {"echo": True}, False),
        ("/v1/completions", {"prompt": [[1, 2], [3, 4]]}, False),  # several prompts
        ("/v1/completions", {"prompt": ["one", "two"]}, False),
        ("/v1/completions", {"kv_transfer_params": {}}, False),  # nothing to blend
        ("/v1/completions", {"kv_transfer_params": {"blend": {**BLEND["blend"], "mode": "reuse"}}}, False),
    ],
)
def test_only_one_greedy_blended_answer_to_one_prompt_may_be_checked(path, change, expected):
    assert checkable(path, {**GREEDY, **change}) is expected


def test_an_answer_is_read_streamed_or_not_from_completions_and_chats():
    completion = {"choices": [{"text": " Paris is"}], "kv_transfer_params": AUTO}
    assert answer_of({}, json.dumps(completion).encode()) == (" Paris is", AUTO)
    chat = {"choices": [{"message": {"role": "assistant", "content": "Paris"}}], "kv_transfer_params": AUTO}
    assert answer_of({}, json.dumps(chat).encode()) == ("Paris", AUTO)
    events = [
        {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"delta": {"content": "Par"}}]},
        {"choices": [{"delta": {"content": "is"}}]},
        {"choices": [], "kv_transfer_params": AUTO},  # what the middleware adds before [DONE]
    ]
    stream = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    assert answer_of({"stream": True}, stream.encode()) == ("Paris", AUTO)
    assert answer_of({}, b"not json") is None and answer_of({}, b"[1, 2]") is None
    assert answer_of({}, b'{"choices": ["text"]}') is None and answer_of({}, b'{"choices": {"a": 1}}') is None


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (AUTO, True),
        ({"blend": {**AUTO["blend"], "ratio_source": "checked", "recompute_ratio": 0.3}}, True),
        ({"blend": {**AUTO["blend"], "ratio_source": "request"}}, False),  # the request's own ratio
        ({"blend": {**AUTO["blend"], "recompute_ratio": 1.0}}, False),  # full prefill's answer
        ({"blend": {**AUTO["blend"], "cached_tokens": 0}}, False),  # every chunk missed
        ({**AUTO, "blend_fallback": "the blend pass failed"}, False),
        ({"blend": {**AUTO["blend"], "cached_tokens": -1}}, False),  # not the connector's: refused
        (None, False),
    ],
)
def test_auto_blended_it_only_where_the_connector_says_so(params, expected):
    assert blended_by_auto(params) is expected


def test_full_prefills_first_tokens_begin_the_blends_answer():
    assert agrees((1, 2, 3, 4), (1, 2, 3, 4)) and not agrees((1, 2, 3, 5), (1, 2, 3, 4))
    assert agrees([1, 2, 9], (1, 2))  # the blend stopped after 2 tokens: those 2 are compared
    assert agrees(" Paris is", " Paris is the capital") and not agrees(" Lyon", " Paris is the capital")
    assert agrees(" caf\ufffd", " café au lait")  # a character cut at the last compared token
    assert not agrees(" Paris is the capital of", " Paris is")  # the blend stopped sooner than full prefill
    assert not agrees((1, 2), "text") and not agrees("text", (1, 2))


def test_a_checks_tokens_are_read_as_the_text_vllm_would_have_answered(model_dirs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dirs("llama"))
    words = tokenizer.encode(" the river runs north", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    ends = frozenset({eos})
    assert answer_text(tokenizer, ends, words, {}) == tokenizer.decode(words)
    # cut before an end token, unless the request ignored it; special tokens skipped as vLLM does
    assert answer_text(tokenizer, ends, [*words[:2], eos, *words[2:]], {}) == tokenizer.decode(words[:2])
    kept = answer_text(tokenizer, ends, [*words[:2], eos, *words[2:]], {"ignore_eos": True})
    assert kept == tokenizer.decode([*words[:2], eos, *words[2:]], skip_special_tokens=True)
    assert answer_text(tokenizer, ends, words, {"stop_token_ids": [words[1]]}) == tokenizer.decode(words[:1])
    # cut at the first stop string, kept where the request asked for it
    text = tokenizer.decode(words)
    assert answer_text(tokenizer, ends, words, {"stop": "river"}) == text[: text.index("river")]
    both = {"stop": ["north", "runs"], "include_stop_str_in_output": True}
    assert answer_text(tokenizer, ends, words, both) == text[: text.index("runs") + 4]
    assert answer_text(tokenizer, ends, words, {"stop": ["", 7, "absent"]}) == text
