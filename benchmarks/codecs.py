"""KV codecs and answer quality: each codec's store beside the raw store, on held-out questions.

    python -m benchmarks codecs [--model reader|smollm2] [--backend transformers|vllm]
                                [--questions 300] [--calibrate [--package]] [--prompts 48]

For a raw store and one of each codec (``ChunkStore(kv_codec=...)``), on the
quality benchmark's held-out questions (``quality.DEVELOPMENT_SEED``): the bytes
the store keeps per token, whether blending at ratio 1.0 is still exactly
full prefill, and at 0.15 and at the calibrated setting the agreement with
full prefill (the whole answer, as the quality benchmark compares it, and
its first 4 tokens) and the share answered right (exact match for the
reader, the answer contained for a chat model). Full prefill never reads
the store, so it is run once, on the raw store, as every codec's reference.

The calibrated setting: the model's calibration for the raw store (the one
this package ships, or with ``--calibrate`` one measured here on the
calibration documents), applied to every store; with ``--calibrate`` each
codec's store is also calibrated on its own, to show whether its codec
changes the choice. ``--package`` then writes the codecs whose own choice
is the packaged calibration's into that file's ``codecs_checked``, so that
``recompute_ratio="auto"`` uses the packaged record in their stores too; only
when the raw store's calibration here chose the packaged policy as well (it
is measured on the same prompts), else nothing is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

from blend_integrations.calibration.packaged import PACKAGED_DIR, PackagedCalibration, packaged_name
from blend_integrations.engines import load_engine
from blend_integrations.quality.metrics import contains, exact_match, normalize
from blend_integrations.store import KV_CODECS, ChunkStore

from . import UNCHECKED, machine, scratch_dir, write_results
from .calibration import CALIBRATION_SEED, SHIPPED
from .quality import DEVELOPMENT_SEED, model_and_task, results_name

TOKENS = 4  # the first greedy tokens compared with full prefill
CODECS: tuple[str | None, ...] = (None, *KV_CODECS)


def codec_name(codec: str | None) -> str:
    return codec or "raw"


def policy(record) -> dict:
    """What a calibration chose, as request options (``recompute_ratio`` and the settings)."""
    if record is None:
        return {}
    choice = record.choice()
    return {"recompute_ratio": choice.ratio, **(choice.settings or {})}


def chosen(record) -> dict:
    """A calibration's choice (its ratio, guard and settings), to compare two calibrations by."""
    choice = record.choice()
    guard = None if choice.guard is None else dataclasses.asdict(choice.guard)
    return {"ratio": choice.ratio, "guard": guard, "settings": choice.settings or {}}


def write_checked(choices: dict, model: str, backend: str, directory: Path = PACKAGED_DIR) -> list[str]:
    """Mark the codecs whose calibration chose the packaged one's policy in the packaged file
    (``codecs_checked``), if the raw store's calibration here chose it too; the codecs written."""
    path = Path(directory) / packaged_name(results_name(model), backend)
    packaged = PackagedCalibration.from_bytes(path.read_bytes(), path)
    shipped = chosen(packaged.record)
    if choices["raw"]["choice"] != shipped:
        print(f"not written: the raw store chose {choices['raw']['choice']} here, {path.name} {shipped}")
        return []
    same = sorted(name for name, c in choices.items() if name != "raw" and c["choice"] == shipped)
    record = dataclasses.replace(packaged.record, codecs_checked=same)
    path.write_bytes(dataclasses.replace(packaged, record=record).to_bytes())
    print(f"{path.name}: codecs_checked {same}")
    return same


def run(args) -> dict:
    model_dir, task, label = model_and_task(args.model)
    held_out = task.examples(args.questions, DEVELOPMENT_SEED)
    calibration_set = task.examples(args.prompts, CALIBRATION_SEED)
    right = exact_match if task.accuracy == "em" else contains
    started = time.perf_counter()
    reference: list[tuple[list[int], str]] = []  # full prefill's tokens and answer, per question
    calibrated: dict | None = None  # the raw store's calibrated options, applied to every store
    rows, choices, config = {}, {}, {}
    raw_store = None
    for codec in CODECS:
        store = ChunkStore(scratch_dir(f"blend-codecs-{codec_name(codec)}-"), remote="", kv_codec=codec)
        with load_engine(str(model_dir), store=store, backend=args.backend, config=UNCHECKED) as engine:
            keys = [
                engine.chunk_key(engine.tokenizer.encode(d, add_special_tokens=False))
                for d in sorted({d for e in held_out for d in e.documents})
            ]
            prompts = [task.prompt(e, engine.tokenizer, engine.config.separator) for e in held_out]
            if args.calibrate:
                asked = [task.prompt(e, engine.tokenizer, engine.config.separator) for e in calibration_set]
                record = engine.calibrate(prompts=asked, num_prompts=args.prompts)
                choices[codec_name(codec)] = {
                    "ratio": record.ratio,
                    "settings": record.settings,
                    "choice": chosen(record),
                }
            else:
                record = engine.calibration()
            if calibrated is None:
                calibrated = policy(record) or {"recompute_ratio": 1.0}
                config["calibrated"] = calibrated
            if raw_store is None:
                engine.warm([d for e in held_out for d in e.documents], progress=True)
                raw_store = ChunkStore(store.path, memory_limit_bytes=0, remote="")
            else:  # the raw store's chunks, coded: what warming computes is the same for every codec
                for key in keys:
                    store.put(raw_store.get(key))
            modes = {"r=1": {"recompute_ratio": 1.0}, "blend@0.15": {"recompute_ratio": 0.15}}
            modes |= {"calibrated": calibrated}
            results: dict[str, list[dict]] = {m: [] for m in modes if m != "r=1"}
            exact = 0
            for i, (example, tp) in enumerate(zip(held_out, prompts)):
                if codec is None:
                    full = engine.generate(tp, max_tokens=task.max_tokens, mode="full")
                    reference.append((full.token_ids, normalize(full.text)))
                ids, text = reference[i]
                for mode, options in modes.items():
                    gen = engine.generate(tp, max_tokens=task.max_tokens, **options)
                    if mode == "r=1":
                        exact += gen.token_ids == ids
                        continue
                    results[mode].append(
                        {
                            "agree": normalize(gen.text) == text,
                            "agree_tokens": gen.token_ids[:TOKENS] == ids[:TOKENS],
                            "right": right(gen.text, example.answer),
                        }
                    )
            disk = ChunkStore(store.path, memory_limit_bytes=0, remote="", kv_codec=codec)
            located = [disk.locate(k) for k in keys]
            tokens = sum(disk.get(k).num_tokens for k in keys)
            rows[codec_name(codec)] = {
                "bytes_per_token": round(sum(where.nbytes for where in located) / max(1, tokens), 1),
                "ratio_one_exact": f"{exact}/{len(held_out)}",
                **{
                    f"{mode} {metric}": round(statistics.fmean(float(r[metric]) for r in rs), 4)
                    for mode, rs in results.items()
                    for metric in ("agree", "agree_tokens", "right")
                },
            }
            if codec is None:
                config["machine"] = machine(engine if args.backend == "vllm" else None)
                config["dtype"] = engine.dtype_name
    return {
        "config": {
            "model": label,
            "backend": args.backend,
            "questions": len(held_out),
            "tokens_compared": TOKENS,
            "minutes": round((time.perf_counter() - started) / 60, 1),
            "date": time.strftime("%Y-%m-%d"),
            **config,
        },
        "codecs": rows,
        "calibrations": choices,
    }


def markdown(report: dict) -> str:
    cfg = report["config"]
    raw = report["codecs"]["raw"]
    lines = [
        f"Model: {cfg['model']} ({cfg['dtype']}) on the {cfg['backend']} engine; {cfg['machine']}; "
        f"{cfg['questions']} held-out questions; calibrated setting {cfg['calibrated']}; "
        f"{cfg['minutes']} min; {cfg['date']}.",
        "",
        "| store | bytes / token | of raw | r=1 exact | 0.15: agrees | first 4 tokens | right | "
        "calibrated: agrees | first 4 tokens | right |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in report["codecs"].items():
        lines.append(
            f"| {name} | {r['bytes_per_token']:.0f} | {r['bytes_per_token'] / raw['bytes_per_token']:.3f} | "
            f"{r['ratio_one_exact']} | {r['blend@0.15 agree']:.3f} | {r['blend@0.15 agree_tokens']:.3f} | "
            f"{r['blend@0.15 right']:.3f} | {r['calibrated agree']:.3f} | {r['calibrated agree_tokens']:.3f} | "
            f"{r['calibrated right']:.3f} |"
        )
    if report["calibrations"]:
        lines += ["", "Each store calibrated on its own (the calibration documents):", ""]
        lines += [
            f"- {name}: ratio {c['ratio']}, settings {c['settings']}; chosen: {c['choice']}"
            for name, c in report["calibrations"].items()
        ]
    if "codecs_checked" in cfg:
        lines += ["", f"Written to the packaged calibration's `codecs_checked`: {cfg['codecs_checked']}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks codecs", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="reader", help="reader (the default), smollm2, or a checkpoint directory")
    parser.add_argument("--backend", default="transformers", choices=("transformers", "vllm"))
    parser.add_argument("--questions", type=int, default=300)
    parser.add_argument("--calibrate", action="store_true", help="calibrate each store on the calibration documents")
    parser.add_argument("--prompts", type=int, default=48, help="calibration prompts (with --calibrate)")
    parser.add_argument(
        "--package",
        action="store_true",
        help="with --calibrate: write the codecs that choose the packaged calibration's policy into its codecs_checked",
    )
    parser.add_argument("--quick", action="store_true", help="8 questions, results not written")
    parser.add_argument("--out", default="docs/results", help="directory for the results ('' to skip)")
    args = parser.parse_args(argv)
    if args.package and not (args.calibrate and args.prompts == 48 and results_name(args.model) in SHIPPED):
        parser.error(
            f"--package needs --calibrate at the default --prompts, for a shipped model ({', '.join(SHIPPED)})"
        )
    if args.quick:
        args.questions = 8
    report = run(args)
    if args.package:
        report["config"]["codecs_checked"] = write_checked(report["calibrations"], args.model, args.backend)
    text = markdown(report)
    print(text)
    if args.out and not args.quick:
        options = f" --model {args.model} --backend {args.backend} --questions {args.questions}"
        options += " --calibrate" if args.calibrate else ""
        options += " --package" if args.package else ""
        write_results(
            args.out,
            f"codecs-{results_name(args.model)}-{args.backend}",
            f"KV codecs and answer quality: {report['config']['model']}, {args.backend} engine",
            text,
            report,
            command=f"`python -m benchmarks codecs{options}`.",
        )


if __name__ == "__main__":
    main()
