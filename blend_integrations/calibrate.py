"""Calibrate a model's recompute ratio on your documents and store it for every engine on the store.

    python -m blend_integrations.calibrate MODEL --store DIR [--documents PATH [PATH ...]] [--questions FILE]
                                           [--target 0.95]
    python -m blend_integrations.calibrate http://HOST:PORT --documents PATH [PATH ...]


Documents: a folder (each .txt or .md file in it is one document), a text
file (one document), or a .jsonl file (one document per line: a string, or an
object with a "text" field). Use the documents your application retrieves;
without --documents, the model's chunks already in the store are used.
Questions (``--questions``): your application's own, a text file of one
question per line, or a .jsonl file (a string, or an object with a
"question" field, per line); each probe asks one over the documents a BM25
retriever ranks first for it. Without them the probes ask made-up questions
about the documents.
The record goes into the store (disk, and Redis with --store-remote), keyed by
the model's fingerprint and dtype; engines with ``recompute_ratio="auto"``
(the default) use it from then on, in any process. Given the URL of a blend
server (``python -m blend_integrations.serve``), it calibrates the served
model over HTTP and stores the record in the server's store (the server's
API key, if any, from ``$BLEND_API_KEY``). See docs/calibration.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .calibration import LADDER, CalibrationError
from .config import KV_CODECS
from .store import ChunkStore

DOCUMENT_SUFFIXES = (".txt", ".md")


def read_documents(paths: list[str]) -> list[str]:
    """The documents in ``paths`` (see the module docstring); raises ValueError naming a bad path or line."""
    docs: list[str] = []
    for name in paths:
        path = Path(name).expanduser()
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.suffix in DOCUMENT_SUFFIXES and p.is_file())
            if not files:
                raise ValueError(f"{name}: no {' or '.join(DOCUMENT_SUFFIXES)} file in this folder")
            docs += [f.read_text(encoding="utf-8", errors="replace") for f in files]
        elif path.suffix == ".jsonl":
            docs += read_jsonl(path, name, "text")
        elif path.is_file():
            docs.append(path.read_text(encoding="utf-8", errors="replace"))
        else:
            raise ValueError(f"{name}: no such file or folder")
    return docs


def read_questions(name: str) -> list[str]:
    """The questions in ``name`` (see the module docstring); raises ValueError naming a bad path or line."""
    path = Path(name).expanduser()
    if not path.is_file():
        raise ValueError(f"{name}: no such file")
    if path.suffix == ".jsonl":
        questions = [q.strip() for q in read_jsonl(path, name, "question")]
    else:
        questions = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    questions = [q for q in questions if q]
    if not questions:
        raise ValueError(f"{name}: no question in it")
    return questions


def read_jsonl(path: Path, name: str, field: str) -> list[str]:
    """Each line of a .jsonl file that is not blank: a string, or an object with a ``field`` string."""
    values = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}:{i}: not JSON ({e.msg})") from None
        value = item.get(field) if isinstance(item, dict) else item
        if not isinstance(value, str):
            raise ValueError(f'{name}:{i}: expected a string or an object with a "{field}" string')
        values.append(value)
    return values


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m blend_integrations.calibrate", description=__doc__.splitlines()[0])
    parser.add_argument(
        "model", help="local checkpoint directory, .gguf file, hub id, or a blend server's http(s):// URL"
    )
    parser.add_argument("--store", help="chunk store directory (default: $BLEND_STORE_PATH or the user cache)")
    parser.add_argument("--store-remote", metavar="URL", help="Redis URL of the store's shared tier ('' for none)")
    parser.add_argument(
        "--kv-codec",
        choices=("raw", *KV_CODECS),
        default="raw",
        help="the codec the store keeps chunk KV in: a calibration holds under its own codec",
    )
    parser.add_argument(
        "--documents",
        nargs="+",
        metavar="PATH",
        help="folders or files of documents (default: the model's chunks already in the store)",
    )
    parser.add_argument(
        "--questions",
        metavar="FILE",
        help="your application's own questions (one per line, or .jsonl), asked over the documents retrieved for "
        "each (default: questions made up about the documents)",
    )
    parser.add_argument("--target", type=float, default=0.95, help="agreement with full prefill to hold, in (0, 1]")
    parser.add_argument("--confidence", type=float, default=0.8, help="of the lower bound the target is held at")
    parser.add_argument("--prompts", type=int, default=48, help="probe prompts")
    parser.add_argument(
        "--min-speedup", type=float, default=1.1, help="choose full prefill unless blend is measured this much sooner"
    )
    parser.add_argument("--tokens", type=int, default=4, help="greedy tokens that must agree with full prefill's")
    parser.add_argument("--ratios", type=float, nargs="+", default=list(LADDER), help="the ladder measured")
    parser.add_argument("--backend", choices=("transformers", "vllm"), default="transformers")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", metavar="PNG", help="write agreement and TTFT speedup against the ratio here")
    parser.add_argument(
        "--exhaustive", action="store_true", help="measure every policy on every probe (slower; the same choice)"
    )
    parser.add_argument(
        "--journal",
        metavar="FILE",
        help="append each reply measured here; run again with it, a calibration stopped midway resumes",
    )
    parser.add_argument(
        "--variants",
        nargs="*",
        metavar="JSON",
        help="blend settings tried besides the engine's own, each a JSON object such as '{\"check_layers\": [1, 2]}' "
        "(default: gradual check layers, the other selection, the other deviation, sink tokens; "
        "none given: only the engine's own)",
    )
    args = parser.parse_args(argv)
    variants = None
    if args.variants is not None:
        try:
            variants = [json.loads(v) for v in args.variants]
        except json.JSONDecodeError as e:
            parser.error(f"--variants: not JSON ({e.msg})")
        if not all(isinstance(v, dict) for v in variants):
            parser.error("--variants: each must be a JSON object of blend settings")
    for name in ("target", "confidence"):
        if not 0.0 < getattr(args, name) <= 1.0:
            parser.error(f"--{name} must be in (0, 1], got {getattr(args, name)}")
    try:
        documents = None if args.documents is None else read_documents(args.documents)
    except (OSError, ValueError) as e:
        parser.error(f"--documents: {e}")
    try:
        questions = None if args.questions is None else read_questions(args.questions)
    except (OSError, ValueError) as e:
        parser.error(f"--questions: {e}")

    from .engines import load_engine
    from .engines.server_engine import ServerError

    options = dict(
        target=args.target,
        confidence=args.confidence,
        num_prompts=args.prompts,
        tokens=args.tokens,
        ratios=args.ratios,
        variants=variants,
        seed=args.seed,
        min_speedup=args.min_speedup,
        plot=args.plot,
        exhaustive=args.exhaustive,
        questions=questions,
        journal=args.journal,
    )
    if args.model.startswith(("http://", "https://")):
        if args.store is not None or args.store_remote is not None or args.kv_codec != "raw":
            parser.error(
                "--store, --store-remote and --kv-codec are the server's own: it stores the record in its store"
            )
        try:
            load_engine(args.model, backend="server").calibrate(documents, **options)
        except (CalibrationError, ServerError) as e:
            sys.exit(f"calibration failed: {e}")
        print(f"stored in the store of the server at {args.model}")
        return
    with ChunkStore(
        args.store, remote=args.store_remote, kv_codec=None if args.kv_codec == "raw" else args.kv_codec
    ) as store:
        engine = load_engine(args.model, backend=args.backend, store=store, dtype=args.dtype, device=args.device)
        try:
            engine.calibrate(documents, **options)
        except CalibrationError as e:
            sys.exit(f"calibration failed: {e}")
        finally:
            close = getattr(engine, "close", None)
            if close is not None:
                close()
    print(f"stored in {store.path}" + (f" and {args.store_remote}" if args.store_remote else ""))


if __name__ == "__main__":
    main()
