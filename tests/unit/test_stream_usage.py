"""How a streamed response's blend usage travels from the connector to the
server's middleware: a file per token, in a private directory, that no client
can name."""

from __future__ import annotations

import json
import os

import pytest

from blend_integrations.engines import stream_usage
from blend_integrations.http_edge import check_request_body, mark_for_stream_usage


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
