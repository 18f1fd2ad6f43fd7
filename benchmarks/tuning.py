"""Tuning, judged on questions it never saw: the untuned and the tuned model side by side.

    python -m benchmarks tuning --tuned DIR [--model smollm2] [--backend transformers|vllm]
                                [--questions 60] [--calibrate] [--prompts 48] [--ape]

For the untuned model and the tuned one (``python -m blend_integrations.tune``,
which trains on the standard library's docstrings): held-out synthetic
questions (``quality.DEVELOPMENT_SEED``: documents tuning never read) asked with
full prefill, reuse (r=0), blend at 0.05 and 0.15, and the defaults
(``recompute_ratio="auto"``: the untuned model's packaged calibration; with
``--calibrate`` the tuned model is calibrated first on other documents, as
``benchmarks calibration`` does, and without it the tuned model blends at
the fallback ratio; the table's row names which). For each: agreement of the first 4 greedy tokens with
the *untuned* model's full prefill and with the same model's, the share
answered right, and time to first token against the same model's full
prefill, measured side by side. What tuning cost: both models' perplexity on
held-out general text (this package's docs/, which tuning never read).

``--ape`` (transformers engine): the untuned model read with APE's
training-free recipe (``benchmarks/ape.py``), its temperature and scale
chosen on the calibration documents.

``--render RESULT.json`` rewrites a page from its recorded numbers, running
no model (its title, command and any note after the table are kept).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

from blend_integrations.calibration.choice import wilson_lower
from blend_integrations.config import CALIBRATION_SOURCES
from blend_integrations.engines import load_engine
from blend_integrations.quality.metrics import contains
from blend_integrations.store import ChunkStore
from training.data import make_examples

from . import UNCHECKED, machine, scratch_dir, write_results
from .calibration import CALIBRATION_SEED
from .quality import DEVELOPMENT_SEED, model_and_task

ROOT = Path(__file__).resolve().parent.parent
TOKENS = 4  # the first greedy tokens compared with the untuned model's full prefill
# recompute_ratio="auto": its row's label says where the ratio came from (``mode_label``); results written
# before it did keyed the row "default (calibrated)" whatever the source
DEFAULT = "default"
MODES = {"full": {"mode": "full"}, "reuse": {"mode": "reuse"}, "blend@0.05": {"recompute_ratio": 0.05}}
MODES |= {"blend@0.15": {"recompute_ratio": 0.15}, DEFAULT: {}}


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


def _rows(results: dict[str, list[dict]]) -> dict[str, dict]:
    full_ttft = statistics.fmean(r["ttft"] for r in results["full"])
    rows = {}
    for mode, rs in results.items():
        ratios = [r["ratio"] for r in rs if r.get("ratio") is not None]
        ttft = statistics.fmean(r["ttft"] for r in rs)
        rows[mode] = {
            "agreement": round(statistics.fmean(r["agree"] for r in rs), 4),
            "agreement_own": round(statistics.fmean(r["agree_own"] for r in rs), 4),
            "right": round(statistics.fmean(r["right"] for r in rs), 4),
            "mean_ratio": round(statistics.fmean(ratios), 4) if ratios else None,
            "ratio_source": sorted({r["source"] for r in rs if r.get("source")}),
            "guard_fired": round(statistics.fmean(r.get("source") == "guard" for r in rs), 4),
            "ttft_s": round(ttft, 4),
            "ttft_speedup": round(full_ttft / ttft, 3),
        }
    return rows


def run(args) -> dict:
    base_dir, task, label = model_and_task(args.model)
    tuned_dir = args.tuned
    doc_tokens = tuple(args.doc_tokens) if args.doc_tokens else task.doc_tokens
    held_out = make_examples(args.questions, seed=DEVELOPMENT_SEED, doc_tokens=doc_tokens)
    calibration_set = make_examples(args.prompts, seed=CALIBRATION_SEED, doc_tokens=doc_tokens)
    started = time.perf_counter()
    reference: list[list[int]] = []  # the untuned model's full-prefill tokens, per question
    models = {"untuned": str(base_dir), "tuned": str(tuned_dir)}
    rows: dict[str, dict[str, dict]] = {}
    config: dict = {}
    for name, model_dir in models.items():
        store = ChunkStore(scratch_dir(f"blend-tuning-{name}-"), remote="")
        with load_engine(model_dir, store=store, backend=args.backend, config=UNCHECKED) as engine:

            def asked(examples, engine=engine):
                return [task.prompt(e, engine.tokenizer, engine.config.separator) for e in examples]

            if args.calibrate and name == "tuned":
                t0 = time.perf_counter()
                record = engine.calibrate(prompts=asked(calibration_set), num_prompts=args.prompts)
                config["tuned_calibration"] = {
                    "ratio": record.ratio,
                    "guard": None
                    if record.guard is None
                    else {"base": record.guard.base, "threshold": record.guard.threshold},
                    "settings": record.settings,
                    "meets_target": record.meets_target,
                    "seconds": round(time.perf_counter() - t0, 1),
                }
            prompts = asked(held_out)
            engine.warm([d for e in held_out for d in e.documents], progress=True)
            results: dict[str, list[dict]] = {m: [] for m in MODES}
            for i, (example, tp) in enumerate(zip(held_out, prompts)):
                own = None
                for mode, options in MODES.items():
                    gen = engine.generate(tp, max_tokens=task.max_tokens, **options)
                    if mode == "full":
                        own = gen.token_ids
                        if name == "untuned":
                            reference.append(gen.token_ids)
                    assert own is not None
                    results[mode].append(
                        {
                            "agree": gen.token_ids[:TOKENS] == reference[i][:TOKENS],
                            "agree_own": gen.token_ids[:TOKENS] == own[:TOKENS],
                            "right": contains(gen.text, example.answer),
                            "ttft": gen.ttft_s,
                            "ratio": gen.usage.recompute_ratio,
                            "source": gen.usage.ratio_source,
                        }
                    )
            rows[name] = _rows(results)
            config[f"{name}_dtype"] = engine.dtype_name
            if name == "untuned":
                config["cpu"] = machine(engine if args.backend == "vllm" else None)
        if name == "untuned" and args.ape:
            rows[name] |= _ape(model_dir, task, calibration_set, held_out, reference, rows[name], config)
    docs = [p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))]
    tuning = json.loads((tuned_dir / "tuning.json").read_text())
    return {
        "config": {
            "model": label,
            "tuned": str(tuned_dir),
            "backend": args.backend,
            "questions": len(held_out),
            "tokens_compared": TOKENS,
            "tuning": {k: tuning[k] for k in ("options", "steps", "seconds", "dtype", "held_out_kl") if k in tuning},
            "minutes": round((time.perf_counter() - started) / 60, 1),
            "date": time.strftime("%Y-%m-%d"),
            **config,
        },
        "held_out": rows,
        "perplexity": {name: round(perplexity(d, docs), 3) for name, d in models.items()},
    }


def _ape(model_dir, task, calibration_set, held_out, reference, untuned: dict, config: dict) -> dict:
    """APE's training-free recipe on the untuned model (``benchmarks/ape.py``): its setting chosen on the
    calibration documents, then the held-out questions; its TTFT is reuse's (nothing is recomputed)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .ape import APEReader, choose

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reader = APEReader(model, tokenizer)
    t0 = time.perf_counter()
    setting, grid = choose(reader, [task.prompt(e, tokenizer) for e in calibration_set], TOKENS)
    config["ape"] = {"chosen": setting.label, "calibration_agreement": grid, "seconds": round(time.perf_counter() - t0)}
    rs = []
    for example, ref in zip(held_out, reference):
        tokens, text = reader.generate(task.prompt(example, tokenizer), task.max_tokens, setting)
        agree = tokens[:TOKENS] == ref[:TOKENS]
        rs.append({"agree": agree, "agree_own": agree, "right": contains(text, example.answer)})
    reuse = untuned["reuse"]
    return {
        setting.label: {
            "agreement": round(statistics.fmean(r["agree"] for r in rs), 4),
            "agreement_own": round(statistics.fmean(r["agree_own"] for r in rs), 4),
            "right": round(statistics.fmean(r["right"] for r in rs), 4),
            "mean_ratio": 0.0,
            "ratio_source": ["APE reading"],
            "guard_fired": 0.0,
            "ttft_s": reuse["ttft_s"],
            "ttft_speedup": reuse["ttft_speedup"],
        }
    }


def mode_label(mode: str, row: dict) -> str:
    """A table row's mode; the default's names where its ratio came from, as the run recorded it
    (``ratio_source``): the fallback ratio is no calibration, and a packaged calibration is not the user's."""
    if mode != DEFAULT and not mode.startswith(f"{DEFAULT} ("):
        return mode
    names = []
    for source in row.get("ratio_source") or []:
        if source == "fallback":  # one ratio for every request: the mean is the fallback ratio the run used
            names.append(f"fallback {row['mean_ratio']:g}")
        elif source in CALIBRATION_SOURCES:
            names.append("calibrated" if source == "calibrated" else "packaged calibration")
        else:  # the guard raised a calibrated ratio for some requests
            names.append(source)
    return f"{DEFAULT} ({', '.join(names)})" if names else DEFAULT


def noise(questions: int) -> str:
    """How far a share measured on ``questions`` questions may be from the true one."""
    half = 0.5 - wilson_lower(questions // 2, questions, 0.975) if questions else 0.5
    return f"With {questions} questions a share near 0.5 is known to about ±{half:.2f} (95%, Wilson interval)."


def _table(report: dict, lead: str = "") -> list[str]:
    """One table row per model and mode, each starting with ``lead``."""
    lines = []
    for name, modes in report["held_out"].items():
        for mode, r in modes.items():
            ratio = "-" if r.get("mean_ratio") is None else f"{r['mean_ratio']:.3f}"
            lines.append(
                f"| {lead}{name} | {mode_label(mode, r)} | {r['agreement']:.3f} | {r['agreement_own']:.3f} | {r['right']:.3f} | "
                f"{ratio} | {r['ttft_speedup']:.2f}x |"
            )
    return lines


def markdown(report: dict) -> str:
    c = report["config"]
    t = c["tuning"]
    lines = [
        f"Model: {c['model']}, untuned and tuned ({c['tuned']}: {t.get('steps')} steps in "
        f"{t.get('seconds', 0) / 60:.0f} min), {c['backend']} engine, on {c['cpu']}; {c['date']}.",
        "",
        f"{c['questions']} held-out questions about documents tuning never read. Agreement: the first "
        f"{c['tokens_compared']} greedy tokens equal the untuned model's full prefill's (and the same model's). "
        "TTFT: the same model's full prefill / the mode, measured side by side. Default: "
        '`recompute_ratio="auto"`, the model\'s calibration where it has one, else the fallback ratio (the row '
        "names which; the mean ratio used is shown). " + noise(c["questions"]),
    ]
    if "tuned_calibration" in c:
        cal = c["tuned_calibration"]
        guard = f", guard {cal['guard']['base']} / {cal['guard']['threshold']}" if cal["guard"] else ""
        lines += ["", f"The tuned model calibrated to ratio {cal['ratio']}{guard} in {cal['seconds']:.0f} s."]
    if "ape" in c:
        grid = ", ".join(f"{k}: {v:.3f}" for k, v in c["ape"]["calibration_agreement"].items())
        lines += ["", f"APE settings' agreement with full attention on the calibration prompts: {grid}."]
    lines += [
        "",
        "| model | mode | agrees with untuned full | agrees with own full | answer right | mean ratio | "
        "TTFT full / mode |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    lines += _table(report)
    ppl = report["perplexity"]
    lines += ["", f"Perplexity on this package's docs/ (general text tuning never read): untuned {ppl['untuned']:.2f}, "
              f"tuned {ppl['tuned']:.2f}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def summary(out: Path) -> Path:
    """docs/results/tuning.md: every engine's tuning results beside each other, with the tuning's curve."""
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("tuning-*.json"))]
    first = reports[0]["config"]
    t = first["tuning"]
    curve = ", ".join(f"{k['step']}: {k['block']:.4f} / {k['full']:.4f}" for k in t.get("held_out_kl", []))
    lines = [
        "# Tuning: the untuned and the tuned model",
        "",
        f"The untuned model: {first['model']}. The tuned one: the same after "
        f"`python -m blend_integrations.tune` ({t.get('steps')} steps, {t.get('dtype')}; options "
        f"`{json.dumps(t.get('options'))}`), its LoRA adapter merged. Held-out KL of the block / full "
        f"reading from the untuned model's full reading while it trained, by step: {curve}.",
        "",
        f"Each engine: {first['questions']} held-out questions about documents tuning never read, every mode "
        f"side by side in one run. Agreement: the first {first['tokens_compared']} greedy tokens equal the "
        "untuned model's full prefill's, or the same model's. TTFT: the same model's full prefill over the mode. "
        "Default: `recompute_ratio=\"auto\"`, each model's calibration where it has one (the untuned model's "
        "packaged one; the tuned one's, with `--calibrate`, made on other documents first), else the fallback "
        "ratio (the row names which). " + noise(first["questions"]),
        "",
        "| engine | model | mode | agrees with untuned full | agrees with own full | answer right | mean ratio | "
        "TTFT full / mode |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for report in reports:
        backend = report["config"]["backend"]
        lines += _table(report, f"[{backend}](tuning-{backend}.md) | ")
    lines.append("")
    for report in reports:
        c, ppl = report["config"], report["perplexity"]
        cal = c.get("tuned_calibration")
        chose = f"; the tuned model calibrated to ratio {cal['ratio']} in {cal['seconds']:.0f} s" if cal else ""
        lines.append(
            f"- {c['backend']} engine, {c['cpu']}, {c['date']}: perplexity on this package's docs/ "
            f"untuned {ppl['untuned']:.2f}, tuned {ppl['tuned']:.2f}{chose}."
        )
        if "ape" in c:
            grid = ", ".join(f"{k} {v:.3f}" for k, v in c["ape"]["calibration_agreement"].items())
            lines.append(
                f"- APE's recipe (`benchmarks/ape.py`), its setting chosen on the calibration documents by "
                f"agreement with full attention: {grid}; chosen: {c['ape']['chosen']}."
            )
    path = out / "tuning.md"
    path.write_text(
        "\n".join(lines) + "\n\nCommand: `python -m benchmarks tuning --tuned DIR --calibrate [--ape] --backend "
        "transformers|vllm` (each run rewrites this page from every result beside it). What the numbers mean: "
        "[Making a model blend-ready](../blend-ready.md#smollm2-tuned).\n"
    )
    return path


def render(result: Path) -> Path:
    """Rewrite ``result``'s page (the ``.md`` beside the ``.json``) from the recorded numbers, running no
    model: its title and command, and any note written after the table, are kept."""
    report = json.loads(result.read_text())
    page = result.with_suffix(".md")
    old = page.read_text()
    start, end = old.find("\nModel: "), old.find("\nPerplexity on this package's docs/")
    if start < 0 or end < 0:
        raise ValueError(f"{page} is not a page `python -m benchmarks tuning` wrote: no Model: / Perplexity lines")
    page.write_text(old[: start + 1] + markdown(report) + old[old.index("\n", end + 1) + 1 :])
    if (result.parent / "tuning.md").is_file():  # the summary beside it shows the same rows
        summary(result.parent)
    return page


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks tuning", description=__doc__.splitlines()[0])
    parser.add_argument("--tuned", type=Path, help="the tuned model's directory (python -m blend_integrations.tune)")
    parser.add_argument("--model", default="smollm2", help="the untuned model: smollm2, gemma3-270m or a directory")
    parser.add_argument("--backend", choices=("transformers", "vllm"), default="transformers")
    parser.add_argument("--questions", type=int, default=60)
    parser.add_argument("--prompts", type=int, default=48, help="calibration prompts, with --calibrate")
    parser.add_argument(
        "--doc-tokens", type=int, nargs=2, metavar=("MIN", "MAX"), help="documents' length (default: the model's task)"
    )
    parser.add_argument("--calibrate", action="store_true", help="calibrate the tuned model first")
    parser.add_argument("--ape", action="store_true", help="also read the untuned model with APE's recipe")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    parser.add_argument(
        "--render",
        type=Path,
        nargs="+",
        metavar="RESULT",
        help="rewrite these results' pages (tuning-BACKEND.json) from their recorded numbers; runs no model",
    )
    args = parser.parse_args(argv)
    if args.render:
        for result in args.render:
            if not result.is_file():
                parser.error(f"--render {str(result)!r}: no such result")
            print(f"written: {render(result)}")
        return
    if args.tuned is None:
        parser.error("--tuned is required (or --render, to rewrite pages from their results)")
    if not (args.tuned / "tuning.json").is_file():
        parser.error(f"--tuned {str(args.tuned)!r} is not a tuned model: it holds no tuning.json")
    if args.ape and args.backend != "transformers":
        parser.error("--ape reads the model with transformers: use --backend transformers")
    report = run(args)
    text = markdown(report)
    print(text)
    options = (" --calibrate" if args.calibrate else "") + (" --ape" if args.ape else "")
    command = f"`python -m benchmarks tuning --tuned DIR{options} --backend {args.backend}`"
    write_results(
        args.out, f"tuning-{args.backend}", "Tuning: the untuned and the tuned model", text, report, command=command
    )
    print(f"written: {summary(args.out)}")
