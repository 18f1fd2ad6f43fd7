"""Prompt layer: tool calls in generated text, in the formats chat templates teach models.

- ``hermes`` (Qwen2.5/Qwen3, Hermes and many others):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, possibly after some text;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``;
- ``mistral-args`` (newer Mistral tokenizers): ``[TOOL_CALLS]name[ARGS]{...}``, repeated;
- ``llama3`` (Llama 3.1+ JSON tool calling): ``{"name": ..., "parameters": {...}}``,
  optionally after ``<|python_tag|>``, several separated by ``;``.

The Mistral and Llama markers are special tokens that decoding usually drops,
so for those formats a reply that is nothing but well-formed calls counts as
calls with or without the marker. Engine-neutral: the LangChain and LlamaIndex
adapters map ``Reply`` onto their own message types.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

FORMATS = ("hermes", "mistral", "mistral-args", "llama3")

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_MISTRAL_MARKER = "[TOOL_CALLS]"
_PYTHON_TAG = "<|python_tag|>"
_NAME = re.compile(r"[A-Za-z_][\w\-.]*")
_decoder = json.JSONDecoder()


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(8))


@dataclass
class BadToolCall:
    """A call the model started but did not write as valid JSON."""

    name: str | None
    arguments: str
    error: str
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(8))


@dataclass
class Reply:
    content: str
    calls: list[ToolCall] = field(default_factory=list)
    bad: list[BadToolCall] = field(default_factory=list)


def template_text(tokenizer) -> str:
    """The chat template used when tools are given (HF picks ``tool_use`` if there is one)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default") or ""
    return template


def detect_format(chat_template: str) -> str | None:
    """The tool-call format a chat template teaches, or None if it renders no tools
    or uses a format not parsed here."""
    if "tools" not in chat_template:
        return None
    if _HERMES_OPEN in chat_template:
        return "hermes"
    if _MISTRAL_MARKER in chat_template:
        return "mistral-args" if "[ARGS]" in chat_template else "mistral"
    if _PYTHON_TAG in chat_template or "ipython" in chat_template:
        return "llama3"
    return None


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"tool_call_format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return fmt


def prefill(fmt: str, name: str | None) -> str:
    """The start of the assistant's reply that forces a tool call: any tool when
    ``name`` is None (the model writes the name), else that tool."""
    check_format(fmt)
    if fmt == "mistral-args":
        return _MISTRAL_MARKER + (f"{name}[ARGS]" if name else "")
    opening = {"hermes": _HERMES_OPEN + "\n", "mistral": _MISTRAL_MARKER + "[", "llama3": ""}[fmt]
    key = "parameters" if fmt == "llama3" else "arguments"
    return opening + ('{"name": ' + json.dumps(name) + f', "{key}": ' if name else '{"name": "')


def parse(text: str, fmt: str, *, forced: bool = False) -> Reply:
    """Split a finished reply into content and tool calls. ``forced``: the reply
    began with ``prefill`` text, so it is a call even if malformed."""
    check_format(fmt)
    if fmt == "hermes":
        return _parse_hermes(text)
    body = text.lstrip()
    marked = body.startswith(_MISTRAL_MARKER if fmt.startswith("mistral") else _PYTHON_TAG)
    reply = _parse_mistral(body, marked) if fmt.startswith("mistral") else _parse_llama3(body)
    if reply is not None and (reply.calls or marked or forced):
        return reply
    if marked or forced:
        return Reply("", bad=[BadToolCall(None, body, "not a tool call in the expected format")])
    return Reply(text)


def _call(obj, arg_keys=("arguments", "parameters")) -> ToolCall | BadToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return BadToolCall(None, json.dumps(obj), 'a tool call needs a "name" string')
    args: Any = next((obj[k] for k in arg_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            return BadToolCall(obj["name"], args, f"arguments are not JSON: {e}")
    if not isinstance(args, dict):
        return BadToolCall(obj["name"], json.dumps(args), "arguments must be a JSON object")
    extra = {"id": obj["id"]} if isinstance(obj.get("id"), str) else {}
    return ToolCall(obj["name"], args, **extra)


def _bad_json(raw: str, error: Exception) -> BadToolCall:
    match = re.search(r'"name"\s*:\s*"([^"]*)"', raw)
    return BadToolCall(match.group(1) if match else None, raw, f"not valid JSON: {error}")


def _reply(content: str, calls: list) -> Reply:
    return Reply(
        content, [c for c in calls if isinstance(c, ToolCall)], [c for c in calls if isinstance(c, BadToolCall)]
    )


def _parse_hermes(text: str) -> Reply:
    start = text.find(_HERMES_OPEN)
    if start == -1:
        return Reply(text)
    calls = []
    for raw in re.findall(
        re.escape(_HERMES_OPEN) + r"(.*?)(?:" + re.escape(_HERMES_CLOSE) + r"|$)", text[start:], re.DOTALL
    ):
        try:
            calls.append(_call(json.loads(raw)))
        except json.JSONDecodeError as e:
            calls.append(_bad_json(raw.strip(), e))
    return _reply(text[:start].rstrip(), calls)


def _json_values(text: str, separators: str) -> list | None:
    """All JSON values in ``text`` one after another (separated by whitespace or
    ``separators``), or None if anything else is in between."""
    values: list = []
    i = 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in separators):
            i += 1
        if i == len(text):
            return values
        try:
            value, i = _decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        values.append(value)


def _parse_mistral(body: str, marked: bool) -> Reply | None:
    calls: list = []
    for piece in filter(str.strip, body.split(_MISTRAL_MARKER) if marked else [body]):
        values = _json_values(piece, "")
        if values is not None:
            for value in values:
                calls += [_call(v) for v in (value if isinstance(value, list) else [value])]
            continue
        name = _NAME.match(piece.strip())
        rest = piece.strip()[name.end() :].lstrip() if name else ""
        rest = rest.removeprefix("[ARGS]")
        try:
            args, end = _decoder.raw_decode(rest.lstrip())
        except json.JSONDecodeError as e:
            if not name:
                return None
            calls.append(BadToolCall(name.group(), rest, f"not valid JSON: {e}"))
            continue
        if not name or rest.lstrip()[end:].strip():
            return None
        calls.append(_call({"name": name.group(), "arguments": args}))
    return _reply("", calls) if calls else None


def _parse_llama3(body: str) -> Reply | None:
    body = body.removeprefix(_PYTHON_TAG)
    values = _json_values(body, ";")
    if not values:
        try:
            _decoder.raw_decode(body.strip())
        except json.JSONDecodeError as e:
            return _reply("", [_bad_json(body.strip(), e)]) if body.strip().startswith("{") else None
        return None
    calls = [_call(v) for value in values for v in (value if isinstance(value, list) else [value])]
    return _reply("", calls)


class ReplyStream:
    """Streams a reply's content while holding back whatever may be a tool call.

    ``feed`` returns the text that is surely content; ``finish`` parses the
    whole reply and returns it with the content not yet streamed. What was
    streamed plus that tail equals the parsed content."""

    def __init__(self, fmt: str, *, forced: bool = False, prefix: str = "") -> None:
        self.fmt, self.forced = check_format(fmt), forced
        self.text, self.emitted = prefix, 0

    def feed(self, delta: str) -> str:
        self.text += delta
        upto = self._safe_end()
        if upto <= self.emitted:
            return ""
        out, self.emitted = self.text[self.emitted : upto], upto
        return out

    def finish(self) -> tuple[str, Reply]:
        reply = parse(self.text, self.fmt, forced=self.forced)
        return reply.content[self.emitted :], reply

    def _safe_end(self) -> int:
        """How much of the text is content whatever comes next."""
        text = self.text
        if self.fmt == "hermes":
            at = text.find(_HERMES_OPEN)
            if at == -1:  # hold a tail that may become the marker
                at = next(
                    (
                        len(text) - n
                        for n in range(min(len(_HERMES_OPEN) - 1, len(text)), 0, -1)
                        if text.endswith(_HERMES_OPEN[:n])
                    ),
                    len(text),
                )
            return len(text[:at].rstrip())  # whitespace before a call is not content
        if self.forced or self._may_open(text.lstrip()):
            return 0
        return len(text)

    def _may_open(self, body: str) -> bool:
        """Could a reply starting with ``body`` still be a tool call (start-anchored formats)?"""
        if not body:
            return True
        marker = _PYTHON_TAG if self.fmt == "llama3" else _MISTRAL_MARKER
        if body.startswith(marker) or marker.startswith(body) or body[0] in "[{":
            return True
        # a Mistral call whose marker was dropped: "name{...}" or "name[ARGS]{...}"
        name = _NAME.match(body)
        rest = body[name.end() :].lstrip() if name else ""
        return self.fmt.startswith("mistral") and name is not None and (not rest or rest[0] in "{[")
