"""The offline GPU kit (benchmarks/gpu_kit.py, gpu_kit_build.py) built from a small wheel laid out as
vLLM's CUDA wheel: fake compiled files in vLLM's places, its dist-info, and this package's entry point.
The real kit is built by `make gpu-kit` (docs/offline-gpu.md)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import zipfile
from pathlib import Path

import pytest

from benchmarks import gpu_kit, gpu_kit_build, vllm_ttft
from benchmarks.gpu_kit import MIB, KitError, Machine, check, compare_versions, unpack
from benchmarks.gpu_kit_build import DROPPED, build_kit

CARRY = 64 * 1024  # bytes per carry folder: the fake compiled files make four pieces
# the lent H200 machine's versions as pip lists them (.library/device/KINDS.md): not the torch vLLM pins
H200 = Machine(python="3.12.3", torch="2.11.0", triton="3.6.0")
BUILT_FOR = {
    "python": "3.12",
    "python_tags": ["cp312-cp312", "cp38-abi3", "py3-none"],
    "torch": "2.13.0",
    "triton": None,
}

# (path in the wheel, bytes; None: text), vLLM's layout in small
FILES = {
    "vllm/__init__.py": b"__version__ = '0.32.0'\n",
    "vllm/_C_stable_libtorch.abi3.so": 120_000,
    "vllm/cumem_allocator.abi3.so": 20_000,
    "vllm/_moe_C_stable_libtorch.abi3.so": 30_000,
    "vllm/vllm-rs": 30_000,
    "vllm/vllm_flash_attn/__init__.py": b"",
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": 40_000,
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": 60_000,
    "vllm/third_party/__init__.py": b"",
    "vllm/third_party/pynvml.py": b"# kept\n",
    "vllm/third_party/deep_gemm/__init__.py": b"",
    "vllm/third_party/deep_gemm/_C_extension.abi3.so": 10_000,
    "vllm/third_party/fmha_sm100/api.py": b"# Blackwell\n",
    "vllm/_qutlass_C.abi3.so": 5_000,
}


def fake_wheel(path: Path, files: dict, dist_info: str, metadata: str, extra: dict | None = None) -> Path:
    """A zip file as a wheel: its files (random bytes for the compiled ones), METADATA and RECORD."""
    rng = __import__("random").Random(0)
    contents = {name: data if isinstance(data, bytes) else rng.randbytes(data) for name, data in files.items()}
    contents |= {f"{dist_info}/METADATA": metadata.encode(), f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\n"}
    contents |= extra or {}
    record = "".join(f"{n},sha256={hashlib.sha256(d).hexdigest()},{len(d)}\n" for n, d in contents.items())
    contents[f"{dist_info}/RECORD"] = (record + f"{dist_info}/RECORD,,\n").encode()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in contents.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (0o755 if name.endswith(("vllm-rs", ".so")) else 0o644) << 16
            z.writestr(info, data)
    return path


@pytest.fixture
def wheels(tmp_path):
    vllm = fake_wheel(
        tmp_path / gpu_kit_build.VLLM_WHEEL,
        FILES,
        "vllm-0.32.0.dist-info",
        "Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\nRequires-Dist: torch==2.13.0\n"
        'Requires-Dist: triton==9.9.9; extra == "bench"\n',  # an extra's pin is not the kit's
    )
    entry = b"[vllm.general_plugins]\nblend_integrations = blend_integrations.engines.vllm_plugin:register\n"
    own = fake_wheel(
        tmp_path / "blend_integrations-9.9.9-py3-none-any.whl",
        {"blend_integrations/__init__.py": b""},
        "blend_integrations-9.9.9.dist-info",
        "Metadata-Version: 2.1\nName: blend_integrations\nVersion: 9.9.9\n",
        {"blend_integrations-9.9.9.dist-info/entry_points.txt": entry},
    )
    return vllm, own


@pytest.fixture
def kit(tmp_path, wheels):
    vllm, own = wheels
    manifest = build_kit(vllm, [], own, tmp_path / "kit", carry=CARRY, preset=0, with_redis=False)
    return tmp_path / "kit", manifest


def pieces(kit_dir: Path, manifest: dict) -> list[Path]:
    return [kit_dir / p["folder"] / p["name"] for p in manifest["pieces"]]


def test_each_carry_folder_holds_one_piece_within_its_size_and_the_manifest(kit):
    kit_dir, manifest = kit
    assert len(manifest["pieces"]) > 1
    folders = sorted(p.name for p in kit_dir.iterdir() if p.is_dir())
    assert folders == [chr(ord("a") + i) for i in range(len(manifest["pieces"]))]  # the build's work is gone
    for piece, path in zip(manifest["pieces"], pieces(kit_dir, manifest)):
        assert sorted(os.listdir(path.parent)) == sorted([path.name, "manifest.json"])
        assert path.stat().st_size == piece["bytes"] <= CARRY
        assert hashlib.sha256(path.read_bytes()).hexdigest() == piece["sha256"]
        assert json.loads((path.parent / "manifest.json").read_text()) == manifest
    joined = b"".join(p.read_bytes() for p in pieces(kit_dir, manifest))
    assert hashlib.sha256(joined).hexdigest() == manifest["kit_id"] == manifest["archive"]["sha256"]


def test_the_manifest_names_what_was_dropped_and_why(kit):
    _, manifest = kit
    in_wheel = [p for p in DROPPED if any(f == p or (p.endswith("/") and f.startswith(p)) for f in FILES)]
    assert [d["path"] for d in manifest["dropped"]] == in_wheel and len(in_wheel) == 6
    deep_gemm = next(d for d in manifest["dropped"] if d["path"] == "vllm/third_party/deep_gemm/")
    assert deep_gemm["files"] == 2 and deep_gemm["bytes"] == 10_000 and "DeepGEMM" in deep_gemm["why"]


def test_unpacking_reproduces_the_trimmed_tree(kit, wheels, tmp_path):
    kit_dir, _ = kit
    result = unpack(kit_dir, tmp_path / "target")
    site = tmp_path / "target" / "site"
    assert result["unpacked"] and result["versions"] == {"vllm": "0.32.0", "blend_integrations": "9.9.9"}
    with zipfile.ZipFile(wheels[0]) as z:
        for name in z.namelist():
            if gpu_kit_build.dropped(name):
                assert not (site / name).exists(), name
            elif not name.endswith("RECORD"):
                assert (site / name).read_bytes() == z.read(name), name
    assert os.access(site / "vllm" / "_C_stable_libtorch.abi3.so", os.X_OK)
    for gone in DROPPED:
        assert not (site / gone).exists()
    record = (site / "vllm-0.32.0.dist-info" / "RECORD").read_text()
    assert "_vllm_fa3_C" in record and "_vllm_fa2_C" not in record and "deep_gemm" not in record
    # vLLM's plugin entry point from this package's dist-info; the package itself is not in the tree
    ours = [
        e
        for d in importlib.metadata.distributions(path=[str(site)])
        for e in d.entry_points
        if e.group == "vllm.general_plugins"
    ]
    assert [e.value for e in ours] == ["blend_integrations.engines.vllm_plugin:register"]
    assert not (site / "blend_integrations").exists()
    again = unpack(kit_dir, tmp_path / "target")  # the same kit: nothing to do
    assert not again["unpacked"]


def test_a_damaged_piece_is_refused_by_name(kit, tmp_path):
    kit_dir, manifest = kit
    second = pieces(kit_dir, manifest)[1]
    data = bytearray(second.read_bytes())
    data[100] ^= 0xFF
    second.write_bytes(bytes(data))
    with pytest.raises(KitError, match=rf"piece b/{second.name} is damaged"):
        check(kit_dir)
    with pytest.raises(KitError, match=rf"piece b/{second.name} is damaged"):
        unpack(kit_dir, tmp_path / "target")
    assert not (tmp_path / "target").exists()
    second.write_bytes(bytes(data[:-1]))
    with pytest.raises(KitError, match=rf"piece b/{second.name} has {len(data) - 1} bytes"):
        check(kit_dir)


def test_a_missing_piece_is_refused_by_name_and_listed_when_partial(kit):
    kit_dir, manifest = kit
    last = pieces(kit_dir, manifest)[-1]
    last.unlink()
    folder = last.parent.name
    with pytest.raises(KitError, match=rf"piece {folder}/{last.name} is missing \(carry its folder\)"):
        check(kit_dir)
    assert check(kit_dir, partial=True)["missing"] == [f"{folder}/{last.name}"]


def test_a_manifest_edited_to_fit_a_damaged_piece_is_still_refused(kit, tmp_path):
    kit_dir, manifest = kit
    first = pieces(kit_dir, manifest)[0]
    data = bytearray(first.read_bytes())
    data[-10] ^= 0xFF
    first.write_bytes(bytes(data))
    manifest["pieces"][0]["sha256"] = hashlib.sha256(data).hexdigest()
    for p in kit_dir.glob("*/manifest.json"):
        p.write_text(json.dumps(manifest))
    with pytest.raises(KitError, match="the joined pieces are not the archive the manifest names"):
        unpack(kit_dir, tmp_path / "target")  # the xz stream's own check, else the archive's SHA-256
    assert not (tmp_path / "target").exists()


def test_folders_of_two_builds_are_refused(kit, wheels, tmp_path):
    kit_dir, manifest = kit
    other = build_kit(wheels[0], [], wheels[1], tmp_path / "other", carry=CARRY * 2, preset=0, with_redis=False)
    (kit_dir / "b" / "manifest.json").write_text((tmp_path / "other" / "a" / "manifest.json").read_text())
    assert other["kit_id"] != manifest["kit_id"]
    with pytest.raises(KitError, match="the carry folders come from different builds"):
        check(kit_dir)


def test_no_kit_is_named(tmp_path):
    with pytest.raises(KitError, match=r"no kit in .*python -m benchmarks.gpu_kit build"):
        check(tmp_path)


def test_a_dry_run_checks_and_unpacks_the_kit_and_runs_no_step(kit, tmp_path):
    kit_dir, manifest = kit
    argv = ["run", "--dry-run", "--kit", str(kit_dir), "--target", str(tmp_path / "t"), "--out", str(tmp_path / "out")]
    gpu_kit.main(argv, H200)
    summary = json.loads((tmp_path / "out" / "gpu_kit.json").read_text())
    assert summary["kit"]["kit_id"] == manifest["kit_id"] and summary["install"]["unpacked"]
    assert [s["name"] for s in summary["steps"]] == ["imports", "codec-test", "vllm-tests-eager", "ttft", "vllm-tests"]
    assert all(s["skipped"] == "dry run" for s in summary["steps"])
    assert sorted(os.listdir(tmp_path / "out")) == ["gpu_kit.json", "gpu_kit.md"]


def test_a_run_with_a_damaged_kit_writes_why_and_stops(kit, tmp_path):
    kit_dir, manifest = kit
    pieces(kit_dir, manifest)[0].write_bytes(b"not the piece")
    with pytest.raises(SystemExit, match="kit refused: piece a/"):
        gpu_kit.main(["run", "--kit", str(kit_dir), "--target", str(tmp_path / "t"), "--out", str(tmp_path / "out")])
    assert "piece a/" in json.loads((tmp_path / "out" / "gpu_kit.json").read_text())["error"]
    assert "Kit refused: piece a/" in (tmp_path / "out" / "gpu_kit.md").read_text()


def test_the_steps_name_tests_and_options_that_exist():
    root = gpu_kit.ROOT
    assert Path(gpu_kit.plan(root)[0][1][1]).is_file()  # the import check, run as a script
    for path in [*gpu_kit.VLLM_TESTS, gpu_kit.CODEC_TEST]:
        file, _, name = path.partition("::")
        assert (root / file).exists(), file
        assert not name or f"def {name}(" in (root / file).read_text(), path
    args = vllm_ttft.parser().parse_args([*gpu_kit.TTFT, "--repeats", "3", "--out", "x"])
    assert (args.shape, args.dtype, args.tokens, args.ratio) == ("llama3-8b", "bfloat16", [4096, 16384, 32768], 0.15)


def test_a_device_call_carries_the_checkout_and_one_folder():
    budget = gpu_kit_build.carry_budget()
    assert 8 * MIB <= budget <= gpu_kit_build.PIECE_MAX and budget % MIB == 0


def test_a_run_records_each_step_and_stops_one_past_its_time(kit, tmp_path, monkeypatch):
    kit_dir, _ = kit
    py = __import__("sys").executable
    found = {"vllm._C_stable_libtorch": {"ok": False, "error": "ImportError: undefined symbol: x"}}
    steps = [
        ("imports", [py, "-c", f"print('loading'); print('GPU_KIT_IMPORTS ' + {json.dumps(json.dumps(found))})"], 30),
        ("slow", [py, "-c", "import time; print('started', flush=True); time.sleep(60)"], 60),
        ("late", [py, "-c", "pass"], 30),
    ]
    monkeypatch.setattr(gpu_kit, "plan", lambda out: steps)
    monkeypatch.setattr(gpu_kit, "MIN_STEP_S", 1)
    out = tmp_path / "out"  # the budget cuts the slow step short, and the last is not started
    argv = ["run", "--kit", str(kit_dir), "--target", str(tmp_path / "t"), "--out", str(out), "--budget-s", "4"]
    gpu_kit.main(argv, H200)
    summary = json.loads((out / "gpu_kit.json").read_text())
    imports, slow, late = summary["steps"]
    assert imports["rc"] == 0 and not imports["timed_out"] and summary["imports"] == found
    assert slow["timed_out"] and slow["tail"] == ["started"] and slow["seconds"] < 30
    assert late["skipped"].endswith("s of the budget left")
    # every step's output in one log, each after its header: a device call brings back 8 files at most
    log = (out / "steps.log").read_text()
    assert "== step slow: " in log and log.split("== step slow: ")[1].splitlines()[1:] == ["started"]
    assert sorted(os.listdir(out)) == ["gpu_kit.json", "gpu_kit.md", "steps.log"]
    assert "| vllm._C_stable_libtorch | ImportError: undefined symbol: x |" in (out / "gpu_kit.md").read_text()


def test_the_manifest_records_what_the_kit_was_built_for(kit):
    _, manifest = kit
    assert manifest["built_for"] == {"python": "3.12", "python_tags": ["cp38-abi3"], "torch": "2.13.0", "triton": None}


def test_matching_versions_pass_quietly():
    assert compare_versions(BUILT_FOR, Machine("3.12.8", "2.13.0+cu130", "3.9.0")) == ([], [])


def test_another_torch_is_named_with_both_versions_and_the_steps_run_on_it():
    notes, refusals = compare_versions(BUILT_FOR, H200)
    assert not refusals and len(notes) == 1
    assert notes[0].startswith("torch 2.11.0 here, vLLM 0.32.0 pins torch==2.13.0: the steps run on this")


def test_a_missing_torch_or_another_python_refuses_the_kit_by_name():
    notes, refusals = compare_versions(BUILT_FOR, Machine("3.11.9", None, "3.6.0"))
    assert not notes and len(refusals) == 2
    assert refusals[0].startswith("Python 3.11.9 here, the kit's wheels are for Python 3.12 (cp312-cp312, ")
    assert refusals[1].startswith(
        "torch is not installed here, and the kit carries none (vLLM 0.32.0 pins torch==2.13.0)"
    )


def test_a_run_checks_the_versions_before_it_installs_anything(kit, tmp_path, capsys):
    kit_dir, _ = kit
    argv = ["run", "--dry-run", "--kit", str(kit_dir), "--target", str(tmp_path / "t"), "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit, match="kit refused: torch is not installed here"):
        gpu_kit.main(argv, Machine("3.12.3", None, "3.6.0"))
    assert not (tmp_path / "t").exists()
    assert "torch is not installed" in json.loads((tmp_path / "out" / "gpu_kit.json").read_text())["error"]
    gpu_kit.main(argv, H200)  # another torch: named, and the kit unpacked over it
    assert "torch 2.11.0 here, vLLM 0.32.0 pins torch==2.13.0" in capsys.readouterr().out
    summary = json.loads((tmp_path / "out" / "gpu_kit.json").read_text())
    assert summary["versions"]["machine"]["torch"] == "2.11.0" and summary["install"]["unpacked"]
    assert "- torch 2.11.0 here" in (tmp_path / "out" / "gpu_kit.md").read_text()


def test_a_kit_of_another_format_is_refused(kit):
    kit_dir, manifest = kit
    for p in kit_dir.glob("*/manifest.json"):
        p.write_text(json.dumps(manifest | {"format": 1}))
    with pytest.raises(KitError, match="the kit is of format 1, not 2: build it again"):
        check(kit_dir)
