"""Tuning, judged on questions it never saw: the untuned and the tuned model side by side.

    python -m benchmarks tuning --tuned DIR [--model smollm2] [--backend transformers|vllm]
                                [--questions 60] [--calibrate] [--prompts 48]

For the untuned model and the tuned one (``python -m blend_integrations.tune``,
which trains on the standard library's docstrings): held-out synthetic
questions (``quality.HELD_OUT_SEED``: documents tuning never read) asked with
full prefill, reuse (r=0), blend at 0.05 and 0.15 and, with ``--calibrate``,
at the setting each model's own calibration chooses (calibrated on other
documents, as ``benchmarks calibration`` does). For each: agreement of the
first 4 greedy tokens with the *untuned* model's full prefill, the share
answered right, and time to first token against the same model's full
prefill, measured side by side. What tuning cost: both models' perplexity on
held-out general text (this package's docs/, which tuning never read).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

from blend_integrations.engines import load_engine
from blend_integrations.quality.metrics import contains
from blend_integrations.store import ChunkStore
from training.data import make_examples

from . import machine, write_results
from .calibration import CALIBRATION_SEED
from .quality import HELD_OUT_SEED, model_and_task

ROOT = Path(__file__).resolve().parent.parent
TOKENS = 4  # the first greedy tokens compared with the untuned model's full prefill
MODES = {"full": {"mode": "full"}, "reuse": {"mode": "reuse"}, "blend@0.05": {"recompute_ratio": 0.05}}
MODES |= {"blend@0.15": {"recompute_ratio": 0.15}}


def perplexity(model_dir: str, texts: list[str], *, window: int = 512, windows: int = 24) -> float:
    """Perplexity of ``texts`` (joined) over ``windows`` windows of ``window`` tokens, float32 on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer.encode("\n\n".join(texts), add_special_tokens=False)
    nll = count = 0.0
    with torch.no_grad():
        for start in range(0, min(len(ids) - 1, window * windows), window):
            chunk = torch.tensor([ids[start : start + window + 1]])
            logits = model(chunk[:, :-1], use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits[0].float(), chunk[0, 1:], reduction="sum")
            nll += loss.item()
            count += chunk.shape[1] - 1
    return math.exp(nll / count)


def run(args) -> dict:
    base_dir, task, label = model_and_task(args.model)
    doc_tokens = tuple(args.doc_tokens) if args.doc_tokens else task.doc_tokens
    held_out = make_examples(args.questions, seed=HELD_OUT_SEED, doc_tokens=doc_tokens)
    calibration_set = make_examples(args.prompts, seed=CALIBRATION_SEED, doc_tokens=doc_tokens)
    started = time.perf_counter()
    reference: list[list[int]] = []  # the untuned model's full-prefill tokens, per question
    models = {"untuned": str(base_dir), "tuned": str(args.tuned)}
    rows: dict[str, dict[str, dict]] = {}
    config: dict = {}
    for name, model_dir in models.items():
        store = ChunkStore(tempfile.mkdtemp(prefix=f"blend-tuning-{name}-"), remote="")
        with load_engine(model_dir, store=store, backend=args.backend) as engine:

            def asked(examples, engine=engine):
                return [task.prompt(e, engine.tokenizer, engine.config.separator) for e in examples]

            modes = dict(MODES)
            if args.calibrate:
                record = engine.calibrate(prompts=asked(calibration_set), num_prompts=args.prompts)
                calibrated = (
                    {"recompute_ratio": record.ratio, **record.settings} if record.ratio < 1 else {"mode": "full"}
                )
                modes[f"calibrated ({record.ratio})"] = calibrated
                config[f"{name}_calibration"] = {"ratio": record.ratio, "settings": record.settings}
            prompts = asked(held_out)
            engine.warm([d for e in held_out for d in e.documents], progress=True)
            results: dict[str, list[dict]] = {m: [] for m in modes}
            for i, (example, tp) in enumerate(zip(held_out, prompts)):
                for mode, options in modes.items():
                    gen = engine.generate(tp, max_tokens=task.max_tokens, **options)
                    if name == "untuned" and mode == "full":
                        reference.append(gen.token_ids)
                    results[mode].append(
                        {
                            "agree": gen.token_ids[:TOKENS] == reference[i][:TOKENS],
                            "right": contains(gen.text, example.answer),
                            "ttft": gen.ttft_s,
                        }
                    )
            full_ttft = statistics.fmean(r["ttft"] for r in results["full"])
            rows[name] = {
                mode: {
                    "agreement": round(statistics.fmean(r["agree"] for r in rs), 4),
                    "right": round(statistics.fmean(r["right"] for r in rs), 4),
                    "ttft_s": round(statistics.fmean(r["ttft"] for r in rs), 4),
                    "ttft_speedup": round(full_ttft / statistics.fmean(r["ttft"] for r in rs), 3),
                }
                for mode, rs in results.items()
            }
            config[f"{name}_dtype"] = engine.dtype_name
            if name == "untuned":
                config["cpu"] = machine(engine if args.backend == "vllm" else None)
    docs = [p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))]
    record = json.loads((Path(args.tuned) / "tuning.json").read_text())
    return {
        "config": {
            "model": label,
            "tuned": str(args.tuned),
            "backend": args.backend,
            "questions": len(held_out),
            "tokens_compared": TOKENS,
            "tuning": {k: record[k] for k in ("options", "steps", "seconds", "dtype") if k in record},
            "minutes": round((time.perf_counter() - started) / 60, 1),
            "date": time.strftime("%Y-%m-%d"),
            **config,
        },
        "held_out": rows,
        "perplexity": {name: round(perplexity(d, docs), 3) for name, d in models.items()},
    }


def markdown(report: dict) -> str:
    c = report["config"]
    lines = [
        f"Model: {c['model']}, untuned and tuned ({c['tuned']}: {c['tuning'].get('steps')} steps in "
        f"{c['tuning'].get('seconds', 0) / 60:.0f} min), {c['backend']} engine, on {c['cpu']}; {c['date']}.",
        "",
        f"{c['questions']} held-out questions about documents tuning never read. Agreement: the first "
        f"{c['tokens_compared']} greedy tokens equal the untuned model's full prefill's. TTFT: the same "
        "model's full prefill / the mode, measured side by side.",
        "",
        "| model | mode | agrees with untuned full | answer right | TTFT full / mode |",
        "|---|---|---:|---:|---:|",
    ]
    for name, modes in report["held_out"].items():
        for mode, r in modes.items():
            lines.append(f"| {name} | {mode} | {r['agreement']:.3f} | {r['right']:.3f} | {r['ttft_speedup']:.2f}x |")
    ppl = report["perplexity"]
    lines += ["", f"Perplexity on this package's docs/ (general text tuning never read): untuned {ppl['untuned']:.2f}, "
              f"tuned {ppl['tuned']:.2f}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks tuning", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tuned", required=True, help="the tuned model's directory (python -m blend_integrations.tune)"
    )
    parser.add_argument("--model", default="smollm2", help="the untuned model: smollm2, gemma3-270m or a directory")
    parser.add_argument("--backend", choices=("transformers", "vllm"), default="transformers")
    parser.add_argument("--questions", type=int, default=60)
    parser.add_argument("--prompts", type=int, default=48, help="calibration prompts, with --calibrate")
    parser.add_argument(
        "--doc-tokens", type=int, nargs=2, metavar=("MIN", "MAX"), help="documents' length (default: the model's task)"
    )
    parser.add_argument("--calibrate", action="store_true", help="also ask at each model's calibrated setting")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    args = parser.parse_args(argv)
    report = run(args)
    text = markdown(report)
    print(text)
    write_results(args.out, f"tuning-{args.backend}", "Tuning: the untuned and the tuned model", text, report,
                  command=f"`python -m benchmarks tuning --tuned DIR --backend {args.backend}`")  # fmt: skip
