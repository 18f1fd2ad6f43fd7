"""Benchmarks: ``python -m blend_integrations.bench <part>``."""

import argparse
import random
from collections.abc import Callable

from ..prompt import BlendPrompt


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the benchmarks that time a random-weight model: its
    shape, the prompt's chunks, the rounds, dtype and device."""
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")


def shuffled_prompts(chunks: list[str], seed: int = 0) -> Callable[[], BlendPrompt]:
    """Prompts of the timing benches: the chunks in a new order at every call,
    between the same system text and question."""
    rng = random.Random(seed)
    prefix = "You are a helpful assistant. Answer from the documents."
    suffix = "Question: which company was founded in the river city, and when? Answer:"

    def prompt() -> BlendPrompt:
        order = chunks[:]
        rng.shuffle(order)
        return BlendPrompt(prefix, order, suffix)

    return prompt
