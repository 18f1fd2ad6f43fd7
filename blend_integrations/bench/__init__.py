"""Benchmarks: ``python -m blend_integrations.bench <part>``."""

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

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


def write_results(out: str | Path, part: str, title: str, text: str, report: dict, *, command: str | None = None,
                  extra: str = "") -> Path:
    """A part's results under ``out``: ``{part}.json`` (the report) and
    ``{part}.md`` (title, the command that made it, the rendered text)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{part}.json").write_text(json.dumps(report, indent=2) + "\n")
    command = command or f"`make bench` (or `python -m blend_integrations.bench {part}`)."
    (out / f"{part}.md").write_text(f"# {title}\n\nCommand: {command}\n\n{text}\n{extra}")
    print(f"\nwritten: {out / (part + '.md')}, {out / (part + '.json')}")
    return out
