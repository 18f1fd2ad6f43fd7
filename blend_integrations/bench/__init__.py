"""Benchmarks: ``python -m blend_integrations.bench <part>``."""

import argparse


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
