"""What the RAG examples share: their command line, their documents and
question, and the comparison they print (the answers, cache statistics and
time to first token, full prefill against blend).

    python examples/langchain_rag.py [--model PATH_OR_HUB_ID] [--backend transformers|vllm] [--store DIR]
                                     [--documents DIR] [--question TEXT] [--recompute-ratio R] [--calibrate]
    python examples/llamaindex_rag.py [the same options]

Without --model they run SmolLM2-135M-Instruct (Apache-2.0), taken from the
package index and converted once (blend_integrations.models.smollm2). Any
model of the nine supported families (Llama, Mistral, Qwen2, Qwen3, Gemma 2,
Gemma 3, Phi-3, OLMo 2, Granite) works. The eight short documents in
examples/data are made up for these examples: companies, their founders, and
where each was born; --documents takes a folder of your own .txt files.

Blend runs with ``recompute_ratio="auto"`` unless --recompute-ratio sets one:
the ratio calibrated on your documents if the store holds one, else the
calibration the package ships for its models (SmolLM2 among them), else 0.15.
--calibrate measures it on the documents first (minutes on 2 CPUs).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from blend_integrations.calibration import settings_label
from blend_integrations.config import FALLBACK_RATIO, parse_ratio
from blend_integrations.quality.metrics import contains

DATA = Path(__file__).resolve().parent / "data"
QUESTION, EXPECTED = "In which city was Ada Okafor born?", "Brimford"
SOURCES = {
    "calibrated": "calibrated on your documents (the store's record)",
    "packaged": "the calibration shipped with the package for this model on the {backend} engine",
    "fallback": "no calibration for this model: the fallback ratio",
    "request": "--recompute-ratio",
    "guard": "the calibrated guard raised it for this prompt",
}


def default_model() -> str:
    """SmolLM2-135M-Instruct, fetched from the package index and converted once (``make install`` does it)."""
    from blend_integrations.models.smollm2 import smollm2_dir

    return str(smollm2_dir())


def ratio(text: str) -> float | str:
    """--recompute-ratio's value, refused here with the reason rather than after the model loads."""
    try:
        return parse_ratio(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def document_folder(text: str) -> Path:
    """--documents' value: a folder holding at least one non-empty .txt file, refused here before the model loads."""
    folder = Path(text).expanduser()
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a folder")
    if not any(p.read_text(errors="replace").strip() for p in folder.glob("*.txt")):
        raise argparse.ArgumentTypeError(f"{text!r} holds no non-empty .txt document to answer from")
    return folder


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--model",
        help="a packaged model (smollm2, gemma3-270m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b), checkpoint directory, "
        "GGUF file or hub id; default: SmolLM2-135M-Instruct (see above)",
    )
    parser.add_argument("--backend", default="transformers", choices=["transformers", "vllm"])
    parser.add_argument("--store", help="chunk store directory (default: the user cache)")
    parser.add_argument(
        "--documents", type=document_folder, default=DATA, help="folder of .txt documents (default: examples/data)"
    )
    parser.add_argument("--question", default=QUESTION, help=f"the question (default: {QUESTION!r})")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--recompute-ratio",
        type=ratio,
        help='share of the reused chunk tokens that blend recomputes, or "auto" (the default: the calibrated '
        "ratio, docs/calibration.md)",
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="calibrate the model on the documents at ingestion unless the store already holds your calibration "
        "(minutes on 2 CPUs); without it, the packaged calibration is used",
    )
    return parser.parse_args()


@contextlib.contextmanager
def starting(backend: str) -> Iterator[None]:
    """Print how long the engine took to start (model load, and on vLLM its
    engine process and KV cache), apart from the times to first token."""
    print(f"starting the {backend} engine ...", flush=True)
    started = time.perf_counter()
    yield
    print(f"engine started in {time.perf_counter() - started:.1f} s", flush=True)


def describe_ratio(engine: Any) -> None:
    """Say which ratio ``"auto"`` gives, where it comes from, and what it means for this model, measured."""
    source, record = engine.calibration_source(), engine.calibration()
    if record is None:
        print(f'recompute_ratio="auto": {FALLBACK_RATIO} ({SOURCES["fallback"]})')
        return
    choice = record.choice()  # the guard's base ratio and settings, when it has one
    settings = f", {settings_label(choice.settings or record.settings)} settings" if choice.ratio < 1.0 else ""
    guard = f", raised per request by its guard (threshold {record.guard.threshold})" if record.guard else ""
    print(f'recompute_ratio="auto": {choice.ratio}{settings}{guard} ({SOURCES[source].format(backend=engine.backend)})')
    if record.dtype != engine.dtype_name:  # e.g. a bfloat16 checkpoint on a CPU without bfloat16 instructions
        print(f"measured in {record.dtype}, run here in {engine.dtype_name}: one calibration serves both")
    if source == "calibrated":
        print(
            f"calibrated on {record.n} probe prompts in {record.seconds:.0f} s; target {record.target} agreement "
            "with full prefill"
            + ("" if record.meets_target else " (not met below 1.0: blending recomputes everything)")
        )
    meaning = engine.calibration_meaning()
    if meaning:
        print(f"what it means: {meaning}")


def compare(
    modes: dict[str, Callable[[str], Any]],
    question: str,
    *,
    retrieved: Callable[[Any], list[str]],
    answer: Callable[[Any], str],
    stats: Callable[[Any], dict],
) -> None:
    """Ask ``question`` in every mode (``"full"`` first, then blends by name),
    four rounds taking turns (the first warms up, TTFT is the median of the
    others), and print the last round's answers beside their TTFTs. ``retrieved``,
    ``answer`` and ``stats`` read a result: its sources, its text, and its
    ``Generation.stats()``."""
    rounds = [{name: ask(question) for name, ask in modes.items()} for _ in range(4)]
    ttft = {name: statistics.median(stats(r[name])["ttft_s"] for r in rounds[1:]) for name in modes}
    last = rounds[-1]
    print(f"question: {question}")
    print(f"retrieved: {retrieved(last['full'])}")
    width = max(len(name) for name in modes)
    for name in modes:
        numbers = stats(last[name])
        sooner = "" if name == "full" else f", {ttft['full'] / ttft[name]:.2f}x sooner"
        print(f"{name:<{width}}  TTFT {1000 * ttft[name]:5.0f} ms{sooner}: {answer(last[name]).strip()!r}")
        if name != "full":
            print(
                f"{'':<{width}}  ratio {numbers['recompute_ratio']} ({numbers['ratio_source']}): of "
                f"{numbers['prompt_tokens']} prompt tokens, {numbers['cached_tokens']} read from the chunk cache "
                f"({numbers['chunks_hit']}/{numbers['chunks_hit'] + numbers['chunks_missed']} chunks), "
                f"{numbers['recomputed_tokens']} of them recomputed"
            )
    if question == QUESTION:
        right = {name: contains(answer(last[name]), EXPECTED) == 1.0 for name in modes}
        print(f"expected answer: {EXPECTED!r}; " + ", ".join(f"{name} right: {ok}" for name, ok in right.items()))


def blend_modes(engine: Any, requested: float | str | None, make: Callable[[dict], Callable[[str], Any]]) -> dict:
    """The modes to compare: full prefill, blend at the requested ratio (``"auto"`` when None), and, where
    that is another ratio, blend at the fallback 0.15 beside it, to show the speed and what it costs.
    ``make(options)``: a question -> result callable with those generation options."""
    modes = {"full": make({"mode": "full"}), "blend": make({})}
    record = engine.calibration()
    ratio = (
        requested if requested not in (None, "auto") else (FALLBACK_RATIO if record is None else record.choice().ratio)
    )
    if ratio != FALLBACK_RATIO:
        modes[f"blend@{FALLBACK_RATIO}"] = make({"recompute_ratio": FALLBACK_RATIO})
    return modes
