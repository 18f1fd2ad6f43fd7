"""KV codecs and answer quality: each codec's store beside the raw store, on held-out questions.

    python -m benchmarks codecs [--model reader|smollm2] [--backend transformers|vllm]
                                [--questions 300] [--calibrate] [--prompts 48]

For a raw store and one of each codec (``ChunkStore(kv_codec=...)``), on the
quality benchmark's held-out questions (``quality.HELD_OUT_SEED``): the bytes
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
changes the choice (``CalibrationRecord.codecs_checked``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from blend_integrations.engines import load_engine
from blend_integrations.quality.metrics import contains, exact_match, normalize
from blend_integrations.store import KV_CODECS, ChunkStore
from training.data import make_examples

from . import machine, write_results
from .calibration import CALIBRATION_SEED
from .quality import HELD_OUT_SEED, model_and_task, results_name

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


def run(args) -> dict:
    model_dir, task, label = model_and_task(args.model)
    held_out = make_examples(args.questions, seed=HELD_OUT_SEED, doc_tokens=task.doc_tokens)
    calibration_set = make_examples(args.prompts, seed=CALIBRATION_SEED, doc_tokens=task.doc_tokens)
    right = exact_match if task.accuracy == "em" else contains
    started = time.perf_counter()
    reference: list[tuple[list[int], str]] = []  # full prefill's tokens and answer, per question
    calibrated: dict | None = None  # the raw store's calibrated options, applied to every store
    rows, choices, config = {}, {}, {}
    raw_store = None
    for codec in CODECS:
        store = ChunkStore(tempfile.mkdtemp(prefix=f"blend-codecs-{codec_name(codec)}-"), remote="", kv_codec=codec)
        with load_engine(str(model_dir), store=store, backend=args.backend) as engine:
            keys = [
                engine.chunk_key(engine.tokenizer.encode(d, add_special_tokens=False))
                for d in sorted({d for e in held_out for d in e.documents})
            ]
            prompts = [task.prompt(e, engine.tokenizer, engine.config.separator) for e in held_out]
            if args.calibrate:
                asked = [task.prompt(e, engine.tokenizer, engine.config.separator) for e in calibration_set]
                record = engine.calibrate(prompts=asked, num_prompts=args.prompts)
                choices[codec_name(codec)] = {"ratio": record.ratio, "settings": record.settings, **policy(record)}
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
            f"- {name}: ratio {c['ratio']}, settings {c['settings']}" for name, c in report["calibrations"].items()
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks codecs", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="reader", help="reader (the default), smollm2, or a checkpoint directory")
    parser.add_argument("--backend", default="transformers", choices=("transformers", "vllm"))
    parser.add_argument("--questions", type=int, default=300)
    parser.add_argument("--calibrate", action="store_true", help="calibrate each store on the calibration documents")
    parser.add_argument("--prompts", type=int, default=48, help="calibration prompts (with --calibrate)")
    parser.add_argument("--quick", action="store_true", help="8 questions, results not written")
    parser.add_argument("--out", default="docs/results", help="directory for the results ('' to skip)")
    args = parser.parse_args(argv)
    if args.quick:
        args.questions = 8
    report = run(args)
    text = markdown(report)
    print(text)
    if args.out and not args.quick:
        options = f" --model {args.model} --backend {args.backend} --questions {args.questions}"
        options += " --calibrate" if args.calibrate else ""
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
