"""What vLLM's hybrid KV cache manager is worth on a sliding-window model, and
what the blend engine gives up by running without it.

vLLM turns its hybrid KV cache manager off when the KV connector does not
declare ``SupportsHMA``; the blend connector does not (docs/tuning.md says
why). Without it every layer keeps KV blocks for the whole prompt; with it a
windowed layer keeps only its window's. But vLLM sizes what a windowed layer
may hold per request as its window plus the tokens in flight (the prefill
budget, ``max_num_batched_tokens``), and the blend engine's budget is the
whole context. One run, one machine, the same KV cache memory for each:

- plain vLLM (no connector) with its own prefill budget (vLLM's default, or
  ``--prefill-budget``), with the hybrid
  manager (its default on a sliding-window model) and without it;
- plain vLLM with the hybrid manager and the blend engine's budget;
- the blend engine (which vLLM runs without the hybrid manager);

for each, the KV cache's capacity in tokens and the concurrency it allows at
``--max-model-len``, as vLLM computes them; the median time of a full prefill
of one prompt and the decode time per token after it; and the blend engine's
blend@0.15 of the same prompt, its chunks stored.

    python -m benchmarks hma [--model gemma3-270m|DIR] [--max-model-len 32768] [--kv-cache-gib 2]
                             [--prefill-budget N] [--chunks 8] [--chunk-tokens 512]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from blend_integrations.engines import load_engine
from blend_integrations.engines.vllm_contract import blend_engine_args
from blend_integrations.prompt import BlendPrompt, tokenize_prompt
from blend_integrations.store import ChunkStore

from . import bench_model, machine, scratch_dir, walk_attention, write_results
from .ttft import make_chunks

PREFIX = "You are a helpful assistant. Answer from the documents."
SUFFIX = "Question: which company was founded in the river city, and when? Answer:"


def capacity(llm) -> dict:
    """How vLLM runs ``llm``, and its KV cache's capacity in tokens and requests of max_model_len at once."""
    config = llm.llm_engine.vllm_config
    return {
        "hybrid_manager": config.scheduler_config.disable_hybrid_kv_cache_manager is False,
        "prefill_budget": int(config.scheduler_config.max_num_batched_tokens),
        "kv_tokens": int(config.cache_config.kv_cache_size_tokens),
        "max_concurrency": round(config.cache_config.kv_cache_max_concurrency, 2),
    }


DECODE = 32


def timed(generate, repeats: int) -> dict:
    """Median prefill (a one-token answer) and decode per token (up to ``DECODE``
    more) of ``generate(max_tokens)``, which returns how many tokens it generated."""
    generate(1)  # warm-up: the first call of an engine sets things up
    prefill = statistics.median(_seconds(generate, 1)[0] for _ in range(repeats))
    total, tokens = _seconds(generate, DECODE + 1)
    decode = round(1000 * (total - prefill) / (tokens - 1), 2) if tokens > 1 else None  # None: it stopped at once
    return {"prefill_s": round(prefill, 3), "decode_ms_per_token": decode}


def _seconds(generate, max_tokens: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    tokens = generate(max_tokens)
    return time.perf_counter() - t0, tokens


def run(args) -> dict:
    import torch
    import vllm
    from transformers import AutoConfig
    from vllm.inputs import TokensPrompt

    model_dir, label, suffix = bench_model(args.model)
    text_config = AutoConfig.from_pretrained(model_dir).get_text_config()
    if not getattr(text_config, "sliding_window", None):
        raise SystemExit(f"{model_dir} has no sliding-window layers: vLLM's hybrid KV cache manager changes nothing")
    # The same CPU reservation for every engine (see vllm_bench.py), and the same KV cache memory.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "2")
    engine = load_engine(
        model_dir,
        backend="vllm",
        store=ChunkStore(scratch_dir("blend-hma-bench-")),
        max_model_len=args.max_model_len,
        kv_cache_gib=args.kv_cache_gib,
        walk_attention=args.walk_attention,
    )
    chunks = make_chunks(engine.tokenizer, args.chunks, args.chunk_tokens)
    prompt = BlendPrompt(PREFIX, chunks, SUFFIX)
    ids = tokenize_prompt(prompt, engine.tokenizer, engine.config.separator).token_ids
    engine.warm(chunks)
    # the blend engine's own vLLM arguments without the connector and the loader that hands it the model
    blend_args = blend_engine_args(
        store=engine.store,
        config=engine.config,
        max_model_len=args.max_model_len,
        on_gpu=torch.cuda.is_available(),
        dtype=engine.dtype_name,
    )
    plain_args = {k: v for k, v in blend_args.items() if k not in ("kv_transfer_config", "load_format")}
    if not torch.cuda.is_available():  # the blend engine's KV cache memory (its kv_cache_gib)
        plain_args["kv_cache_memory_bytes"] = args.kv_cache_gib * 2**30
    own_budget = {k: v for k, v in plain_args.items() if k != "max_num_batched_tokens"}
    if args.prefill_budget:
        own_budget["max_num_batched_tokens"] = args.prefill_budget
    rows = {}
    for name, hybrid, plain_kwargs in (
        ("plain vLLM, its own prefill budget", True, own_budget),
        ("plain vLLM, its own prefill budget", False, own_budget),
        ("plain vLLM, the blend engine's prefill budget", True, plain_args),
    ):
        plain = vllm.LLM(model=model_dir, seed=0, disable_hybrid_kv_cache_manager=not hybrid, **plain_kwargs)

        def generate(max_tokens: int, plain=plain) -> int:
            params = vllm.SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0)
            out = plain.generate(TokensPrompt(prompt_token_ids=ids), params, use_tqdm=False)
            return len(out[0].outputs[0].token_ids)

        name += ", hybrid manager " + ("on" if hybrid else "off")
        rows[name] = {**capacity(plain), **timed(generate, args.repeats)}
        print(name, rows[name], flush=True)
        plain.llm_engine.engine_core.shutdown()
        del plain

    def full(max_tokens: int) -> int:
        return len(engine.generate(prompt, max_tokens=max_tokens, mode="full").token_ids)

    def blend(max_tokens: int) -> int:
        return len(engine.generate(prompt, max_tokens=max_tokens, recompute_ratio=0.15).token_ids)

    rows["blend engine, full prefill"] = {**capacity(engine.llm), **timed(full, args.repeats)}
    rows["blend engine, blend@0.15"] = {**capacity(engine.llm), **timed(blend, args.repeats)}
    for name in list(rows)[3:]:
        print(name, rows[name], flush=True)
    windows = getattr(text_config, "layer_types", None) or []
    return {
        "config": {
            "model": label,
            "machine": machine(engine),
            "dtype": engine.dtype_name,
            "attention": walk_attention(engine),
            "layers": int(text_config.num_hidden_layers),
            "windowed_layers": sum(t == "sliding_attention" for t in windows) if windows else None,
            "window": int(text_config.sliding_window),
            "max_model_len": args.max_model_len,
            "kv_cache_gib": args.kv_cache_gib,
            "prompt_tokens": len(ids),
            "chunks": f"{args.chunks} chunks of {args.chunk_tokens} tokens",
            "repeats": args.repeats,
            "decode_tokens": DECODE,
            "date": time.strftime("%Y-%m-%d"),
        },
        "rows": rows,
        "suffix": suffix,
    }


def render(report: dict) -> str:
    c, rows = report["config"], report["rows"]
    on, off, blend_budget, full, blend = rows.values()
    lines = [
        f"Model: {c['model']}; {c['windowed_layers']} of its {c['layers']} layers keep a {c['window']}-token "
        f"window; {c['dtype']}; {c['machine']}; vLLM attention {c['attention']}; {c['date']}.",
        f"Every engine with a {c['kv_cache_gib']} GiB KV cache and max_model_len {c['max_model_len']}; one prompt "
        f"of {c['prompt_tokens']} tokens ({c['chunks']}); prefill: median of {c['repeats']} after a warm-up; "
        f"decode: per token over {c['decode_tokens']} more.",
        "",
        "| engine | hybrid KV cache manager | prefill budget (tokens) | KV cache capacity (tokens) | "
        "concurrency at max_model_len | prefill | decode per token |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        decode = "-" if r["decode_ms_per_token"] is None else f"{r['decode_ms_per_token']:.1f} ms"
        lines.append(
            f"| {name} | {'on' if r['hybrid_manager'] else 'off'} | {r['prefill_budget']:,} | {r['kv_tokens']:,} | "
            f"{r['max_concurrency']:.2f}x | {r['prefill_s']:.3f} s | {decode} |"
        )
    lines += [
        "",
        f"- Memory: with its own prefill budget ({on['prefill_budget']:,} tokens), plain vLLM holds "
        f"{on['kv_tokens'] / off['kv_tokens']:.2f}x the tokens with the hybrid manager as without it. With the "
        f"blend engine's budget ({blend_budget['prefill_budget']:,}), the hybrid manager holds "
        f"{blend_budget['kv_tokens'] / off['kv_tokens']:.2f}x: vLLM sizes a windowed layer's share of a request "
        f"as its window plus the budget. The blend engine holds {full['kv_tokens'] / on['kv_tokens']:.2f}x "
        "what plain vLLM holds with the hybrid manager and its own budget.",
        f"- Compute: plain vLLM's prefill without the hybrid manager takes {off['prefill_s'] / on['prefill_s']:.2f}x "
        f"its time with it, with the blend engine's budget {blend_budget['prefill_s'] / on['prefill_s']:.2f}x; the "
        f"blend engine's full prefill {full['prefill_s'] / on['prefill_s']:.2f}x, its blend@0.15 "
        f"{blend['prefill_s'] / on['prefill_s']:.2f}x.",
    ]
    if on["decode_ms_per_token"] and off["decode_ms_per_token"]:
        lines[-1] += (
            f" Decode per token without the hybrid manager: "
            f"{off['decode_ms_per_token'] / on['decode_ms_per_token']:.2f}x with it."
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks hma", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m", help="gemma3-270m (the default) or a checkpoint directory")
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--kv-cache-gib", type=int, default=2)
    parser.add_argument(
        "--prefill-budget", type=int, help="plain vLLM's own max_num_batched_tokens (default: vLLM's default)"
    )
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--walk-attention", default="auto", choices=("auto", "kernel", "sdpa"))
    parser.add_argument("--out", default="docs/results", help="directory for the results ('' to skip)")
    args = parser.parse_args(argv)
    report = run(args)
    text = render(report)
    print(text)
    if args.out:
        write_results(
            args.out,
            "hma" + report.pop("suffix"),
            "Sliding windows on vLLM: the hybrid KV cache manager, with and without the blend connector",
            text,
            report,
            command=f"`python -m benchmarks hma {' '.join(argv or [])}`".replace(" `", "`"),
        )
