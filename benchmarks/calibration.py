"""Calibration, judged on questions it never saw.

Calibrates a model (``engine.calibrate``) on the documents of one set of
synthetic questions, then asks held-out questions about other documents
(another seed; the two sets share no document) in every mode side by side:
full prefill; blend with the defaults, which use the calibration (the guard
on the transformers engine, the single calibrated ratio on vLLM); blend at the
calibrated single ratio; and blend at the uncalibrated fallback ratio. For
each: agreement with full prefill's first ``tokens`` greedy tokens, whether
the reply contains the answer, the mean ratio used, how often the guard raised
it, and time to first token against full prefill's, measured side by side.

    python -m benchmarks calibration [--model reader|smollm2|gemma3-270m|DIR] [--backend transformers|vllm]
                                     [--prompts 48] [--questions 60] [--target 0.95] [--package]

``--package`` also writes the record, with its held-out numbers, as the
calibration the package ships for that model and engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

from blend_integrations.calibration import (
    PACKAGED_DIR,
    PackagedCalibration,
    curve_table,
    packaged_name,
    settings_label,
)
from blend_integrations.config import FALLBACK_RATIO
from blend_integrations.engines import load_engine
from blend_integrations.quality.metrics import contains
from blend_integrations.store import ChunkStore

from . import machine, scratch_dir, write_results
from .quality import HELD_OUT_SEED, model_and_task, results_name

PROBES = {
    "questions": "the calibration set's own questions",
    "documents": "built by calibrate() from the documents alone",
}
# The models whose calibrations ship with the package (``--package``), by the name a user knows them by.
SHIPPED = {
    "reader": "the bundled reader",
    "smollm2": "SmolLM2-135M-Instruct",
    "gemma3-270m": "Gemma 3 270M",
    "qwen2.5-coder-0.5b": "Qwen2.5-Coder-0.5B-Instruct",
    "qwen2.5-coder-1.5b": "Qwen2.5-Coder-1.5B-Instruct",
}
CALIBRATION_SEED = 30_000  # the documents calibration probes; the held-out questions use HELD_OUT_SEED
RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"


def run(args) -> dict:
    model_dir, task, label = model_and_task(args.model)
    doc_tokens = tuple(args.doc_tokens) if args.doc_tokens else None
    store = ChunkStore(scratch_dir("blend-calibration-store-"), remote="")
    started = time.perf_counter()
    engine = load_engine(str(model_dir), store=store, backend=args.backend)

    def asked(examples):
        return [task.prompt(e, engine.tokenizer, engine.config.separator) for e in examples]

    calibration_set = task.examples(args.prompts, CALIBRATION_SEED, doc_tokens)
    calibration_docs = sorted({d for e in calibration_set for d in e.documents})
    held_out = task.examples(args.questions, HELD_OUT_SEED, doc_tokens)
    seen = set(calibration_docs) & {d for e in held_out for d in e.documents}
    assert not seen, f"{len(seen)} held-out documents were calibrated on"
    t0 = time.perf_counter()
    # "questions": the application's own prompts (the calibration set's questions, asked as the
    # held-out ones are); "documents": probes calibrate() builds from the documents alone
    probes = {"prompts": asked(calibration_set)} if args.probes == "questions" else {"documents": calibration_docs}
    record = engine.calibrate(
        **probes, num_prompts=args.prompts, target=args.target, plot=args.out / f"calibration-{args.tag}.png"
    )
    calibrate_s = time.perf_counter() - t0

    prompts = asked(held_out)
    engine.warm([d for e in held_out for d in e.documents], progress=True)
    modes = {
        "full": {"mode": "full"},
        "default (calibrated)": {},
        # the calibrated single ratio with the settings it was measured under
        f"calibrated single ratio ({record.ratio})": {"recompute_ratio": record.ratio, **record.settings},
        f"fallback ({FALLBACK_RATIO})": {"recompute_ratio": FALLBACK_RATIO},
    }
    rows: dict[str, list[dict]] = {name: [] for name in modes}
    for example, tp in zip(held_out, prompts):
        full = None
        for name, options in modes.items():
            gen = engine.generate(tp, max_tokens=task.max_tokens, **options)
            if name == "full":
                full = gen
            assert full is not None
            rows[name].append(
                {
                    "agree": gen.token_ids[: record.tokens] == full.token_ids[: record.tokens],
                    "right": contains(gen.text, example.answer),
                    "ttft": gen.ttft_s,
                    "ratio": gen.usage.recompute_ratio,
                    "source": gen.usage.ratio_source,
                }
            )
    full_ttft = statistics.fmean(r["ttft"] for r in rows["full"])
    table = {}
    for name, rs in rows.items():
        ratios = [r["ratio"] for r in rs if r["ratio"] is not None]
        table[name] = {
            "agreement": round(statistics.fmean(r["agree"] for r in rs), 4),
            "right": round(statistics.fmean(r["right"] for r in rs), 4),
            "mean_ratio": round(statistics.fmean(ratios), 4) if ratios else None,
            "guard_fired": round(statistics.fmean(r["source"] == "guard" for r in rs), 4),
            "ttft_s": round(statistics.fmean(r["ttft"] for r in rs), 4),
            "ttft_speedup": round(full_ttft / statistics.fmean(r["ttft"] for r in rs), 3),
        }
    if args.package:
        write_packaged(record, table, args)
    return {
        "config": {
            "model": label,
            "tag": args.tag,
            "backend": args.backend,
            "dtype": engine.dtype_name,
            "cpu": machine(),
            "calibration_documents": len(calibration_docs),
            "probes": args.probes,
            "calibration_prompts": record.n,
            "calibration_seconds": round(calibrate_s, 1),
            "held_out_questions": len(held_out),
            "mean_prompt_tokens": round(statistics.fmean(len(tp) for tp in prompts)),
            "target": record.target,
            "confidence": record.confidence,
            "tokens_compared": record.tokens,
            "minutes": round((time.perf_counter() - started) / 60, 1),
            "date": time.strftime("%Y-%m-%d"),
        },
        "calibration": {
            "ratio": record.ratio,
            "guard": None if record.guard is None else {"base": record.guard.base, "threshold": record.guard.threshold},
            "meets_target": record.meets_target,
            "why": record.why,
            "settings": record.settings,
            "guard_settings": record.guard_settings,
            "curve": record.curve,
        },
        "held_out": table,
    }


def write_packaged(record, table: dict, args) -> Path:
    """The calibration this package ships for a model it ships (``calibration.PACKAGED_DIR``): the record,
    named for the model, with the held-out measurements that say what its ratio means."""
    fallback = next(v for k, v in table.items() if k.startswith("fallback"))
    held_out = {
        "questions": args.questions,
        "tokens": record.tokens,
        "full_right": table["full"]["right"],
        "calibrated": {**table["default (calibrated)"], "ratio": table["default (calibrated)"]["mean_ratio"]},
        "fallback": {**fallback, "ratio": FALLBACK_RATIO},
    }
    name = results_name(args.model)
    packaged = PackagedCalibration(dataclasses.replace(record, model=SHIPPED[name]), held_out, machine(), Path())
    path = PACKAGED_DIR / packaged_name(name, args.backend)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(packaged.to_bytes())
    print(f"packaged calibration written: {path}")
    return path


def markdown(report: dict) -> str:
    c, cal = report["config"], report["calibration"]
    guard = cal["guard"]
    lines = [
        f"Model: {c['model']} ({c['dtype']}, {c['backend']} engine) on {c['cpu']}; {c['date']}.",
        f"Calibration: {c['calibration_prompts']} probe prompts ({PROBES[c.get('probes', 'documents')]}) from "
        f"{c['calibration_documents']} documents in "
        f"{c['calibration_seconds']:.0f} s; target {c['target']} agreement with full prefill's first "
        f"{c['tokens_compared']} tokens, at a {c['confidence']:.0%} lower confidence bound.",
        f"Chosen: single ratio {cal['ratio']} ({settings_label(cal['settings'])} settings)"
        + (
            f"; guard base {guard['base']}, threshold {guard['threshold']} "
            f"({settings_label(cal['guard_settings'])} settings)"
            if guard
            else "; no guard"
        )
        + ("" if cal["meets_target"] else " (no ratio below 1.0 meets the target: blending cannot hold it here)")
        + (f": {cal['why']}" if cal.get("why") else "")
        + ".",
        "",
        "Calibration curve (probe prompts):",
        "",
        *curve_table(cal["curve"], c["calibration_prompts"]),
    ]
    lines += [
        "",
        f"Held out: {c['held_out_questions']} questions about documents calibration never saw "
        f"({c['mean_prompt_tokens']} prompt tokens on average):",
        "",
        f"| mode | agrees with full (first {c['tokens_compared']} tokens) | answer right | mean ratio | "
        "guard raised it | TTFT full / mode |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in report["held_out"].items():
        ratio = "-" if r["mean_ratio"] is None else f"{r['mean_ratio']:.3f}"
        lines.append(
            f"| {name} | {r['agreement']:.3f} | {r['right']:.3f} | {ratio} | {r['guard_fired']:.2f} | "
            f"{r['ttft_speedup']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def summary(out: Path) -> Path:
    """docs/results/calibration.md: every model and engine calibrated so far, side by side."""
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("calibration-*.json"))]
    lines = [
        "# Calibration: the ratio each model needs, and what it buys",
        "",
        "Each row: the model calibrated on one question set (`engine.calibrate`, target 0.95 agreement with "
        "full prefill's first 4 greedy tokens at an 80% lower bound), on its questions (the application's own "
        "prompts) or on probes built from its documents alone, then "
        "held-out questions about documents calibration never saw, asked with the defaults "
        '(`recompute_ratio="auto"`: the calibration, with the per-request guard on the transformers engine) '
        "and with full prefill, side by side. Speedup is time to first token, full prefill / blend, same "
        "engine, same run. One page per row holds the curve.",
        "",
        "| model | engine | probes | chosen | calibration | held out: agrees with full | answer right (full) | "
        "mean ratio | guard raised | TTFT speedup | fallback 0.15: agrees, speedup | CPU | date |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in reports:
        c, cal, held = r["config"], r["calibration"], r["held_out"]
        default, full = held["default (calibrated)"], held["full"]
        fallback = next(v for k, v in held.items() if k.startswith("fallback"))
        guard = cal["guard"]
        if guard:
            chosen = f"guard {guard['base']} / {guard['threshold']}, else {cal['ratio']}"
        elif cal["ratio"] < 1.0:
            chosen = f"ratio {cal['ratio']}" + (
                f" ({settings_label(cal['settings'])})" if settings_label(cal["settings"]) != "default" else ""
            )
        elif not cal["meets_target"]:
            chosen = "full prefill: no ratio below 1.0 meets the target"
        else:
            chosen = "full prefill: what meets the target is not 1.1x sooner"
        if c["target"] != 0.95:
            chosen = f"target {c['target']}: {chosen}"
        page = f"calibration-{c['tag']}"
        lines.append(
            f"| [{Path(c['model']).name.split(' (')[0]}]({page}.md) | {c['backend']} | {c.get('probes', 'documents')} | {chosen} | "
            f"{c['calibration_seconds']:.0f} s, "
            f"{c['calibration_prompts']} prompts | {default['agreement']:.3f} | {default['right']:.3f} "
            f"({full['right']:.3f}) | {default['mean_ratio']:.3f} | {default['guard_fired']:.2f} | "
            f"{default['ttft_speedup']:.2f}x | {fallback['agreement']:.3f}, {fallback['ttft_speedup']:.2f}x | "
            f"{c['cpu']} | {c['date']} |"
        )
    path = out / "calibration.md"
    path.write_text(
        "\n".join(lines)
        + "\n\nCommand: `python -m benchmarks calibration --model reader|smollm2|gemma3-270m|qwen2.5-coder-0.5b|qwen2.5-coder-1.5b "
        "--backend transformers|vllm` (each run rewrites this page from every result beside it).\n"
    )
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks calibration", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="reader", help=f"{', '.join(SHIPPED)} or a checkpoint directory")
    parser.add_argument("--backend", default="transformers", choices=("transformers", "vllm"))
    parser.add_argument("--prompts", type=int, default=48, help="calibration probe prompts")
    parser.add_argument("--questions", type=int, default=60, help="held-out questions")
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument(
        "--doc-tokens", type=int, nargs=2, metavar=("MIN", "MAX"), help="document length (default: the model's task's)"
    )
    parser.add_argument(
        "--probes",
        choices=("questions", "documents"),
        default="questions",
        help="calibrate on the calibration set's own questions (as an application with sample questions does), "
        "or on probes built from its documents alone",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--package",
        action="store_true",
        help="also write the record as the calibration the package ships for this model and engine "
        "(blend_integrations/data/calibrations/; a shipped model, the default target and probes only)",
    )
    args = parser.parse_args(argv)
    name = results_name(args.model)
    if args.package and (name not in SHIPPED or args.target != 0.95 or args.probes != "questions"):
        parser.error(f"--package is for the shipped models ({', '.join(SHIPPED)}) at the default target and probes")
    args.tag = (
        f"{name}-{args.backend}"
        + ("" if args.probes == "questions" else "-document-probes")
        + ("" if args.target == 0.95 else f"-target-{args.target}")
    )
    report = run(args)
    write_results(
        args.out,
        f"calibration-{args.tag}",
        f"Calibration: {report['config']['model']}, {args.backend} engine",
        markdown(report),
        report,
        command=f"`python -m benchmarks calibration {' '.join(argv or [])}`",
    )
    print(f"written: {summary(args.out)}")
