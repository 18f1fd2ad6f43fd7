"""Does the live check's walk give vLLM's own full prefill's first tokens?

    python -m benchmarks check-walk [--models qwen2.5-coder-0.5b ...] [--dtypes float32 bfloat16]
                                    [--prompts 40] [--tokens 4]

On the embedded vLLM engine a live check does not send a request: it walks the workers' model on a
KV cache of its own (``VllmEngine.full_prefill_tokens``, ``engines.vllm_check``), and its verdict is
whether the blend's first tokens are that walk's. In float32 the walk's tokens are vLLM's full
prefill's (tested); in bfloat16 the walk and vLLM's attention kernels round differently, so a near
tie between two tokens can go either way, and a check would count a blend that kept full prefill's
answer as one that lost it. This counts how often, per model and dtype: each prompt of the model's
generated task (on a seed of its own) is answered by vLLM's full prefill and walked, and the first
``--tokens`` tokens compared. The live check's confidence rule allows 3 misses in a window of 100
(docs/calibration.md#the-live-check): a walk that differs more often than that would step a policy
that holds.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tqdm.auto import tqdm

from blend_integrations.calibration import wilson_lower
from blend_integrations.engines import load_engine
from blend_integrations.store import ChunkStore

from . import UNCHECKED, machine, scratch_dir, write_results
from .quality import model_and_task

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
SEED = 78_100  # a seed no other run uses
CONFIDENCE = 0.8


def compare(model: str, dtype: str, prompts: int, tokens: int) -> dict:
    """vLLM's full prefill and the walk on ``prompts`` of ``model``'s generated task, in ``dtype``."""
    model_dir, task, label = model_and_task(model)
    store = ChunkStore(scratch_dir("blend-check-walk-store-"), remote="")
    with load_engine(str(model_dir), store=store, backend="vllm", dtype=dtype, config=UNCHECKED) as engine:
        rows = []
        for e in tqdm(task.examples(prompts, SEED, None), desc=f"{model}, {dtype}", unit="prompt"):
            prompt = task.prompt(e, engine.tokenizer, engine.config.separator)
            full = engine.generate(prompt, max_tokens=tokens, mode="full").token_ids[:tokens]
            walked = engine.full_prefill_tokens(prompt, tokens)[: len(full)]
            first = next((i for i, (a, b) in enumerate(zip(full, walked, strict=True)) if a != b), None)
            rows.append({"prompt_tokens": len(prompt), "differs_at": first})
        cpu = machine(engine)
    same = sum(r["differs_at"] is None for r in rows)
    return {
        "model": label,
        "dtype": dtype,
        "cpu": cpu,
        "prompts": len(rows),
        "same": same,
        "lower_bound": round(wilson_lower(same, len(rows), CONFIDENCE), 4),
        "differs_at": [r["differs_at"] for r in rows if r["differs_at"] is not None],
        "mean_prompt_tokens": round(sum(r["prompt_tokens"] for r in rows) / len(rows)),
    }


def markdown(report: dict) -> str:
    c = report["config"]
    lines = [
        f"vllm engine on {report['runs'][0]['cpu']}; {c['date']}; {c['minutes']} min. Each prompt (the model's "
        f"generated task, seed {SEED}) answered by vLLM's full prefill and walked as a live check walks it; "
        f"same: the first {c['tokens']} tokens equal, with the {CONFIDENCE:.0%} Wilson lower bound.",
        "",
        "| model | dtype | prompts (mean tokens) | same | lower bound | where they differ (token) |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in report["runs"]:
        where = ", ".join(str(i) for i in r["differs_at"]) or "—"
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['prompts']} ({r['mean_prompt_tokens']}) | {r['same']} | "
            f"{r['lower_bound']:.3f} | {where} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks check-walk", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16"))
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.tokens < 1:
        parser.error("--prompts and --tokens must be at least 1")
    started = time.perf_counter()
    runs = [compare(m, d, args.prompts, args.tokens) for m in args.models for d in args.dtypes]
    report = {
        "config": {
            "tokens": args.tokens,
            "date": time.strftime("%Y-%m-%d"),
            "minutes": round((time.perf_counter() - started) / 60, 1),
        },
        "runs": runs,
    }
    write_results(
        args.out,
        "check-walk",
        "The live check's walk against vLLM's full prefill",
        markdown(report),
        report,
        command=f"`{' '.join(['python -m benchmarks check-walk', *(argv or [])])}`",
    )
