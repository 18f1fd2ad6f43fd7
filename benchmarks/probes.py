"""Per-probe agreement on calibration's probe prompts: which prompts each blend
setting changes, and how close full prefill's own choice was there.

Calibration stops a policy at the miss that rules the target out and reports
only counts; this part runs every setting at every ratio on every probe (the
calibration set's questions, as ``python -m benchmarks calibration`` asks
them) and lists the prompts any of them missed, with the margin between full
prefill's top two log-probabilities at each of the first tokens. A miss where
that margin is small is a near-tie that any change of the KV can flip; a miss
with wide margins that one selection has and another has not is the
selection's own.

``python -m benchmarks probes --model qwen2.5-coder-1.5b --backend vllm
--ratios 0.12 0.15 0.2 --settings query-layer0 query-tail`` writes
``docs/results/probes-MODEL-BACKEND.md`` and its JSON.
"""

from __future__ import annotations

import argparse
import time

from tqdm.auto import tqdm

from blend_integrations.config import BlendConfig
from blend_integrations.engines import load_engine
from blend_integrations.store import ChunkStore

from . import machine, scratch_dir, write_results
from .calibration import CALIBRATION_SEED
from .oracle import AGREE_TOKENS, selection_settings
from .oracle_report import RENAMED
from .quality import BASE, model_and_task, results_name


def margins(reply) -> list[float]:
    """Full prefill's margin between its top two log-probabilities at each generated token."""
    out = []
    for logprobs in reply.logprobs or []:
        top = sorted(logprobs.values(), reverse=True)
        out.append(round(top[0] - top[1], 3) if len(top) > 1 else float("inf"))
    return out


def run(args) -> dict:
    model_dir, task, label = model_and_task(args.model)
    store = ChunkStore(scratch_dir("blend-probes-store-"), remote="")
    # the settings are each one change from the oracle's base, as on its pages
    engine = load_engine(str(model_dir), store=store, backend=args.backend, config=BlendConfig(**BASE))
    assert engine.num_layers, "the engine knows its model's layers"
    settings = {name: s for name, s in selection_settings(engine.num_layers).items() if name in args.settings}
    examples = task.examples(args.prompts, CALIBRATION_SEED)
    prompts = [task.prompt(e, engine.tokenizer, engine.config.separator) for e in examples]
    engine.warm([d for e in examples for d in e.documents], progress=True)
    rows = []
    started = time.perf_counter()
    for i, tp in enumerate(tqdm(prompts, desc="probes", unit="prompt")):
        full = engine.generate(tp, max_tokens=AGREE_TOKENS, mode="full", logprobs=2)
        row = {"prompt": i, "full": full.token_ids, "margins": margins(full), "agrees": {}}
        for name, changes in settings.items():
            for r in args.ratios:
                blend = engine.generate(tp, max_tokens=AGREE_TOKENS, recompute_ratio=r, **changes)
                row["agrees"][f"{name}@{r}"] = blend.token_ids[:AGREE_TOKENS] == full.token_ids[:AGREE_TOKENS]
        rows.append(row)
    return {
        "config": {
            "model": label,
            "backend": args.backend,
            "dtype": engine.dtype_name,
            "machine": machine(engine if args.backend == "vllm" else None),
            "prompts": len(prompts),
            "ratios": args.ratios,
            "settings": settings,
            "seconds": round(time.perf_counter() - started),
        },
        "per_prompt": rows,
    }


def markdown(report: dict) -> str:
    c, rows = report["config"], report["per_prompt"]
    modes = list(rows[0]["agrees"]) if rows else []
    old = sorted({m.split("@")[0] for m in modes} & RENAMED.keys())
    shown = {m: RENAMED.get(m.split("@")[0], m.split("@")[0]) + "@" + m.split("@")[1] for m in modes}
    lines = [
        f"Model {c['model']} ({c['dtype']}) on the {c['backend']} engine; {c['machine']}; "
        f"{c['prompts']} probe prompts (the calibration set's questions), {c['seconds']} s.",
        "",
        f"Agrees: the first {AGREE_TOKENS} tokens equal full prefill's."
        + "".join(f" Run under a setting's old name, `{n}`, now `{RENAMED[n]}`." for n in old),
        "",
        "| setting@ratio | agrees |",
        "|---|---:|",
        *(f"| {shown[m]} | {sum(r['agrees'][m] for r in rows)} of {len(rows)} |" for m in modes),
        "",
        "Prompts any setting missed (x: missed), with full prefill's margin between its top two "
        "log-probabilities at each token:",
        "",
        "| prompt | margins | " + " | ".join(shown[m] for m in modes) + " |",
        "|---:|---|" + "---|" * len(modes),
    ]
    for r in rows:
        if not all(r["agrees"].values()):
            marks = " | ".join("" if r["agrees"][m] else "x" for m in modes)
            lines.append(f"| {r['prompt']} | {', '.join(f'{x:.2f}' for x in r['margins'])} | {marks} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks probes", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="a packaged model, reader, or a directory")
    parser.add_argument("--backend", default="vllm", choices=("transformers", "vllm"))
    parser.add_argument("--prompts", type=int, default=48, help="probe prompts, as calibration's default")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.12, 0.15, 0.2])
    parser.add_argument("--settings", nargs="+", default=["query-layer0", "query-tail"])
    parser.add_argument("--out", default="docs/results", help="directory for the results ('' to skip)")
    args = parser.parse_args(argv)
    if any(not 0.0 < r < 1.0 for r in args.ratios):
        parser.error("--ratios must lie strictly between 0 and 1")
    known = selection_settings(28)
    args.settings = [RENAMED.get(name, name) for name in args.settings]  # older commands still run
    if unknown := set(args.settings) - set(known):
        parser.error(f"unknown settings {', '.join(sorted(unknown))}; they are {', '.join(known)}")
    report = run(args)
    text = markdown(report)
    print(text)
    if args.out:
        options = f" --model {args.model} --backend {args.backend} --prompts {args.prompts}"
        options += f" --ratios {' '.join(map(str, args.ratios))} --settings {' '.join(args.settings)}"
        write_results(
            args.out,
            f"probes-{results_name(args.model)}-{args.backend}",
            f"Per-probe agreement: {report['config']['model']}",
            text,
            report,
            command=f"`python -m benchmarks probes{options}`.",
        )
