"""Entry-points layer: a request at the blend server's HTTP edge, read once
and checked before it reaches the engine (``serve.CheckBlendParams``): its
body, its blend parameters by ``vllm_contract``'s rules, vLLM's error body,
the refusal counter, and the mark and sender that end a streamed blended
completion with its usage (``engines/stream_usage.py``)."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from .engines import stream_usage
from .engines.vllm_contract import BlendParamsError, parse_blend_params

logger = logging.getLogger(__name__)
# The workers' answer for a request id (``vllm_answers.RecentAnswers``), asked through the engine client.
AskAnswer = Callable[[str], Awaitable["dict | None"]]

MAX_PARAMS_DEPTH = 16  # how deeply kv_transfer_params may nest: it is serialized into the engine core


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


def check_request_body(body: bytes) -> tuple[dict | None, tuple[str, str | None] | None]:
    """A POST body read once: (the JSON object, when it carries
    ``kv_transfer_params``; else None), and (message, field) when its
    ``kv_transfer_params.blend`` breaks a rule (else None). Bodies that are
    not JSON objects or carry no blend parameters are left to vLLM, which
    answers them itself. Where the server tokenizes the prompt (text, chat),
    the rules that need its length are checked by the connector, which
    computes such a request in full and says why in the response."""
    if b"kv_transfer_params" not in body:
        return None, None
    try:
        data = json.loads(body)
    except RecursionError:
        return None, ("the request body nests too deeply to read", None)
    except ValueError:
        return None, None
    if not isinstance(data, dict) or not isinstance(data.get("kv_transfer_params"), dict):
        return None, None
    params = data["kv_transfer_params"]
    if _depth(params) > MAX_PARAMS_DEPTH:
        return data, (f"kv_transfer_params nests more than {MAX_PARAMS_DEPTH} levels deep", "kv_transfer_params")
    if "blend" not in params:
        return data, None
    try:
        known = _prompt_lengths(data.get("prompt"))
        lengths: list[int | None] = list(known) if known else [None]  # None: the connector checks the length
        for length in lengths:
            parse_blend_params(params["blend"], length)
    except BlendParamsError as exc:
        return data, (str(exc), exc.param)
    return data, None


def request_path(scope) -> str:
    return scope["path"].removeprefix(scope.get("root_path", ""))


async def read_body(receive, limit: int | None = None) -> bytes | None:
    """The request's body; None if the client went away or it is over ``limit`` bytes."""
    parts, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":  # the client went away
            return None
        parts.append(message.get("body", b""))
        size += len(parts[-1])
        if limit is not None and size > limit:
            return None
        more = message.get("more_body", False)
    return b"".join(parts)


async def send_error(scope, receive, send, message: str, status: int, param: str | None = None) -> None:
    """vLLM's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    from starlette.responses import JSONResponse

    kind = "BadRequestError" if status == 400 else "NotFoundError" if status == 404 else "Error"
    error = {"message": message, "type": kind, "param": param, "code": status}
    await JSONResponse({"error": error}, status_code=status)(scope, receive, send)


@functools.cache
def refused_requests():
    """``vllm:blend_requests_refused_total{reason}``: requests refused at the HTTP
    edge, by the field that broke a rule. Made at the first refusal, after vLLM
    has set up its registry (it drops every ``vllm:`` series it finds then)."""
    from prometheus_client import Counter

    return Counter(
        "vllm:blend_requests_refused",
        "Requests refused with HTTP 400 before reaching the engine, by the blend parameter that broke a rule.",
        ["reason"],
    )


def mark_for_stream_usage(data: dict | None) -> tuple[bytes | None, str | None]:
    """(the body to pass on if it changed, else None; the token it was given,
    ``stream_usage``, if it streams one blended completion), from the body
    ``check_request_body`` read. A token a client sent is dropped: only the
    server makes them."""
    params = data.get("kv_transfer_params") if data is not None else None
    if data is None or not isinstance(params, dict):
        return None, None
    changed = params.pop(stream_usage.TOKEN_KEY, None) is not None
    token = None
    if data.get("stream") is True and _one_blended_completion(data):
        token = params[stream_usage.TOKEN_KEY] = stream_usage.new_token()
    return (json.dumps(data).encode() if changed or token else None), token


def _one_blended_completion(data: dict) -> bool:
    """Whether the body asks to blend exactly one completion (one prompt, ``n`` 1)."""
    params, prompt = data.get("kv_transfer_params"), data.get("prompt")
    one_prompt = "messages" in data or isinstance(prompt, str) or len(_prompt_lengths(prompt) or ()) == 1
    return isinstance(params, dict) and "blend" in params and one_prompt and data.get("n") in (None, 1)


def stopped_on_a_string(data: dict | None) -> bool:
    """Whether the body asks to blend one completion that a stop string may
    end: vLLM then drops the connector's answer (``vllm_answers.RecentAnswers``)."""
    return data is not None and bool(data.get("stop")) and _one_blended_completion(data)


async def _asked_answer(response: dict, ask: AskAnswer) -> dict | None:
    """The workers' answer for a completion stopped on a stop string whose
    response carries none; None when it carries one, or none is found."""
    choices, params = response.get("choices"), response.get("kv_transfer_params")
    if (isinstance(params, dict) and "blend" in params) or not isinstance(response.get("id"), str):
        return None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    if not isinstance(choices[0].get("stop_reason"), str):
        return None  # ended otherwise: the engine core finished it, and its answer came
    # vLLM's completions name each prompt's request the response's id plus "-" and the prompt's
    # index (one prompt here: 0); a chat's request is named as its response
    request_id = response["id"] + ("-0" if response.get("object") == "text_completion" else "")
    try:
        return await ask(request_id)
    except Exception as e:  # the usage must not cost the answer
        logger.warning("asking the workers for the blend usage of %s failed: %s", request_id, e)
        return None


def stopped_usage_sender(send, ask: AskAnswer):
    """``send`` that puts the blend usage into a plain (not streamed) JSON
    completion vLLM stopped on a stop string, whose answer it dropped."""
    start: dict | None = None
    parts: list[bytes] = []

    async def sender(message) -> None:
        nonlocal start
        if message["type"] == "http.response.start" and message.get("status") == 200:
            start = message  # held until the body is known: its length may change
            return
        if message["type"] != "http.response.body" or start is None:
            await send(message)
            return
        parts.append(message.get("body", b""))
        if message.get("more_body"):
            return
        body = b"".join(parts)
        try:
            response = json.loads(body)
        except ValueError:
            response = None
        if isinstance(response, dict) and (answer := await _asked_answer(response, ask)) is not None:
            response["kv_transfer_params"] = {**(response.get("kv_transfer_params") or {}), **answer}
            body = json.dumps(response).encode()
        headers = [(k, v) for k, v in start.get("headers", ()) if k.lower() != b"content-length"]
        await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return sender


def stream_usage_sender(send, token: str, ask: AskAnswer | None = None):
    """``send`` that adds the request's blend usage before a stream's
    ``data: [DONE]`` (``stream_usage``); for a stream stopped on a stop
    string whose answer was dropped, the workers' (``ask``)."""
    import asyncio

    streaming, last_event = False, b""

    async def sender(message) -> None:
        nonlocal streaming, last_event
        if message["type"] == "http.response.start":
            headers = dict(message.get("headers") or ())
            streaming = headers.get(b"content-type", b"").startswith(b"text/event-stream")
        elif message["type"] == "http.response.body" and streaming:
            data = message.get("body", b"")
            done = data.find(b"data: [DONE]")
            if done < 0:
                if b"data: {" in data:
                    last_event = data
            else:
                # The connector wrote the answer before vLLM sent the last output; allow for a slow disk.
                for _ in range(100):
                    found, answer = await asyncio.to_thread(stream_usage.take_answer, token)
                    if found:
                        break
                    await asyncio.sleep(0.01)
                if not found and ask is not None:
                    answer = await _asked_answer(stream_usage.last_event(last_event or data[:done]), ask)
                if answer is not None:
                    event = stream_usage.answer_event(last_event or data[:done], answer)
                    message = {**message, "body": data[:done] + event + data[done:]}
        await send(message)

    return sender
