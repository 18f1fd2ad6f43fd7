"""``python -m blend_integrations.ui [--model M] [--backend vllm|transformers] [--documents DIR] [--port 7860]``:
the demo page (docs/ui.md)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ..store import ChunkStore
from .session import EXAMPLE_DOCUMENTS, DemoSession, load_documents


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m blend_integrations.ui", description=__doc__)
    parser.add_argument(
        "--model",
        help="a packaged model (smollm2, gemma3-270m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b; `make ui` runs "
        "qwen2.5-coder-1.5b), checkpoint directory, GGUF file or hub id (default: SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--backend", default="vllm", choices=["vllm", "transformers"])
    parser.add_argument(
        "--documents",
        type=Path,
        default=EXAMPLE_DOCUMENTS if EXAMPLE_DOCUMENTS.is_dir() else None,
        help="folder of .txt/.md documents to choose from (default: the examples' documents in a checkout)",
    )
    parser.add_argument("--store", help="chunk store directory (default: the user cache, shared with the chains)")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per answer (default: 48)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=7860)
    args = parser.parse_args(argv)
    if args.max_tokens < 1:
        parser.error(f"--max-tokens must be a positive integer, got {args.max_tokens}")
    if not 0 < args.port < 65536:
        parser.error(f"--port must be in 1..65535, got {args.port}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        documents = load_documents(args.documents) if args.documents is not None else {}
    except (OSError, ValueError) as exc:
        sys.exit(f"--documents: {exc}")
    model, label = args.model, args.model
    if model is None:
        from ..models.smollm2 import smollm2_dir

        model, label = str(smollm2_dir()), "SmolLM2-135M-Instruct"
    else:
        from ..models.packaged import MODELS

        if model in MODELS:  # a packaged model by its name: the page says what it is
            label = MODELS[model].label.split(" (")[0]
    options = {"max_model_len": 2048, "kv_cache_gib": 1} if args.backend == "vllm" else {}
    store = ChunkStore(args.store) if args.store else None
    session = DemoSession(
        model, backend=args.backend, store=store, max_tokens=args.max_tokens, engine_options=options, label=label
    )
    session.start()
    from .page import build_page, serve  # Gradio loads while the model does

    page = build_page(session, documents)
    serve(page, session, args.host, args.port, footer_links=[])
    print(f"blend demo page: http://{args.host}:{args.port}  (documents: {len(documents)})", flush=True)
    page.block_thread()


if __name__ == "__main__":
    main()
