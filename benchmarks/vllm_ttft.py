"""vLLM at long prompts: time to first token of full prefill, reuse and blend, and blend's predicted time.

    python -m benchmarks.vllm_ttft [--shape llama3-8b] [--dtype bfloat16]
                                   [--tokens 4096 16384 32768] [--ratio 0.15] [--repeats 3] [--out DIR]

One embedded vLLM engine for every prompt size (its max_model_len the
longest prompt's), a random-weight model of the given shape, chunks of
``--chunk-tokens`` warmed in the store's memory tier first; a prompt of
``tokens / chunk_tokens`` chunks in a new order each round, the modes taking
turns within each round. ``predicted = reuse + (full - reuse) / compute
ceiling``: what the engine's own full prefill and reuse predict for the
tokens blend computes (as ``python -m benchmarks vllm`` reports it).

The offline kit's GPU run (benchmarks/gpu_kit.py) runs it at Llama-3-8B's
shape in bfloat16. ``python -m benchmarks vllm`` times a fixed 3k-token
prompt beside a second, plain vLLM, which one GPU cannot hold beside an 8B
engine (each asks for 90% of its memory); this times one engine alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator

from blend_integrations.engines import load_engine
from blend_integrations.store import ChunkStore

from . import (
    MODEL_HELP,
    add_model_arguments,
    bench_model,
    compute_ceiling,
    machine,
    model_options,
    scratch_dir,
    shuffled_prompts,
    time_cases,
    walk_attention,
    write_results,
)
from .ttft import make_chunks


def run(args) -> Iterator[dict]:
    """One report per prompt size, each as soon as it is measured."""
    sizes = sorted({max(1, t // args.chunk_tokens) for t in args.tokens})
    longest = sizes[-1] * args.chunk_tokens + 256  # the chunks, system text and question
    context = max(8192, 2 ** longest.bit_length())
    model_dir, label, suffix = bench_model(args.model, **model_options(args), context=context)
    import torch

    if torch.cuda.is_available():  # a model just drawn on the GPU: its memory back for vLLM's workers
        torch.cuda.empty_cache()
    store = ChunkStore(scratch_dir("blend-vllm-ttft-"), memory_limit_bytes=2**40, size_limit_bytes=2**40)
    engine = load_engine(
        model_dir,
        backend="vllm",
        store=store,
        dtype=args.dtype,
        device=args.device,
        max_model_len=longest,
        kv_cache_gib=args.kv_cache_gib,
    )
    import vllm

    config = {
        "model": label,
        "results": "vllm-ttft" + suffix,
        "dtype": engine.dtype_name,
        "vllm": vllm.__version__,
        "attention": walk_attention(engine),
        "machine": machine(engine),
        "repeats": args.repeats,
        "date": time.strftime("%Y-%m-%d"),
    }
    chunks = make_chunks(engine.tokenizer, sizes[-1], args.chunk_tokens)
    engine.warm(chunks, progress=True)
    layers, check_layer = engine.num_layers, engine.config.check_layers[0]
    cases = [("full", "full", None), ("reuse", "reuse", None), (f"blend@{args.ratio:.2f}", "blend", args.ratio)]
    try:
        for n in sizes:
            prompt = shuffled_prompts(chunks[:n])
            times, usage, apart = time_cases(engine, prompt, cases, args.repeats)
            full, reuse = statistics.median(times["full"]), statistics.median(times["reuse"])
            rows = {}
            for name, mode, _ in cases:
                u, t = usage[name], statistics.median(times[name])
                ceiling = compute_ceiling(mode, u, layers, check_layer)
                rows[name] = {
                    "median_ms": 1000 * t,
                    "min_ms": 1000 * min(times[name]),
                    "max_ms": 1000 * max(times[name]),
                    "speedup": full / t,
                    "cached_tokens": u.cached_tokens,
                    "recomputed_tokens": u.recomputed_tokens,
                    "chunks_hit": u.chunks_hit,
                    "chunks_computed": u.chunks_computed,
                    "ceiling": ceiling,
                    "not_blended": apart[name],  # rounds that fell back or ran in full: not timed
                }
                if mode == "blend":
                    predicted = reuse + (full - reuse) / ceiling
                    rows[name] |= {"predicted_ms": 1000 * predicted, "of_predicted": t / predicted}
            prompt_tokens = usage["full"].prompt_tokens
            yield {"config": config | {"prompt_tokens": prompt_tokens, "chunks": f"{n} x {args.chunk_tokens}"}, **rows}
    finally:
        engine.close()


def render(reports: list[dict]) -> str:
    c = reports[0]["config"]
    lines = [
        f"Model: {c['model']}; {c['dtype']}; vLLM {c['vllm']}, attention {c['attention']}; {c['machine']}; "
        f"median of {c['repeats']} rounds, modes taking turns; {c['date']}.",
        "",
        "| prompt tokens | mode | TTFT median (ms) | min-max (ms) | full / mode | cached | recomputed "
        "| compute ceiling | predicted (ms) | mode / predicted |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in reports:
        for name, row in r.items():
            if name == "config":
                continue
            predicted = f"{row['predicted_ms']:.0f} | {row['of_predicted']:.2f}x" if "predicted_ms" in row else "- | -"
            apart = row.get("not_blended", 0)
            name = f"{name} ({apart} rounds fell back, not timed)" if apart else name
            lines.append(
                f"| {r['config']['prompt_tokens']} | {name} | {row['median_ms']:.0f} | {row['min_ms']:.0f}-"
                f"{row['max_ms']:.0f} | {row['speedup']:.2f}x | {row['cached_tokens']} | {row['recomputed_tokens']} "
                f"| {row['ceiling']:.2f}x | {predicted} |"
            )
    lines.append(
        "\npredicted = reuse + (full - reuse) / compute ceiling: the time this engine's own full prefill and "
        "reuse predict for the tokens a blend computes (1 / ceiling is the share of token-layers computed)."
    )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vllm_ttft", description=__doc__.splitlines()[0])
    add_model_arguments(p, repeats=3)
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768], help="prompt sizes, in tokens")
    p.add_argument("--ratio", type=float, default=0.15, help="blend's recompute ratio")
    p.add_argument("--kv-cache-gib", type=int, default=4, help="vLLM's KV cache on a CPU (a GPU sizes its own)")
    p.add_argument("--out", default="docs/results", help="directory for vllm-ttft[-shape].json/.md ('' to skip)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    reports = []
    command = " ".join(["python -m benchmarks.vllm_ttft", *(argv if argv is not None else sys.argv[1:])])
    for report in run(args):
        reports.append(report)
        text = render(reports)
        print(text + "\n", flush=True)
        if args.out:  # after each size: a run cut short keeps what it measured
            title = "vLLM engine at long prompts: full prefill, reuse and blend"
            write_results(
                args.out, report["config"]["results"], title, text, {"runs": reports}, command=f"`{command}`."
            )


if __name__ == "__main__":
    main()
