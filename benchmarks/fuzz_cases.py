"""Benchmarks: the requests ``python -m benchmarks fuzz`` sends: one
generator per kind of malformed blend parameters, each drawing a request
from a seeded ``random.Random``, and the good parameters they start from."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from blend_integrations.engines.vllm_contract import MAX_CHUNKS, BlendParamsError, parse_blend_params


@dataclass(frozen=True)
class Case:
    """One request the fuzzer sends."""

    kind: str  # what is wrong with it (a generator's name), or "good"
    path: str
    body: bytes
    good: int | None = None  # for good requests: the index of their baseline


@dataclass
class Prompt:
    """A prompt laid out as the engines lay it out (``fuzz.make_prompts``)."""

    ids: list[int]
    spans: list[list[int]]
    text: str  # the same documents as text, for text-prompt cases


def completion(model: str, prompt, blend=None, *, kv=None, max_tokens: int = 2) -> dict:
    """A greedy ``/v1/completions`` body that returns its tokens' ids."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    if kv is not None or blend is not None:
        body["kv_transfer_params"] = kv if kv is not None else {"blend": blend}
    return body


def encode(body) -> bytes:
    return json.dumps(body).encode()  # NaN and Infinity as JavaScript writes them, which vLLM's parser reads


def good_blend(p: Prompt) -> dict:
    """Blend parameters the rules accept: the prompt's own spans."""
    return {"mode": "blend", "ratio": 0.5, "chunk_spans": [list(s) for s in p.spans], "num_tokens": p.spans[-1][1]}


# -- the generators: each returns (path, body) of one malformed request ------------------

WRONG_VALUES = ["x", "", 1.5, True, False, {}, [], [[]], {"a": 1}, 10**30, -7, "1", [1, 2, 3], "blend"]


def wrong_type(rng, model, p):
    blend = good_blend(p)
    name = rng.choice(["mode", "ratio", "chunk_spans", "num_tokens"])
    blend[name] = rng.choice(WRONG_VALUES)  # a value that happens to be valid is dropped (_surely_malformed)
    return "/v1/completions", encode(completion(model, p.ids, blend))


def missing_field(rng, model, p):
    blend = good_blend(p)
    for name in rng.choice([["mode"], ["chunk_spans"], ["chunk_spans", "num_tokens"], list(blend)]):
        blend.pop(name)
    return "/v1/completions", encode(completion(model, p.ids, blend))


def non_finite(rng, model, p):
    blend = good_blend(p)
    value = rng.choice([float("nan"), float("inf"), float("-inf")])
    where = rng.choice(["ratio", "num_tokens", "span"])
    if where == "span":
        blend["chunk_spans"][rng.randrange(len(p.spans))][rng.randrange(2)] = value
    else:
        blend[where] = value
    return "/v1/completions", encode(completion(model, p.ids, blend))


def bad_span(rng, model, p):
    blend = good_blend(p)
    spans = blend["chunk_spans"]
    i = rng.randrange(len(spans))
    a, b = spans[i]
    how = rng.choice(
        [
            "negative",
            "reversed",
            "empty",
            "overlap",
            "unsorted",
            "past_num_tokens",
            "past_prompt",
            "triple",
            "single",
            "object",
            "none_left",
        ]
    )
    if how == "negative":
        spans[0][0] = -rng.randint(1, 10**6)
    elif how == "reversed":
        spans[i] = [b, a]
    elif how == "empty":
        spans[i] = [a, a]
    elif how == "overlap" and len(spans) > 1:
        spans[1][0] = spans[0][1] - 1
    elif how == "unsorted" and len(spans) > 1:
        spans.reverse()
    elif how == "past_num_tokens":
        blend["num_tokens"] = spans[-1][1] - 1
    elif how == "past_prompt":
        spans[-1][1] = len(p.ids) + rng.randint(0, 10**6)
        blend.pop("num_tokens")
    elif how == "triple":
        spans[i] = [a, b, b]
    elif how == "single":
        spans[i] = [a]
    elif how == "object":
        spans[i] = {"start": a, "end": b}
    else:
        blend["chunk_spans"] = []
    if how in ("overlap", "unsorted") and len(spans) <= 1:
        spans[i] = [b, a]
    return "/v1/completions", encode(completion(model, p.ids, blend))


def huge_span_list(rng, model, p):
    n = rng.choice([MAX_CHUNKS + 1, 5000, 50000])
    prompt = [p.ids[0]] * (n + 1)  # one token per span, and one more for vLLM
    blend = {"mode": "blend", "chunk_spans": [[i, i + 1] for i in range(n)], "num_tokens": n}
    return "/v1/completions", encode(completion(model, prompt, blend))


def deep_nesting(rng, model, p):
    depth = rng.choice([20, 200, 5000, 100000])
    nested = "[" * depth + "]" * depth
    where = rng.choice(["span", "blend", "other_key", "whole_body"])
    head = f'{{"model": {json.dumps(model)}, "prompt": {json.dumps(p.ids)}, "max_tokens": 2, '
    if where == "span":
        return "/v1/completions", (
            head + f'"kv_transfer_params": {{"blend": {{"mode": "blend", "chunk_spans": [{nested}]}}}}}}'
        ).encode()
    if where == "blend":
        return "/v1/completions", (head + f'"kv_transfer_params": {{"blend": {nested}}}}}').encode()
    if where == "other_key":
        return "/v1/completions", (
            head + f'"kv_transfer_params": {{"blend": {json.dumps(good_blend(p))}, "x": {nested}}}}}'
        ).encode()
    return "/v1/completions", (
        head + f'"kv_transfer_params": {{"blend": {{"mode": "blend"}}}}, "extra": {nested}}}'
    ).encode()


NON_ASCII = ["\u00a7\u00a7", "\u2603", "\U0001f642", "\u200b", "\ufeff", "\u00e9t\u00e9", "\u0000", "\u4e2d\u6587"]


def odd_separator(rng, model, p):
    how = rng.choice(["non_ascii_text", "non_ascii_ids", "with_spans", "empty", "too_long", "not_text"])
    if how == "non_ascii_text":  # valid for vLLM and for the rules: no chunk between separators, not blended
        return "/v1/completions", encode(
            completion(model, p.text, {"mode": "blend", "separator": rng.choice(NON_ASCII)})
        )
    if how == "non_ascii_ids":
        return "/v1/completions", encode(
            completion(model, p.ids, {"mode": "reuse", "separator": rng.choice(NON_ASCII)})
        )
    blend = {"mode": "blend", "separator": rng.choice(NON_ASCII)}
    if how == "with_spans":
        blend["chunk_spans"] = [list(s) for s in p.spans]
    elif how == "empty":
        blend["separator"] = ""
    elif how == "too_long":
        blend["separator"] = rng.choice(NON_ASCII) * 1000
    else:
        blend["separator"] = rng.choice([7, ["\n\n"], {"s": "\n\n"}])
    return "/v1/completions", encode(completion(model, p.ids, blend))


def num_tokens_at_end(rng, model, p):
    blend = good_blend(p)
    blend["num_tokens"] = len(p.ids) + rng.choice([0, 0, 1, 10**9])
    return "/v1/completions", encode(completion(model, p.ids, blend))


def one_token_prompt(rng, model, p):
    blend = rng.choice(
        [
            {"mode": "blend", "chunk_spans": [[0, 1]]},
            {"mode": "blend", "chunk_spans": [[0, 1]], "num_tokens": 1},
            {"mode": "reuse", "chunk_spans": [[0, 1]], "num_tokens": 0},
        ]
    )
    return "/v1/completions", encode(completion(model, [p.ids[0]], blend))


def not_an_object(rng, model, p):
    kv = rng.choice(
        [
            {"blend": None},
            {"blend": "blend"},
            {"blend": [good_blend(p)]},
            {"blend": 3},
            {"blend": {**good_blend(p), "ratios": 0.2}},
            {"blend": {**good_blend(p), "mode": "BLEND"}},
            {"blend": {**good_blend(p), "mode": "full "}},
            "blend",
            [1, 2],
        ]
    )
    return "/v1/completions", encode(completion(model, p.ids, kv=kv))


def server_tokenized(rng, model, p):
    """Valid JSON for vLLM whose spans only the server can check: the connector
    computes the request in full and says why."""
    blend = rng.choice(
        [
            {"mode": "blend", "chunk_spans": [[0, 10**6]]},
            {"mode": "blend", "chunk_spans": [[1, 3]], "num_tokens": 10**6},
            {"mode": "reuse", "chunk_spans": [[0, 2], [5, 10**5]]},
        ]
    )
    if rng.random() < 0.5:
        return "/v1/completions", encode(completion(model, p.text, blend))
    body = {
        "model": model,
        "messages": [{"role": "user", "content": p.text}],
        "max_tokens": 2,
        "temperature": 0,
        "kv_transfer_params": {"blend": blend},
    }
    return "/v1/chat/completions", encode(body)


def batch_prompts(rng, model, p):
    blend = good_blend(p)
    return "/v1/completions", encode(completion(model, [p.ids, p.ids[: p.spans[-1][1]]], blend))


GENERATORS = [
    wrong_type,
    missing_field,
    non_finite,
    bad_span,
    huge_span_list,
    deep_nesting,
    odd_separator,
    num_tokens_at_end,
    one_token_prompt,
    not_an_object,
    server_tokenized,
    batch_prompts,
]


def _surely_malformed(body: bytes, path: str) -> bool:
    """Whether a generated body cannot be blended: the rules refuse it where
    its prompt's length is known here (token ids); text, chat and unreadable
    bodies, and separators that never occur in the prompt, are malformed by
    construction. A generator's draw that is valid after all is dropped."""
    try:
        data = json.loads(body)
        blend = data["kv_transfer_params"]["blend"]
        prompt = data["prompt"]
    except (ValueError, RecursionError, KeyError, TypeError):
        return True
    if path != "/v1/completions" or isinstance(prompt, str):
        return True
    lengths = [len(prompt)] if prompt and isinstance(prompt[0], int) else [len(x) for x in prompt]
    try:
        return any(parse_blend_params(blend, n).separator is not None for n in lengths)
    except BlendParamsError:
        return True


def malformed_cases(rng: random.Random, model: str, prompts: list[Prompt], n: int) -> list[Case]:
    cases = []
    while len(cases) < n:
        gen = GENERATORS[len(cases) % len(GENERATORS)]
        path, body = gen(rng, model, rng.choice(prompts))
        if _surely_malformed(body, path):
            cases.append(Case(gen.__name__, path, body))
    return cases
