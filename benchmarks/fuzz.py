"""Fuzz a blend server with malformed blend parameters: ``python -m benchmarks fuzz``.

Malformed request bodies are drawn from a seeded generator (wrong types,
missing fields, NaN and infinities, negative, reversed, empty, overlapping
and out-of-range spans, huge span lists, deeply nested JSON, non-ASCII
separators, ``num_tokens`` at and past the prompt's end, one-token prompts,
batches, chat requests) and sent concurrently with good requests. The server
must never die; every malformed request must get a 4xx with a reason, or,
where the body is valid for vLLM but the rule needs the prompt's tokens that
only the server has (text and chat prompts), an answer whose
``kv_transfer_params.blend_fallback`` says why it was not blended; every good
request must return the same tokens as before the fuzzing began.

Without ``--url`` it starts a server on a small local model itself.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from blend_integrations.engines.vllm_contract import MAX_CHUNKS, BlendParamsError, parse_blend_params
from tests.fixtures.local_models import sample_text

from . import write_results


@dataclass(frozen=True)
class Case:
    kind: str  # what is wrong with it (a generator's name), or "good"
    path: str
    body: bytes
    good: int | None = None  # for good requests: the index of their baseline


class Http:
    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 300) -> None:
        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.headers = {"Content-Type": "application/json"} | (
            {"Authorization": f"Bearer {api_key}"} if api_key else {}
        )

    def send(self, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        """(status, body); status 0 when no answer came."""
        req = urllib.request.Request(
            self.url + path, data=body, headers=self.headers, method="POST" if body is not None else "GET"
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
        except OSError as exc:
            return 0, repr(exc).encode()

    def json(self, path: str, body: dict | None = None) -> dict:
        status, raw = self.send(path, json.dumps(body).encode() if body is not None else None)
        if status != 200:
            raise RuntimeError(f"{path} answered {status}: {raw[:300]!r}")
        return json.loads(raw)


@dataclass
class Prompt:
    ids: list[int]
    spans: list[list[int]]
    text: str  # the same documents as text, for text-prompt cases


def make_prompts(http: Http, model: str, seed: int, count: int = 3) -> list[Prompt]:
    """Prompts laid out as the engines lay them out (prefix, separator, chunk,
    ..., separator, suffix; each piece tokenized alone by the server)."""

    def ids(text: str, special: bool = False) -> list[int]:
        return http.json("/tokenize", {"model": model, "prompt": text, "add_special_tokens": special})["tokens"]

    sep = ids("\n\n")
    prompts = []
    for p in range(count):
        docs = [" ".join(sample_text(3, seed=seed * 100 + p * 10 + i)) for i in range(3)]
        tokens, spans = ids("You answer from the documents.", special=True), []
        for doc in docs:
            tokens += sep
            spans.append([len(tokens), len(tokens) + len(ids(doc))])
            tokens += ids(doc)
        tokens += sep + ids("Question: which city is named? Answer:")
        prompts.append(
            Prompt(tokens, spans, "\n\n".join(["You answer from the documents.", *docs, "Question: Answer:"]))
        )
    return prompts


def _completion(model: str, prompt, blend=None, *, kv=None, max_tokens: int = 2) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    if kv is not None or blend is not None:
        body["kv_transfer_params"] = kv if kv is not None else {"blend": blend}
    return body


def _dumps(body) -> bytes:
    return json.dumps(body).encode()  # NaN and Infinity as JavaScript writes them, which vLLM's parser reads


# -- the generators: each returns (path, body) of one malformed request ------------------

WRONG_VALUES = ["x", "", 1.5, True, False, {}, [], [[]], {"a": 1}, 10**30, -7, "1", [1, 2, 3], "blend"]


def _good_blend(p: Prompt) -> dict:
    return {"mode": "blend", "ratio": 0.5, "chunk_spans": [list(s) for s in p.spans], "num_tokens": p.spans[-1][1]}


def wrong_type(rng, model, p):
    blend = _good_blend(p)
    name = rng.choice(["mode", "ratio", "chunk_spans", "num_tokens"])
    blend[name] = rng.choice(WRONG_VALUES)  # a value that happens to be valid is dropped (_surely_malformed)
    return "/v1/completions", _dumps(_completion(model, p.ids, blend))


def missing_field(rng, model, p):
    blend = _good_blend(p)
    for name in rng.choice([["mode"], ["chunk_spans"], ["chunk_spans", "num_tokens"], list(blend)]):
        blend.pop(name)
    return "/v1/completions", _dumps(_completion(model, p.ids, blend))


def non_finite(rng, model, p):
    blend = _good_blend(p)
    value = rng.choice([float("nan"), float("inf"), float("-inf")])
    where = rng.choice(["ratio", "num_tokens", "span"])
    if where == "span":
        blend["chunk_spans"][rng.randrange(len(p.spans))][rng.randrange(2)] = value
    else:
        blend[where] = value
    return "/v1/completions", _dumps(_completion(model, p.ids, blend))


def bad_span(rng, model, p):
    blend = _good_blend(p)
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
    return "/v1/completions", _dumps(_completion(model, p.ids, blend))


def huge_span_list(rng, model, p):
    n = rng.choice([MAX_CHUNKS + 1, 5000, 50000])
    prompt = [p.ids[0]] * (n + 1)  # one token per span, and one more for vLLM
    blend = {"mode": "blend", "chunk_spans": [[i, i + 1] for i in range(n)], "num_tokens": n}
    return "/v1/completions", _dumps(_completion(model, prompt, blend))


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
            head + f'"kv_transfer_params": {{"blend": {json.dumps(_good_blend(p))}, "x": {nested}}}}}'
        ).encode()
    return "/v1/completions", (
        head + f'"kv_transfer_params": {{"blend": {{"mode": "blend"}}}}, "extra": {nested}}}'
    ).encode()


NON_ASCII = ["\u00a7\u00a7", "\u2603", "\U0001f642", "\u200b", "\ufeff", "\u00e9t\u00e9", "\u0000", "\u4e2d\u6587"]


def odd_separator(rng, model, p):
    how = rng.choice(["non_ascii_text", "non_ascii_ids", "with_spans", "empty", "too_long", "not_text"])
    if how == "non_ascii_text":  # valid for vLLM and for the rules: no chunk between separators, not blended
        return "/v1/completions", _dumps(
            _completion(model, p.text, {"mode": "blend", "separator": rng.choice(NON_ASCII)})
        )
    if how == "non_ascii_ids":
        return "/v1/completions", _dumps(
            _completion(model, p.ids, {"mode": "reuse", "separator": rng.choice(NON_ASCII)})
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
    return "/v1/completions", _dumps(_completion(model, p.ids, blend))


def num_tokens_at_end(rng, model, p):
    blend = _good_blend(p)
    blend["num_tokens"] = len(p.ids) + rng.choice([0, 0, 1, 10**9])
    return "/v1/completions", _dumps(_completion(model, p.ids, blend))


def one_token_prompt(rng, model, p):
    blend = rng.choice(
        [
            {"mode": "blend", "chunk_spans": [[0, 1]]},
            {"mode": "blend", "chunk_spans": [[0, 1]], "num_tokens": 1},
            {"mode": "reuse", "chunk_spans": [[0, 1]], "num_tokens": 0},
        ]
    )
    return "/v1/completions", _dumps(_completion(model, [p.ids[0]], blend))


def not_an_object(rng, model, p):
    kv = rng.choice(
        [
            {"blend": None},
            {"blend": "blend"},
            {"blend": [_good_blend(p)]},
            {"blend": 3},
            {"blend": {**_good_blend(p), "ratios": 0.2}},
            {"blend": {**_good_blend(p), "mode": "BLEND"}},
            {"blend": {**_good_blend(p), "mode": "full "}},
            "blend",
            [1, 2],
        ]
    )
    return "/v1/completions", _dumps(_completion(model, p.ids, kv=kv))


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
        return "/v1/completions", _dumps(_completion(model, p.text, blend))
    body = {
        "model": model,
        "messages": [{"role": "user", "content": p.text}],
        "max_tokens": 2,
        "temperature": 0,
        "kv_transfer_params": {"blend": blend},
    }
    return "/v1/chat/completions", _dumps(body)


def batch_prompts(rng, model, p):
    blend = _good_blend(p)
    return "/v1/completions", _dumps(_completion(model, [p.ids, p.ids[: p.spans[-1][1]]], blend))


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


def _outcome(status: int, raw: bytes) -> tuple[str, str]:
    """("rejected" | "fallback" | "violation", the reason or what went wrong)."""
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    if 400 <= status < 500 and isinstance(data, dict):
        error = data.get("error", data.get("detail"))
        reason = error.get("message") if isinstance(error, dict) else error
        if reason:
            return "rejected", str(reason)[:200]
    if status == 200 and isinstance(data, dict):
        fallback = (data.get("kv_transfer_params") or {}).get("blend_fallback")
        if fallback:
            return "fallback", fallback[:200]
    return "violation", f"HTTP {status}: {raw[:200]!r}"


def _tokens(status: int, raw: bytes) -> list[int] | None:
    return json.loads(raw)["choices"][0]["token_ids"] if status == 200 else None


def run(
    url: str, *, cases: int = 240, seed: int = 0, api_key: str | None = None, workers: int = 4, good_every: int = 4
) -> dict:
    http = Http(url, api_key)
    started = time.perf_counter()
    model = http.json("/v1/models")["data"][0]["id"]
    rng = random.Random(seed)
    prompts = make_prompts(http, model, seed)
    good_bodies = [
        _completion(model, p.ids, {**_good_blend(p), "ratio": r}, max_tokens=6) for p in prompts for r in (1.0, None)
    ]
    full = [
        http.json("/v1/completions", _completion(model, p.ids, max_tokens=6))["choices"][0]["token_ids"]
        for p in prompts
    ]
    for body in good_bodies:  # the first pass stores the chunks: every later one hits
        http.json("/v1/completions", body)
    baseline = [http.json("/v1/completions", body)["choices"][0]["token_ids"] for body in good_bodies]
    exact = [baseline[2 * i] == full[i] for i in range(len(prompts))]  # ratio 1.0 equals full prefill

    bad = malformed_cases(rng, model, prompts, cases)
    schedule: list[Case] = []
    for i, case in enumerate(bad):
        schedule.append(case)
        if i % good_every == 0:
            k = (i // good_every) % len(good_bodies)
            schedule.append(Case("good", "/v1/completions", _dumps(good_bodies[k]), good=k))
    with ThreadPoolExecutor(workers) as pool:
        answers = list(pool.map(lambda c: http.send(c.path, c.body), schedule))

    outcomes: dict[str, Counter] = defaultdict(Counter)
    violations, reasons = [], Counter()
    good_ok = good_total = 0
    for case, (status, raw) in zip(schedule, answers):
        if case.good is not None:
            good_total += 1
            good_ok += _tokens(status, raw) == baseline[case.good]
            continue
        outcome, why = _outcome(status, raw)
        outcomes[case.kind][outcome] += 1
        if outcome == "violation":
            violations.append({"kind": case.kind, "body": case.body[:300].decode(errors="replace"), "answer": why})
        else:
            reasons[re.sub(r"(?<!token )\d+", "N", why)[:100]] += 1  # grouped: numbers differ from case to case
    after = [_tokens(*http.send("/v1/completions", _dumps(body))) for body in good_bodies]
    status, _ = http.send("/health")
    return {
        "malformed": len(bad),
        "good": good_total,
        "good_same_tokens": good_ok,
        "good_after_same_tokens": sum(a == b for a, b in zip(after, baseline)),
        "good_requests": len(good_bodies),
        "ratio_one_equals_full": all(exact),
        "healthy_after": status == 200,
        "outcomes": {kind: dict(c) for kind, c in sorted(outcomes.items())},
        "totals": dict(sum(outcomes.values(), Counter())),
        "violations": violations[:20],
        "top_reasons": reasons.most_common(12),
        "seconds": round(time.perf_counter() - started, 1),
        "seed": seed,
        "workers": workers,
    }


def render(report: dict) -> str:
    kinds = report["outcomes"]
    lines = [
        f"{report['malformed']} malformed requests (seed {report['seed']}) sent by {report['workers']} threads at once "
        f"with {report['good']} good ones, in {report['seconds']} s.",
        "",
        "| what is wrong | rejected (4xx with a reason) | answered in full, reason given | violations |",
        "|---|---:|---:|---:|",
    ]
    for kind, c in kinds.items():
        lines.append(f"| {kind} | {c.get('rejected', 0)} | {c.get('fallback', 0)} | {c.get('violation', 0)} |")
    t = report["totals"]
    lines += [
        f"| **all** | **{t.get('rejected', 0)}** | **{t.get('fallback', 0)}** | **{t.get('violation', 0)}** |",
        "",
        f"- Good requests during the fuzzing with the same tokens as before it: {report['good_same_tokens']} of {report['good']}; "
        f"after it: {report['good_after_same_tokens']} of {report['good_requests']}.",
        f"- Blend at ratio 1.0 gave the tokens of full prefill before the fuzzing: {report['ratio_one_equals_full']}.",
        f"- The server answered `GET /health` with 200 afterwards: {report['healthy_after']}.",
        "",
        "Most common reasons given:",
        "",
    ]
    lines += [f"- {n} x `{why}`" for why, n in report["top_reasons"]]
    return "\n".join(lines)


def passed(report: dict) -> bool:
    return (
        not report["violations"]
        and report["healthy_after"]
        and report["ratio_one_equals_full"]
        and report["good_same_tokens"] == report["good"]
        and report["good_after_same_tokens"] == report["good_requests"]
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks fuzz", description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running blend server (default: start one on a small local model)")
    p.add_argument("--api-key", help="the server's key, if it has one")
    p.add_argument("--cases", type=int, default=240)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="docs/results")
    args = p.parse_args(argv)
    if args.url:
        report = run(args.url, cases=args.cases, seed=args.seed, api_key=args.api_key)
        server = args.url
    else:
        from tests.fixtures.blend_server import BlendServer
        from tests.fixtures.local_models import cached_model_dir

        model = cached_model_dir(num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2)
        work = Path(tempfile.mkdtemp(prefix="blend-fuzz-"))
        with BlendServer(
            model,
            store=work / "store",
            log=work / "server.log",
            args=["--max-model-len", "2048", "--kv-cache-gib", "1"],
        ) as server_proc:
            report = run(server_proc.url, cases=args.cases, seed=args.seed)
        import os

        import vllm

        server = (
            f"a server it started on a 4-layer random-weight Llama (hidden 128, float32), vLLM {vllm.__version__} "
            f"CPU build, {os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d')}"
        )
    text = render(report)
    print(text)
    if args.out:
        write_results(
            args.out,
            "fuzz",
            "Server fuzzing: malformed blend parameters",
            f"Server: {server}.\n\n{text}",
            report,
            command="`python -m benchmarks fuzz` (`test_fuzzing_never_takes_the_server_down` "
            "in `tests/integration/test_server.py` runs the same on the test server, behind its API key).",
        )
    if not passed(report):
        raise SystemExit("the server failed the fuzzing: see the violations above")
