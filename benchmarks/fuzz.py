"""Fuzz a blend server with malformed blend parameters: ``python -m benchmarks fuzz``.

Malformed request bodies are drawn from seeded generators (``fuzz_cases``:
wrong types, missing fields, NaN and infinities, negative, reversed, empty,
overlapping and out-of-range spans, huge span lists, deeply nested JSON,
non-ASCII separators, ``num_tokens`` at and past the prompt's end, one-token
prompts, batches, chat requests) and sent concurrently with good requests.
The server must never die; every malformed request must get a 4xx with a
reason, or, where the body is valid for vLLM but the rule needs the prompt's
tokens that only the server has (text and chat prompts), an answer whose
``kv_transfer_params.blend_fallback`` says why it was not blended; every
good request must return the same tokens as before the fuzzing began.

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
from pathlib import Path

from tests.fixtures.local_models import sample_text

from . import write_results
from .fuzz_cases import Case, Prompt, completion, encode, good_blend, malformed_cases


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
        completion(model, p.ids, {**good_blend(p), "ratio": r}, max_tokens=6) for p in prompts for r in (1.0, None)
    ]
    full = [
        http.json("/v1/completions", completion(model, p.ids, max_tokens=6))["choices"][0]["token_ids"] for p in prompts
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
            schedule.append(Case("good", "/v1/completions", encode(good_bodies[k]), good=k))
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
    after = [_tokens(*http.send("/v1/completions", encode(body))) for body in good_bodies]
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
