"""Real questions: SQuAD v1.1, asked as a RAG application asks them.

Each question's own Wikipedia paragraph stands among others that a BM25
retriever found over the whole split (its article's and other articles'), in
the retriever's order, so the gold paragraph lands anywhere
(``quality.squad``). Every mode answers the same prompts side by side: full
prefill, reuse, each selection at each recompute ratio, and ``"auto"`` (the
calibration the package ships for the model, or the user's). For each:
SQuAD's official exact match and F1 against the gold answers, the F1 lost
against full prefill with its upper confidence bound (paired bootstrap),
agreement with full prefill's first ``--tokens`` greedy tokens with its
Wilson lower bound, and time to first token against full prefill's.

A request that fell back (the vLLM blend pass failed and vLLM computed the
prompt) or ran as full prefill (a calibration that recomputes everything) is
not a blend: it is counted apart, and neither timed nor scored as one.

SQuAD dev is the held-out split (``held_out.py``): no design decision of this
package used it (the prompt below was written on train, and calibration
probes SQuAD train: docs/calibration.md#held-out-on-real-questions).

    python -m benchmarks squad [--model qwen2.5-coder-1.5b|qwen2.5-coder-0.5b|smollm2|gemma3-270m|DIR]
                               [--backend vllm|transformers] [--questions 60] [--split dev|train]
                               [--dtype auto|float32|bfloat16] [--ratios 0.05 ...] [--selections deviation ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from blend_integrations.calibration import wilson_lower
from blend_integrations.config import SELECTIONS
from blend_integrations.engines import load_engine
from blend_integrations.quality.squad import (
    CHAT_SYSTEM,
    COMPLETION_QUESTION,
    COMPLETION_SYSTEM,
    load_squad,
    retrieval_examples,
    squad_exact_match,
    squad_f1,
)
from blend_integrations.store import ChunkStore

from . import UNCHECKED, held_out, machine, scratch_dir, served_as, write_results
from .quality import Task, model_and_task, results_name

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
RATIOS = (0.05, 0.1, 0.15, 0.2, 0.3)
# Where each selection measures: a query-aware one ranks by a reuse pass (check layer 0, as calibration
# runs it); a deviation one needs a layer past 0 (``calibration.default_variants``).
CHECK_LAYERS = {"deviation": [1], "query": [0], "query-tail": [0], "mixed": [1]}
CHAT = Task("", (0, 0), CHAT_SYSTEM, "f1", 16)
COMPLETION = Task("", (0, 0), COMPLETION_SYSTEM, "f1", 16, COMPLETION_QUESTION)


def squad_task(engine) -> Task:
    """How a model is asked SQuAD's questions: a chat model through its template, a base model to complete."""
    return CHAT if getattr(engine.tokenizer, "chat_template", None) else COMPLETION


@dataclass
class Answer:
    served: str  # "blend", "fallback" or "full" (``served_as``)
    f1: float
    em: float
    agree: bool
    ttft: float
    ratio: float | None


def loss_bound(full: list[float], mode: list[float], confidence: float, resamples: int = 2000) -> float:
    """The upper ``confidence`` bound of the mean of ``full - mode`` over
    paired questions (a paired bootstrap, seeded: the same numbers every run)."""
    if not full:
        return float("nan")
    rng = random.Random(0)
    d = [f - m for f, m in zip(full, mode)]
    n = len(d)
    means = sorted(sum(d[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    return means[min(resamples - 1, int(confidence * resamples))]


def modes(selections, ratios) -> dict[str, dict]:
    out: dict[str, dict] = {"full": {"mode": "full"}, "reuse": {"mode": "reuse"}, "auto": {"recompute_ratio": "auto"}}
    for selection in selections:
        for r in ratios:
            out[f"{selection}@{r:g}"] = {
                "recompute_ratio": r,
                "selection": selection,
                "check_layers": CHECK_LAYERS[selection],
            }
    return out


def run(args) -> dict:
    model_dir, _, label = model_and_task(args.model)
    store = ChunkStore(scratch_dir("blend-squad-store-"), remote="")
    started = time.perf_counter()
    engine = load_engine(str(model_dir), store=store, backend=args.backend, dtype=args.dtype, config=UNCHECKED)
    task = squad_task(engine)
    seed = held_out.SQUAD_SEED if args.split == held_out.SQUAD_SPLIT else held_out.SQUAD_TRAIN_SEED
    examples, retrieval = retrieval_examples(load_squad(args.split), args.questions, seed=seed, n_docs=args.docs)
    prompts = [task.prompt(e, engine.tokenizer, engine.config.separator) for e in examples]
    plan = modes(args.selections, args.ratios)
    # what a checkpoint must match to be resumed: the same questions, modes and machine
    key = {
        "model": label,
        "backend": args.backend,
        "dtype": engine.dtype_name,
        "cpu": machine(),
        "ids": [e.id for e in examples],
        "modes": plan,
        "tokens": args.tokens,
    }
    rows, replies = resume(args.checkpoint, key)
    done = len(replies)
    engine.warm(sorted({d for e in examples[done:] for d in e.documents}), progress=True)
    options = {"max_tokens": task.max_tokens, "stop": ["\n"]}
    engine.generate(prompts[0], **options)  # warms the engine's kernels up before anything is timed
    asking = list(zip(examples, prompts))[done:]
    for example, tp in tqdm(
        asking, desc=f"asking {len(plan)} modes", unit="question", initial=done, total=len(examples)
    ):
        full = None
        texts = {}
        for name, mode in plan.items():
            gen = engine.generate(tp, **options, **mode)
            full = gen if name == "full" else full
            assert full is not None
            texts[name] = gen.text
            rows[name].append(
                Answer(
                    served_as(gen) if name != "full" else "full",
                    squad_f1(gen.text, example.answers),
                    squad_exact_match(gen.text, example.answers),
                    gen.token_ids[: args.tokens] == full.token_ids[: args.tokens],
                    gen.ttft_s,
                    gen.usage.recompute_ratio,
                )
            )
        replies.append(
            {"id": example.id, "answers": list(example.answers), "gold_rank": example.gold_rank, "replies": texts}
        )
        checkpoint(args.checkpoint, key, rows, replies)
    return {
        "config": {
            "model": label,
            "backend": args.backend,
            "dtype": engine.dtype_name,
            "cpu": machine(engine if args.backend == "vllm" else None),
            "split": args.split,
            "seed": seed,
            "questions": len(examples),
            "retrieval": retrieval,
            "mean_prompt_tokens": round(statistics.fmean(len(tp) for tp in prompts)),
            "tokens_compared": args.tokens,
            "confidence": args.confidence,
            "resumed_after": done or None,  # questions asked by an earlier process, from its checkpoint
            "calibration": engine.calibration_source(),
            "calibration_dtype": None if engine.calibration() is None else engine.calibration().dtype,
            "system": task.system,
            "minutes": round((time.perf_counter() - started) / 60, 1),
            "date": time.strftime("%Y-%m-%d"),
        },
        "modes": summarize(rows, args.confidence),
        "questions": replies,
    }


def resume(path: Path, key: dict) -> tuple[dict[str, list[Answer]], list[dict]]:
    """The rows and replies of the questions an earlier run of the same questions, modes and machine
    asked before it stopped (its checkpoint), else none."""
    rows: dict[str, list[Answer]] = {name: [] for name in key["modes"]}
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return rows, []
    if not isinstance(saved, dict) or saved.get("key") != json.loads(json.dumps(key)):
        print(f"{path} is of another run: starting over")
        return rows, []
    print(f"resuming after {len(saved['replies'])} questions from {path}")
    return {name: [Answer(**a) for a in saved["rows"][name]] for name in key["modes"]}, saved["replies"]


def checkpoint(path: Path, key: dict, rows: dict[str, list[Answer]], replies: list[dict]) -> None:
    """What was asked so far, so that a run stopped (a session's end) resumes where it stopped."""
    data = {"key": key, "rows": {name: [dataclasses.asdict(a) for a in answers] for name, answers in rows.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(data | {"replies": replies}))
    partial.replace(path)  # whole or not at all


def summarize(rows: dict[str, list[Answer]], confidence: float) -> dict[str, dict]:
    """Each mode over the questions it blended (full prefill: all of them),
    with the requests it did not blend counted apart."""
    full = rows["full"]
    table = {}
    for name, answers in rows.items():
        kept = [i for i, a in enumerate(answers) if a.served == ("full" if name == "full" else "blend")]
        f1 = [answers[i].f1 for i in kept]
        base = [full[i].f1 for i in kept]
        agree = sum(answers[i].agree for i in kept)
        ratios = [answers[i].ratio for i in kept if answers[i].ratio is not None]
        full_ttft = sum(full[i].ttft for i in kept)
        table[name] = {
            "blended": len(kept) if name != "full" else None,
            "fallback": sum(a.served == "fallback" for a in answers),
            "ran_full": sum(a.served == "full" for a in answers) if name != "full" else None,
            "f1": round(statistics.fmean(f1), 4) if f1 else None,
            "em": round(statistics.fmean(answers[i].em for i in kept), 4) if kept else None,
            "full_f1": round(statistics.fmean(base), 4) if base else None,
            "f1_loss": round(statistics.fmean(base) - statistics.fmean(f1), 4) if f1 else None,
            "f1_loss_bound": round(loss_bound(base, f1, confidence), 4) if f1 else None,
            "agreement": round(agree / len(kept), 4) if kept else None,
            "agreement_lower": round(wilson_lower(agree, len(kept), confidence), 4) if kept else None,
            "mean_ratio": round(statistics.fmean(ratios), 4) if ratios else None,
            "ttft_s": round(statistics.fmean(answers[i].ttft for i in kept), 4) if kept else None,
            "ttft_speedup": round(full_ttft / sum(answers[i].ttft for i in kept), 3) if kept else None,
        }
    return table


def markdown(report: dict, plot: str) -> str:
    c = report["config"]
    r = c["retrieval"]
    ranks = ", ".join(f"{k}: {v}" for k, v in sorted(r["gold_rank"].items(), key=lambda kv: int(kv[0])))
    lines = [
        f"Model: {c['model']} ({c['dtype']}, {c['backend']} engine) on {c['cpu']}; {c['date']}, "
        f"{c['minutes']:.0f} min.",
        f"Questions: {c['questions']} of SQuAD v1.1 {c['split']} (seed {c['seed']}), each with its own paragraph "
        f"among the {r['n_docs'][0]}-{r['n_docs'][1]} paragraphs BM25 ranks first over all {r['paragraphs']} of "
        f"the split, in BM25's order ({c['mean_prompt_tokens']} prompt tokens on average). BM25 missed the gold "
        f"paragraph for {r['retriever_missed']} of {r['considered']} questions drawn; those are not asked. Where "
        f"the gold paragraph stood (0: first): {ranks}.",
        f'"auto" ran the {c["calibration"]} calibration'
        + (f", measured in {c['calibration_dtype']}" if c.get("calibration_dtype") else "")
        + f'. System prompt: "{c["system"]}"',
        "",
        f"F1 and EM: SQuAD's official scores. Loss: full prefill's F1 minus the mode's on the same questions, "
        f"with its upper {c['confidence']:.0%} bound (paired bootstrap). Agrees: the mode's first "
        f"{c['tokens_compared']} tokens are full prefill's, with the Wilson lower {c['confidence']:.0%} bound. "
        "Speedup: full prefill's time to first token over the mode's, on the same questions. Each row counts only "
        "the requests it blended; those that fell back or ran as full prefill are counted apart, never scored or "
        "timed as blends.",
        "",
        "| mode | blended | fell back | ran full | F1 | EM | F1 loss (bound) | agrees (lower bound) | mean ratio | TTFT full / mode |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in report["modes"].items():
        if name == "full":
            lines.append(
                f"| full prefill | - | - | - | {m['f1']:.3f} | {m['em']:.3f} | - | - | - | 1.00x ({m['ttft_s']:.2f} s) |"
            )
            continue
        if not m["blended"]:
            lines.append(f"| {name} | 0 | {m['fallback']} | {m['ran_full']} | - | - | - | - | - | - |")
            continue
        ratio = "-" if m["mean_ratio"] is None else f"{m['mean_ratio']:.3f}"
        lines.append(
            f"| {name} | {m['blended']} | {m['fallback']} | {m['ran_full']} | {m['f1']:.3f} | {m['em']:.3f} | "
            f"{m['f1_loss']:+.3f} ({m['f1_loss_bound']:+.3f}) | {m['agreement']:.3f} ({m['agreement_lower']:.3f}) | "
            f"{ratio} | {m['ttft_speedup']:.2f}x |"
        )
    return "\n".join(lines) + f"\n\n![F1 against speedup]({plot})\n"


def write_plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes_ = report["modes"]
    full_f1 = modes_["full"]["f1"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, selection in enumerate(SELECTIONS):
        points = [
            (m["ttft_speedup"], m["f1"], name.split("@")[1])
            for name, m in modes_.items()
            if name.startswith(f"{selection}@") and m["blended"]
        ]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], "o-", color=f"C{i}", label=selection)
            for x, y, r in points:
                ax.annotate(r, (x, y), fontsize=6, xytext=(2, 2), textcoords="offset points")
    for name, marker in (("auto", "*"), ("reuse", "x")):
        m = modes_[name]
        if m["blended"]:
            ax.plot([m["ttft_speedup"]], [m["f1"]], marker, color="black", ms=10 if name == "auto" else 7, label=name)
    ax.axhline(full_f1, color="grey", lw=0.8, label="full prefill")
    ax.axhline(full_f1 - 0.02, color="red", lw=0.8, ls=":", label="full prefill - 0.02")
    ax.set_xlabel("TTFT speedup over full prefill")
    ax.set_ylabel("SQuAD F1")
    c = report["config"]
    ax.set_title(
        f"{Path(c['model']).name.split(' (')[0]}, {c['backend']}, {c['dtype']}: {c['questions']} questions", fontsize=9
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(out: Path) -> Path:
    """docs/results/squad.md: every model, engine and dtype run so far, in the CacheBlend paper's form."""
    lines = [
        "# SQuAD v1.1: real questions, every packaged model",
        "",
        'F1 of full prefill, of `"auto"` and of each selection at 0.15, the F1 lost against full prefill (its '
        "upper bound), and the speedup in time to first token; the paper's bar is a loss of about 0.02. "
        "One page per row holds every ratio ([how it is asked](../calibration.md#held-out-on-real-questions)).",
        "",
        "| model | engine, dtype | split, questions | full F1 | auto: F1, loss (bound), agrees (lower), speedup | "
        "best at 0.15: F1, loss (bound), speedup | CPU | date |",
        "|---|---|---|---:|---|---|---|---|",
    ]
    for path in sorted(out.glob("squad-*.json")):
        report = json.loads(path.read_text())
        c, m = report["config"], report["modes"]
        auto = m["auto"]
        at = {k: v for k, v in m.items() if k.endswith("@0.15") and v["blended"]}
        best = max(at, key=lambda k: at[k]["f1"]) if at else None
        auto_cell = (
            f"{auto['f1']:.3f}, {auto['f1_loss']:+.3f} ({auto['f1_loss_bound']:+.3f}), {auto['agreement']:.3f} "
            f"({auto['agreement_lower']:.3f}), {auto['ttft_speedup']:.2f}x"
            + (f"; {auto['ran_full']} ran full" if auto["ran_full"] else "")
            if auto["blended"]
            else f"ran full prefill on {auto['ran_full']}"
        )
        best_cell = (
            f"{best}: {at[best]['f1']:.3f}, {at[best]['f1_loss']:+.3f} ({at[best]['f1_loss_bound']:+.3f}), "
            f"{at[best]['ttft_speedup']:.2f}x"
            if best
            else "-"
        )
        lines.append(
            f"| [{Path(c['model']).name.split(' (')[0]}]({path.stem}.md) | {c['backend']}, {c['dtype']} | "
            f"{c['split']}, {c['questions']} | {m['full']['f1']:.3f} | {auto_cell} | {best_cell} | {c['cpu']} | "
            f"{c['date']} |"
        )
    page = out / "squad.md"
    page.write_text(
        "\n".join(lines)
        + "\n\nCommand: `python -m benchmarks squad --model MODEL --backend vllm|transformers [--dtype float32]` "
        "(each run rewrites this page from every result beside it).\n"
    )
    return page


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks squad", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="qwen2.5-coder-1.5b", help="a packaged model's name or a checkpoint directory"
    )
    parser.add_argument("--backend", default="vllm", choices=("transformers", "vllm"))
    parser.add_argument(
        "--dtype", default="auto", help="auto (the checkpoint's where the CPU runs it), float32, bfloat16"
    )
    parser.add_argument("--questions", type=int, default=60)
    parser.add_argument(
        "--split", default="dev", choices=("dev", "train"), help="dev: the held-out questions; train: for design"
    )
    parser.add_argument(
        "--docs",
        type=int,
        nargs=2,
        default=(6, 11),
        metavar=("MIN", "MAX"),
        help="paragraphs per prompt, the gold one among them (default: 6 to 11)",
    )
    parser.add_argument("--ratios", type=float, nargs="+", default=list(RATIOS))
    parser.add_argument("--selections", nargs="*", default=list(SELECTIONS), choices=SELECTIONS)
    parser.add_argument("--tokens", type=int, default=4, help="the first tokens compared with full prefill's")
    parser.add_argument("--confidence", type=float, default=0.8, help="of the bounds")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    # each question's answers are kept as they come: a run stopped resumes where it stopped (same arguments)
    args.checkpoint = (
        args.out / f".squad-{results_name(args.model)}-{args.backend}-{args.dtype}-{args.split}.partial.json"
    )
    report = run(args)
    tag = f"squad-{results_name(args.model)}-{args.backend}-{report['config']['dtype']}" + (
        "" if args.split == "dev" else f"-{args.split}"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    write_plot(report, args.out / f"{tag}.png")
    write_results(
        args.out,
        tag,
        f"SQuAD v1.1: {report['config']['model']}, {args.backend} engine, {report['config']['dtype']}",
        markdown(report, f"{tag}.png"),
        report,
        command=f"`python -m benchmarks squad {' '.join(argv or [])}`",
    )
    print(f"written: {summary(args.out)}")
    args.checkpoint.unlink(missing_ok=True)
