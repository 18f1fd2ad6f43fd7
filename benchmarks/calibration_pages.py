"""Benchmarks: the pages ``python -m benchmarks calibration`` writes: one per
model and engine (``markdown``), and ``docs/results/calibration.md`` with every
one side by side (``summary``)."""

from __future__ import annotations

import json
from pathlib import Path

from blend_integrations.calibration import curve_table, settings_label

PROBES = {
    "questions": "the calibration set's own questions",
    "documents": "built by calibrate() from the documents alone",
}


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
    tables = {"all": report["held_out"], **report.get("held_out_tasks", {})}
    tasks = c.get("held_out_tasks", {})
    lines += [
        "",
        f"Held out: {c['held_out_questions']} questions about documents calibration never saw "
        + (f"({', '.join(f'{k}: {v}' for k, v in tasks.items())}; " if tasks else "(")
        + f"{c['mean_prompt_tokens']} prompt tokens on average). Each mode over the requests it blended, those it "
        "did not (fell back, or ran as full prefill) counted apart; right: the reply contains the answer "
        f"(generated), SQuAD's F1 (squad-dev); the agreement's lower bound at {c['confidence']:.0%}:",
    ]
    for task, table in tables.items():
        if len(tables) > 1:
            lines += ["", f"{task}:"]
        lines += [
            "",
            f"| mode | blended | not blended | agrees with full (first {c['tokens_compared']} tokens) | lower bound | "
            "answer right | mean ratio | guard raised it | TTFT full / mode |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, r in table.items():
            ratio = "-" if r["mean_ratio"] is None else f"{r['mean_ratio']:.3f}"
            lower = f"{r['agreement_lower']:.3f}" if "agreement_lower" in r else "-"
            lines.append(
                f"| {name} | {r.get('blended', '-')} | {r.get('not_blended', '-')} | {r['agreement']:.3f} | {lower} | "
                f"{r['right']:.3f} | {ratio} | {r['guard_fired']:.2f} | {r['ttft_speedup']:.2f}x |"
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
