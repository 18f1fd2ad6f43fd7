"""vLLM: time to first token and throughput, blend against what users have today.

One run, one machine, the 16-layer model of the TTFT benchmark (or
``--model smollm2``, the real SmolLM2-135M-Instruct):

- TTFT of one request (6 chunks x 512 tokens, a new order every time): full
  prefill (prefix caching off), reuse, blend at r = 0.15 on the embedded blend
  engine, and a plain vLLM with its own prefix caching on the same reordered
  workload (after the corpus was seen once), in the same rounds; with each
  mode's compute ceiling (DESIGN section 5) and the share of it measured;
- throughput: N concurrent requests, each 6 chunks drawn from a 30-document
  corpus, full vs blend, requests per second.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

from blend_integrations.engines import load_engine
from blend_integrations.engines.vllm_contract import WALK_ATTENTION
from blend_integrations.prompt import BlendPrompt, tokenize_prompt
from blend_integrations.store import ChunkStore

from . import MODEL_HELP, bench_model, compute_ceiling, machine, walk_attention, write_results
from .ttft import make_chunks

PREFIX = "You are a helpful assistant. Answer from the documents."
SUFFIX = "Question: which company was founded in the river city, and when? Answer:"


def run(args) -> dict:
    model_dir, label, suffix = bench_model(args.model, layers=args.layers)
    rng = random.Random(0)
    max_len = 4096
    engine = load_engine(
        model_dir,
        backend="vllm",
        store=ChunkStore(tempfile.mkdtemp(prefix="blend-vllm-bench-")),
        max_model_len=max_len,
        kv_cache_gib=args.kv_cache_gib,
        max_num_seqs=max(64, args.requests),
        walk_attention=args.walk_attention,
    )
    attention = walk_attention(engine)
    measured_on = machine(engine)  # while its workers run
    corpus = make_chunks(engine.tokenizer, args.corpus, args.chunk_tokens)
    engine.warm(corpus, progress=True)

    def prompt():
        return BlendPrompt(PREFIX, rng.sample(corpus, args.chunks), SUFFIX)

    # What users have today, in the same process and the same rounds: plain
    # vLLM with its own prefix caching, no connector, the corpus seen once.
    import vllm
    from vllm.inputs import TokensPrompt

    # vLLM's CPU backend reserves CPUs for its engine-core process: one per
    # rank, one more per rank when a KV connector is set (ompmultiprocessing.py).
    # On 2 CPUs that left plain vLLM one core where the blend engine (whose
    # reservation covers every CPU, so vLLM uses them all) got two: the same
    # reservation for both keeps the comparison fair on any CPU count.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "2")
    plain = vllm.LLM(
        model=model_dir,
        dtype=engine.dtype_name,
        max_model_len=max_len,
        enable_prefix_caching=True,
        enforce_eager=True,
        block_size=32,
        max_num_batched_tokens=max_len,
        kv_cache_memory_bytes=args.kv_cache_gib * 2**30,  # the blend engine's (CPU)
        seed=0,
    )
    one_token = vllm.SamplingParams(max_tokens=1, temperature=0)

    def prefix_cached_ttft(p: BlendPrompt) -> float:
        ids = tokenize_prompt(p, engine.tokenizer, engine.config.separator).token_ids
        t0 = time.perf_counter()
        plain.generate([TokensPrompt(prompt_token_ids=ids)], one_token, use_tqdm=False)
        return time.perf_counter() - t0

    for doc in corpus:
        prefix_cached_ttft(BlendPrompt(PREFIX, [doc], SUFFIX))

    # TTFT: modes take turns every round; the machine's speed drifts over
    # minutes (seen here: the same prefill at 3 s, then 6-9 s twenty minutes later).
    # (name, mode, ratio, selection); query-aware selection beside HKVD: the cost of its scoring pass
    cases = [
        ("full", "full", None, None),
        ("reuse", "reuse", None, None),
        ("blend@0.15", "blend", 0.15, None),
        ("blend@0.15 query", "blend", 0.15, "query"),
    ]
    ttft: dict[str, list[float]] = {name: [] for name, *_ in cases} | {"vLLM prefix caching": []}
    usage = {}
    for round_ in range(args.repeats + 1):
        for name, mode, ratio, selection in cases:
            g = engine.generate(prompt(), max_tokens=1, mode=mode, recompute_ratio=ratio, selection=selection)
            if round_:
                ttft[name].append(g.ttft_s)
                usage[name] = g.usage
        t = prefix_cached_ttft(prompt())
        if round_:
            ttft["vLLM prefix caching"].append(t)
    plain.llm_engine.engine_core.shutdown()

    # Throughput: every request of a pass submitted at once, vLLM batches them;
    # passes alternate between full and blend.
    throughput = {name: {"requests": 0, "seconds": 0.0, "output_tokens": 0} for name in ("full", "blend@0.15")}
    engine.generate_many([prompt() for _ in range(2)], max_tokens=args.output_tokens)  # warm-up
    for _ in range(2):
        for name, mode in (("full", "full"), ("blend@0.15", "blend")):
            prompts = [prompt() for _ in range(args.requests)]
            t0 = time.perf_counter()
            gens = engine.generate_many(prompts, max_tokens=args.output_tokens, mode=mode)
            row = throughput[name]
            row["seconds"] += time.perf_counter() - t0
            row["requests"] += len(gens)
            row["output_tokens"] += sum(len(g.token_ids) for g in gens)
    for row in throughput.values():
        row["requests_per_s"] = row["requests"] / row["seconds"]
    prompt_tokens = usage["full"].prompt_tokens
    engine.close()

    full, reuse = statistics.median(ttft["full"]), statistics.median(ttft["reuse"])
    from transformers import AutoConfig

    layers, check_layer = AutoConfig.from_pretrained(model_dir).num_hidden_layers, engine.config.check_layers[0]

    def ceiling(name: str) -> dict:
        if name not in usage:
            return {}
        u = usage[name]
        mode, selection = next((mode, selection) for n, mode, _, selection in cases if n == name)
        best = compute_ceiling(mode, u, layers, check_layer, selection or "deviation")
        # What the engine's own full and reuse times predict: reuse, plus the
        # computed share (1 / ceiling) of what full prefill adds to it.
        predicted = reuse + (full - reuse) / best
        return {
            "cached_tokens": u.cached_tokens,
            "recomputed_tokens": u.recomputed_tokens,
            "ceiling": best,
            "of_ceiling": full / statistics.median(ttft[name]) / best,
            "predicted_ms": 1000 * predicted,
            "of_predicted": statistics.median(ttft[name]) / predicted,
        }

    return {
        "config": {
            "model": label,
            "machine": measured_on,
            "dtype": engine.dtype_name,
            "attention": attention,
            "results": "vllm" + suffix + ("" if args.walk_attention == "auto" else f"-{args.walk_attention}"),
            "vllm": vllm.__version__,
            "prompt_tokens": prompt_tokens,
            "chunks": f"{args.chunks} x {args.chunk_tokens} tokens from a corpus of {args.corpus}",
            "repeats": args.repeats,
            "requests": args.requests,
            "output_tokens": args.output_tokens,
            "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d"),
        },
        "ttft": {
            name: {
                "median_ms": 1000 * statistics.median(v),
                "min_ms": 1000 * min(v),
                "speedup": full / statistics.median(v),
                **ceiling(name),
            }
            for name, v in ttft.items()
        },
        "throughput": throughput,
    }


def render(report: dict) -> str:
    c = report["config"]
    lines = [
        f"Model: {c['model']}; {c['dtype']}; vLLM {c['vllm']}, attention {c['attention']}; {c['machine']}; "
        f"{c['chunks']}, {c['prompt_tokens']} prompt tokens; {c['date']}.",
        "",
        f"Time to first token (median of {c['repeats']}, modes taking turns):",
        "",
        "| mode | TTFT median (ms) | TTFT min (ms) | full / mode | compute ceiling | share of ceiling "
        "| predicted (ms) | mode / predicted |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in report["ttft"].items():
        best = f"{r['ceiling']:.2f}x | {100 * r['of_ceiling']:.0f}%" if "ceiling" in r else "- | -"
        predicted = (
            f"{r['predicted_ms']:.0f} | {r['of_predicted']:.2f}x"
            if name.startswith("blend") and "ceiling" in r
            else "- | -"
        )
        lines.append(
            f"| {name} | {r['median_ms']:.0f} | {r['min_ms']:.0f} | {r['speedup']:.2f}x | {best} | {predicted} |"
        )
    t = report["throughput"]
    lines += [
        "",
        "predicted = reuse + (full - reuse) / compute ceiling: the time the engine's own full prefill and reuse "
        "predict for the tokens a blend computes (1 / ceiling is the share of token-layers computed).",
    ]
    lines += [
        "",
        f"Throughput: passes of {c['requests']} requests submitted at once, {c['output_tokens']} output tokens each, "
        "two passes per mode, alternating:",
        "",
        "| mode | seconds | requests/s |",
        "|---|---:|---:|",
    ]
    for name, r in t.items():
        lines.append(f"| {name} | {r['seconds']:.1f} | {r['requests_per_s']:.2f} |")
    lines.append(f"\nblend / full throughput: {t['blend@0.15']['requests_per_s'] / t['full']['requests_per_s']:.2f}x")
    cached = report["ttft"]["vLLM prefix caching"]["speedup"]
    lines.append(
        "\nPrefix caching reuses only an exact prefix: with the documents in a new order it can match the "
        "system prompt and, when that document came first before, the first document; everything after is "
        f"computed again. On this CPU build its TTFT was {1 / cached:.2f}x full prefill's without caching (the "
        "prefill then runs with a cached context); that is a measurement of this machine, not a claim about GPUs."
    )
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks vllm", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--chunks", type=int, default=6)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--corpus", type=int, default=30)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kv-cache-gib", type=int, default=4)
    p.add_argument("--walk-attention", choices=WALK_ATTENTION, default="auto", help="how the blend pass attends")
    p.add_argument("--out", default="docs/results")
    args = p.parse_args(argv)
    report = run(args)
    text = render(report)
    print(text)
    if args.out:
        model = f" --model {args.model}" if args.model else ""
        model += "" if args.walk_attention == "auto" else f" --walk-attention {args.walk_attention}"
        write_results(
            args.out,
            report["config"]["results"],
            "vLLM engine: TTFT and throughput",
            text,
            report,
            command=f"`python -m benchmarks vllm{model}`" + ("." if model else " (`make bench` runs it)."),
        )
