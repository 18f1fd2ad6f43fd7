"""``python -m blend_integrations.tune MODEL --documents PATH... --out DIR``: tune a model to read chunks alone.

``--recipe squad`` takes no documents: it asks SQuAD train's questions about its own paragraphs."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from tqdm.auto import tqdm

from ..engines.vllm_host import restart_on_tcmalloc
from .distill import TuneError, TuneOptions, option_flag, resumed_options, tune
from .prompts import DocumentsError

HELP = {
    "steps": "optimizer steps in all (with --resume: in place of the checkpoint's)",
    "rank": "LoRA rank",
    "alpha": "LoRA alpha (the adapters' scale is alpha / rank)",
    "learning_rate": "AdamW learning rate",
    "lr_schedule": "constant, or cosine: from --learning-rate down to 0 at the last step",
    "batch_size": "prompts per step",
    "seq_len": "the longest prompt plus reply, in tokens",
    "chunks_per_prompt": "chunks in each prompt",
    "chunk_tokens": "about how many tokens a chunk has",
    "reply_tokens": "tokens of the untuned model's reply the KL is taken on",
    "recipe": "how questions are made: from the documents, sentence (how a sentence goes on) or cloze (a missing "
    "word); or squad: SQuAD train's questions about its own paragraphs (no --documents)",
    "full_weight": "weight of the full reading's KL beside the block reading's",
    "prompts": "training prompts",
    "held_out": "held-out prompts for the KL shown while training",
    "eval_every": "steps between held-out KL measurements",
    "checkpoint_every": "steps between checkpoints",
    "target": "stop once the held-out block KL is at most this",
    "dtype": "auto: bfloat16 on CUDA and on CPUs with bfloat16 instructions, else float32",
    "device": "auto, cpu or cuda",
    "seed": "seed of the prompts and the adapters",
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m blend_integrations.tune", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="checkpoint directory, .gguf file or hub id of the model to tune")
    parser.add_argument(
        "--documents", nargs="+", default=[], metavar="PATH", help="text files or folders (not with --recipe squad)"
    )
    parser.add_argument("--out", required=True, help="directory of the tuned model (must not exist)")
    parser.add_argument("--questions", metavar="FILE", help="questions, one per line (default: the recipe's)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the checkpoint in OUT.partial with its options (any given must equal them, --steps aside)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    defaults = TuneOptions()
    for f in dataclasses.fields(TuneOptions):
        # SUPPRESS: an option left out is absent from args, so --resume can tell it from one given
        kind = {"int": int, "float": float}.get(str(f.type), float if f.name == "target" else str)
        text = HELP[f.name] + (f" (default {defaults.steps})" if f.name == "steps" else "")
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=argparse.SUPPRESS, help=text)
    args = parser.parse_args(argv)
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(TuneOptions) if hasattr(args, f.name)}
    try:
        if args.resume:
            options = resumed_options(args.out, given)
            kept = [
                option_flag(f.name, getattr(options, f.name))
                for f in dataclasses.fields(options)
                if f.name not in given
            ]
            if kept:  # what the run goes on with that the command line did not say
                print(f"resuming with the checkpoint's {', '.join(kept)}", file=sys.stdout)
        else:
            options = TuneOptions(**given)
        questions = []
        if args.questions:
            questions = [q.strip() for q in Path(args.questions).read_text().splitlines() if q.strip()]
            if not questions:
                raise DocumentsError(f"{args.questions!r} holds no question")
        result = tune(
            args.model,
            args.documents,
            args.out,
            options=options,
            questions=questions,
            resume=args.resume,
            progress=not args.no_progress,
            on_eval=lambda step, block, full: tqdm.write(
                f"step {step}: held-out KL block {block:.4f}, full {full:.4f}"
            ),
        )
    except (TuneError, DocumentsError, ValueError, OSError) as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    first, last = result.held_out_kl[0], result.held_out_kl[-1]
    print(
        f"tuned {result.steps} steps in {result.seconds:.0f} s: held-out KL of the block reading "
        f"{first[1]:.4f} -> {last[1]:.4f}, of the full reading {first[2]:.4f} -> {last[2]:.4f}; wrote {result.out}",
        file=sys.stdout,
    )


if __name__ == "__main__":
    # On glibc's malloc a tuning's resident memory grows step by step (prompts of every length fragment
    # its arenas); on tcmalloc it stays near the longest prompt's peak (docs/blend-ready.md).
    restart_on_tcmalloc("blend_integrations.tune", sys.argv[1:])
    main()
