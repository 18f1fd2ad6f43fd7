"""The offline kit's import check (docs/offline-gpu.md): ``gpu_kit run``'s first step runs it as

    python3 benchmarks/gpu_kit_imports.py

with the kit's tree on PYTHONPATH. Each of vLLM's compiled parts is loaded from its own file
(its exact error if it fails), then ``import vllm``, the platform it detects, the FlashAttention
version it chooses, two kernels against torch, and this package's plugin entry point. The
results end the output as one line, ``GPU_KIT_IMPORTS <json>``, which ``run`` reads back.

It imports nothing at its top but the standard library (not even the ``benchmarks`` package,
which imports torch), so that a failure is recorded by the check rather than ending it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import sys
import time
from pathlib import Path

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


def import_check() -> dict:
    """Each compiled part's import and two kernels against torch: ok with a value, or the exact error."""
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


if __name__ == "__main__":
    print("GPU_KIT_IMPORTS " + json.dumps(import_check()), flush=True)  # gpu_kit.IMPORTS_MARK
