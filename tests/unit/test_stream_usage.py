"""How a streamed response's blend usage travels from the connector to the
server's middleware: a file per token, in a private directory, that no client
can name."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from blend_integrations.engines import stream_usage
from blend_integrations.http_edge import (
    check_request_body,
    mark_for_stream_usage,
    stopped_on_a_string,
    stopped_usage_sender,
)


def mark(raw: bytes):
    """The stream-usage mark of a body, from its one parse (as the middleware makes it)."""
    return mark_for_stream_usage(check_request_body(raw)[0])


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    return tmp_path


ANSWER = {"blend": {"cached_tokens": 40, "recomputed_tokens": 6, "recompute_ratio": 0.15}}


def test_an_answer_written_for_a_token_is_taken_once(private_tmp):
    token = stream_usage.new_token()
    stream_usage.write_answer({"blend": {}, stream_usage.TOKEN_KEY: token}, ANSWER)
    folder = stream_usage.answers_dir()
    assert folder is not None and folder.parent == private_tmp and (folder.stat().st_mode & 0o777) == 0o700
    assert stream_usage.take_answer(token) == (True, ANSWER)
    assert stream_usage.take_answer(token) == (False, None) and not list(folder.iterdir())
    stream_usage.write_answer({stream_usage.TOKEN_KEY: token}, None)  # a request the connector did not blend
    assert stream_usage.take_answer(token) == (True, None)


@pytest.mark.parametrize("token", ["../../etc/passwd", "A" * 32, "0" * 31, "0" * 33, 7, None, "0" * 32 + "\n"])
def test_a_token_not_made_by_the_server_names_no_file(private_tmp, token):
    stream_usage.write_answer({stream_usage.TOKEN_KEY: token}, ANSWER)
    assert stream_usage.take_answer(token) == (False, None)
    folder = stream_usage.answers_dir()
    assert folder is not None and not list(folder.iterdir())
    stream_usage.write_answer({"blend": {}}, ANSWER)  # no token: nothing kept
    stream_usage.write_answer("not a dict", ANSWER)
    assert not list(folder.iterdir())


def test_a_directory_others_can_open_is_not_used(private_tmp):
    folder = private_tmp / f"blend-stream-answers-{os.getuid()}"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    assert stream_usage.answers_dir() is None
    token = stream_usage.new_token()
    stream_usage.write_answer({stream_usage.TOKEN_KEY: token}, ANSWER)  # never raises
    assert not list(folder.iterdir())


def test_the_event_carries_the_streams_identity():
    last = (
        b'data: {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m", "choices": []}\n\n'
    )
    event = stream_usage.answer_event(last, ANSWER)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[6:]) == {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 5,
        "model": "m",
        "choices": [],
        "kv_transfer_params": ANSWER,
    }
    assert json.loads(stream_usage.answer_event(b"garbage", ANSWER)[6:])["kv_transfer_params"] == ANSWER


def body(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": [1, 2, 3], **fields}).encode()


BLEND = {"blend": {"mode": "blend", "separator": "\n\n"}}


def test_only_a_streamed_blended_single_completion_gets_a_token():
    marked, token = mark(body(stream=True, kv_transfer_params=BLEND))
    assert token is not None and json.loads(marked)["kv_transfer_params"][stream_usage.TOKEN_KEY] == token
    assert mark(body(kv_transfer_params=BLEND)) == (None, None)  # not streamed
    assert mark(body(stream=True)) == (None, None)  # not blended
    for fields in ({"n": 2}, {"prompt": [[1, 2], [3, 4]]}, {"prompt": ["a", "b"]}, {"prompt": 5}, {"prompt": {}}):
        assert mark(body(stream=True, kv_transfer_params=BLEND, **fields))[1] is None
    assert mark(body(stream=True, kv_transfer_params=BLEND, prompt=[[1, 2]]))[1] is not None
    chat = json.dumps({"messages": [], "stream": True, "kv_transfer_params": BLEND}).encode()
    assert mark(chat)[1] is not None


def test_a_token_a_client_sent_is_dropped():
    sent = {**BLEND, stream_usage.TOKEN_KEY: "0" * 32}
    marked, token = mark(body(kv_transfer_params=sent))
    assert token is None and stream_usage.TOKEN_KEY not in json.loads(marked)["kv_transfer_params"]
    marked, token = mark(body(stream=True, kv_transfer_params=sent))
    assert token not in (None, "0" * 32) and json.loads(marked)["kv_transfer_params"][stream_usage.TOKEN_KEY] == token


def test_only_a_blended_single_completion_with_stop_strings_is_watched_for_a_dropped_answer():
    blend = {"kv_transfer_params": {"blend": {"mode": "blend"}}}
    assert stopped_on_a_string({"prompt": "x", "stop": ["\n"], **blend})
    assert stopped_on_a_string({"messages": [], "stop": "Q:", **blend})
    assert not stopped_on_a_string({"prompt": "x", **blend})  # no stop string: the engine core ends it
    assert not stopped_on_a_string({"prompt": "x", "stop": ["\n"]})  # not blended
    assert not stopped_on_a_string({"prompt": "x", "stop": ["\n"], "n": 2, **blend})
    assert not stopped_on_a_string({"prompt": [[1, 2], [3]], "stop": ["\n"], **blend})


def respond(status: int, response, answer=ANSWER) -> tuple[list[dict], list[str]]:
    """What a plain completion's response becomes through ``stopped_usage_sender``, sent in
    two parts, and which request ids it asked the workers about."""
    body = response if isinstance(response, bytes) else json.dumps(response).encode()
    sent, asked = [], []

    async def send(message):
        sent.append(message)

    async def ask(request_id):
        asked.append(request_id)
        return answer

    async def run():
        sender = stopped_usage_sender(send, ask)
        await sender({"type": "http.response.start", "status": status, "headers": [(b"content-length", b"1")]})
        await sender({"type": "http.response.body", "body": body[:5], "more_body": True})
        await sender({"type": "http.response.body", "body": body[5:], "more_body": False})

    asyncio.run(run())
    return sent, asked


def stopped_response(stop_reason="\n", params=None) -> dict:
    choice = {"index": 0, "text": "1830.", "finish_reason": "stop", "stop_reason": stop_reason}
    return {"id": "cmpl-5f3a", "object": "text_completion", "choices": [choice], "kv_transfer_params": params}


def test_a_plain_completion_stopped_on_a_string_gets_the_workers_answer():
    sent, asked = respond(200, stopped_response())
    start, body = sent
    assert asked == ["cmpl-5f3a-0"]  # vLLM names a completion's one prompt its id plus "-0"
    assert json.loads(body["body"])["kv_transfer_params"] == ANSWER
    assert dict(start["headers"])[b"content-length"] == str(len(body["body"])).encode()
    chat = {"id": "chatcmpl-9", "object": "chat.completion", "choices": [{"index": 0, "stop_reason": "\n"}]}
    assert respond(200, chat)[1] == ["chatcmpl-9"]  # a chat's request is named as its response
    # ended by a stop token or the length, or carrying its answer already: passed on as it came
    for response in (stopped_response(stop_reason=7), stopped_response(params=ANSWER)):
        sent, asked = respond(200, response)
        assert asked == [] and json.loads(sent[1]["body"]) == response
    # an error, a body that is not JSON, and no answer found: passed on unchanged
    for status, response, answer in ((400, stopped_response(), ANSWER), (200, b"not json", ANSWER),
                                     (200, stopped_response(), None)):  # fmt: skip
        sent, _ = respond(status, response, answer=answer)
        body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        assert body == (response if isinstance(response, bytes) else json.dumps(response).encode())
