"""Engines layer: the blend usage of streamed responses from the server.

vLLM's OpenAI server returns a request's ``kv_transfer_params``, where the
blend connector answers with its usage, on plain responses only. For a
stream, the server's middleware (``serve.CheckBlendParams``) gives the request
a fresh token under ``kv_transfer_params[TOKEN_KEY]``. When the request
finishes, the connector's scheduler side writes its answer to a file named by
the token; that happens before vLLM sends the request's last output, so the
middleware finds the file when the stream ends and sends the answer as one more
event before ``data: [DONE]``:

    data: {"id": ..., "object": ..., "created": ..., "model": ..., "choices": [], "kv_transfer_params": {...}}

Both sides run on the server's machine as one user: the files live in a
directory of that user's temp dir that only the user can open. A token is
made by the middleware, never taken from a client, and must be 32 hex digits,
so no client names a file.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import tempfile
import uuid
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TOKEN_KEY = "blend_stream"  # kv_transfer_params' key of the token, set by the middleware alone
_TOKEN = re.compile(r"[0-9a-f]{32}\Z")


def new_token() -> str:
    return uuid.uuid4().hex


def answers_dir() -> Path | None:
    """The directory of the answers (made on first use); None if it cannot be
    made, or is not this user's private directory (then streams carry no usage)."""
    path = Path(tempfile.gettempdir()) / f"blend-stream-answers-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        info = path.lstat()
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        logger.warning("%s is not a private directory of this user: streamed responses carry no blend usage", path)
        return None
    return path


def _answer_path(token: Any) -> Path | None:
    if not isinstance(token, str) or not _TOKEN.match(token):
        return None
    folder = answers_dir()
    return None if folder is None else folder / f"{token}.json"


def write_answer(kv_transfer_params: Any, answer: dict | None) -> None:
    """The connector's side: keep a finished request's ``answer`` for the
    middleware, if the request carries a token. Never raises: a request's
    usage must not cost the engine."""
    if not isinstance(kv_transfer_params, dict) or TOKEN_KEY not in kv_transfer_params:
        return
    try:
        path = _answer_path(kv_transfer_params[TOKEN_KEY])
        if path is None:
            return
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(answer))
        os.replace(partial, path)  # the middleware never reads half a file
    except Exception:
        logger.warning("keeping the blend usage of a streamed request failed", exc_info=True)


def take_answer(token: str) -> tuple[bool, dict | None]:
    """The middleware's side: (found, answer) for ``token``, the file removed."""
    path = _answer_path(token)
    if path is None:
        return False, None
    try:
        text = path.read_text()
    except OSError:
        return False, None
    discard(token)
    try:
        answer = json.loads(text)
    except ValueError:
        return False, None
    return True, answer if isinstance(answer, dict) else None


def discard(token: str) -> None:
    """Remove ``token``'s answer, if any (a stream whose client went away)."""
    path = _answer_path(token)
    if path is not None:
        path.unlink(missing_ok=True)


def last_event(events: bytes) -> dict:
    """The last ``data: {...}`` event of a stream's bytes, parsed (``{}`` if none parses)."""
    start = events.rfind(b"data: {")
    try:
        last = json.loads(events[start + len(b"data: ") :].strip()) if start >= 0 else {}
    except ValueError:
        return {}
    return last if isinstance(last, dict) else {}


def answer_event(events: bytes, answer: dict) -> bytes:
    """The server-sent event that carries ``answer``, with the id, object,
    creation time and model of the stream's last event in ``events``."""
    last = last_event(events)
    event = {k: last.get(k) for k in ("id", "object", "created", "model")}
    event.update(choices=[], kv_transfer_params=answer)
    return b"data: " + json.dumps(event).encode() + b"\n\n"
