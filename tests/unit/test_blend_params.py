"""The rules for blend parameters, in the one place every reader uses: the
server's HTTP edge, the connector, the embedded engine and the server client."""

from __future__ import annotations

import json
import math

import pytest

from blend_integrations import PromptError
from blend_integrations.engines.vllm_contract import (
    MAX_CHUNKS,
    BlendParams,
    BlendParamsError,
    blend_params_of,
    blend_results,
    not_blended,
    parse_blend_params,
)
from blend_integrations.http_edge import MAX_PARAMS_DEPTH, check_request_body
from blend_integrations.prompt import TokenizedPrompt, check_chunk_spans

GOOD = {"mode": "blend", "ratio": 0.5, "chunk_spans": [[2, 10], [12, 20]], "num_tokens": 20}
PROMPT_LEN = 40

# (a change to GOOD, the field the error names, words of its message)
BROKEN = [
    ({"mode": None}, "mode", "must be one of blend, full, reuse"),
    ({"mode": "BLEND"}, "mode", "must be one of"),
    ({"mode": ["blend"]}, "mode", "must be one of"),
    ({"ratio": "0.5"}, "ratio", "must be a number in [0, 1]"),
    ({"ratio": 5}, "ratio", 'must be a number in [0, 1] or "auto", got 5'),
    ({"ratio": "Auto"}, "ratio", 'must be a number in [0, 1] or "auto"'),
    ({"ratio": -0.1}, "ratio", "must be a number in [0, 1]"),
    ({"ratio": math.nan}, "ratio", "got nan"),
    ({"ratio": math.inf}, "ratio", "got inf"),
    ({"ratio": True}, "ratio", "must be a number"),
    ({"details": "yes"}, "details", "must be true or false, got 'yes'"),
    ({"details": 1}, "details", "must be true or false, got 1"),
    ({"selection": "HKVD"}, "selection", "must be one of deviation, query, query-tail, mixed; got 'HKVD'"),
    ({"selection": 1}, "selection", "must be one of deviation, query, query-tail, mixed; got 1"),
    ({"check_layers": [2, 1]}, "check_layers", "check_layers must be strictly increasing"),
    ({"check_layers": []}, "check_layers", "check_layers must name at least one layer"),
    ({"check_layers": ["1"]}, "check_layers", "must be non-negative layer indices"),
    ({"deviation": "q"}, "deviation", 'deviation must be "k" or "v"'),
    ({"sink_tokens": -1}, "sink_tokens", "sink_tokens must be a non-negative integer"),
    ({"sink_tokens": 1.5}, "sink_tokens", "sink_tokens must be a non-negative integer"),
    ({"chunk_spans": "2-10"}, "chunk_spans", "must be a list of [start, end] pairs, got str"),
    ({"chunk_spans": [["2", "10"]]}, "chunk_spans", "chunk_spans[0] must hold integers"),
    ({"chunk_spans": [[2.0, 10]]}, "chunk_spans", "chunk_spans[0] must hold integers (not floats"),
    ({"chunk_spans": [[False, 10]]}, "chunk_spans", "chunk_spans[0] must hold integers (not floats, bools"),
    ({"chunk_spans": [[2, 10, 12]]}, "chunk_spans", "chunk_spans[0] must be a [start, end] pair"),
    ({"chunk_spans": [{"start": 2, "end": 10}]}, "chunk_spans", "chunk_spans[0] must be a [start, end] pair"),
    ({"chunk_spans": [[10, 2]]}, "chunk_spans", "chunk_spans[0] is [10, 2]: a span's end must be after its start"),
    ({"chunk_spans": [[10, 10]]}, "chunk_spans", "chunk_spans[0] is [10, 10]"),
    ({"chunk_spans": [[-1, 10]]}, "chunk_spans", "chunk_spans[0] starts at -1"),
    ({"chunk_spans": [[2, 10], [8, 20]]}, "chunk_spans", "chunk_spans[1] starts at 8, before the end 10"),
    ({"chunk_spans": [[12, 20], [2, 10]]}, "chunk_spans", "must be sorted and must not overlap"),
    ({"chunk_spans": [[2, 10], [12, 25]]}, "chunk_spans", "chunk_spans[1] ends at 25, past num_tokens (20)"),
    ({"chunk_spans": []}, "chunk_spans", "is empty"),
    (
        {"chunk_spans": [[i, i + 1] for i in range(MAX_CHUNKS + 1)], "num_tokens": MAX_CHUNKS + 1},
        "chunk_spans",
        f"has {MAX_CHUNKS + 1} spans; at most {MAX_CHUNKS}",
    ),
    ({"chunk_spans": None}, "chunk_spans", "needs chunk_spans"),
    ({"num_tokens": "20"}, "num_tokens", "must be a positive integer, got '20'"),
    ({"num_tokens": 20.0}, "num_tokens", "must be a positive integer"),
    ({"num_tokens": 0}, "num_tokens", "must be a positive integer, got 0"),
    ({"num_tokens": PROMPT_LEN}, "num_tokens", f"is {PROMPT_LEN} but the prompt has {PROMPT_LEN} tokens"),
    ({"num_tokens": 10**9}, "num_tokens", "must be below the prompt's length"),
    ({"num_tokens": 15}, "chunk_spans", "chunk_spans[1] ends at 20, past num_tokens (15)"),
    ({"separator": "\n\n"}, "separator", "not both"),
    ({"ratios": 0.2}, "blend", "unknown field(s) 'ratios'"),
    ({"question_end": 19}, "question_end", "from the last chunk's end (20) to 20, got 19"),
    ({"question_end": 21}, "question_end", "to 20, got 21"),  # past what the blend pass computes
    ({"question_end": "20"}, "question_end", "must be a token index"),
    ({"question_end": True}, "question_end", "must be a token index"),
]


@pytest.mark.parametrize("change,field,words", BROKEN, ids=[f"{i}-{b[1]}" for i, b in enumerate(BROKEN)])
def test_every_rule_names_the_field(change, field, words):
    params = {**GOOD, **change}
    params = {k: v for k, v in params.items() if v is not None or k in ("mode",)}
    with pytest.raises(BlendParamsError) as err:
        parse_blend_params(params, PROMPT_LEN)
    assert words in str(err.value)
    assert err.value.param == ("kv_transfer_params.blend" if field == "blend" else f"kv_transfer_params.blend.{field}")
    assert isinstance(err.value, PromptError)  # what the engines raise


@pytest.mark.parametrize("raw", [None, "blend", [GOOD], 3, {}, {"ratio": 0.1}])
def test_not_an_object_or_no_mode(raw):
    with pytest.raises(BlendParamsError, match=r"kv_transfer_params\.blend(\.mode)? (must be an object|is missing)"):
        parse_blend_params(raw)


def test_separator_rules():
    assert parse_blend_params({"mode": "reuse", "separator": "\u00a7\u00a7"}) == BlendParams(
        "reuse", separator="\u00a7\u00a7"
    )
    for bad in ("", 7, ["\n\n"], "x" * 257):
        with pytest.raises(BlendParamsError, match=r"separator must be a non-empty string of at most 256"):
            parse_blend_params({"mode": "blend", "separator": bad})
    with pytest.raises(BlendParamsError, match="not both"):
        parse_blend_params({"mode": "blend", "separator": "\n\n", "num_tokens": 3})
    with pytest.raises(BlendParamsError, match="not both"):
        parse_blend_params({"mode": "blend", "separator": "\n\n", "question_end": 3})
    # the spans a separator gives are checked as if they were sent
    found = BlendParams("blend", separator="\n\n").with_spans([(2, 5), (7, 9)], 12)
    assert (found.chunk_spans, found.num_tokens) == (((2, 5), (7, 9)), 11)  # every token but the last
    with pytest.raises(BlendParamsError, match=r"chunk_spans\[0\] ends at 12, past 11 \(the prompt has 12 tokens"):
        BlendParams("blend", separator="\n\n").with_spans([(2, 12)], 12)


def test_good_params_and_defaults():
    assert parse_blend_params(GOOD, PROMPT_LEN) == BlendParams("blend", 0.5, {}, ((2, 10), (12, 20)), 20)
    # num_tokens defaults to every token but the prompt's last (the last end while the prompt length is
    # unknown), ratio and selection to the engine's (None)
    assert parse_blend_params({"mode": "reuse", "chunk_spans": [[0, 3]]}) == BlendParams(
        "reuse", None, {}, ((0, 3),), 3
    )
    assert parse_blend_params({"mode": "reuse", "chunk_spans": [[0, 3]]}, 9).num_tokens == 8
    assert parse_blend_params({"mode": "blend", "chunk_spans": [[0, 3]], "selection": "query"}).settings == {
        "selection": "query"
    }
    # a request's own blend settings (null: the engine's) travel as given, checked
    settings = {"check_layers": [1, 2], "deviation": "k", "sink_tokens": 2, "selection": None}
    assert parse_blend_params({"mode": "blend", "chunk_spans": [[0, 3]], **settings}).settings == {
        "check_layers": [1, 2],
        "deviation": "k",
        "sink_tokens": 2,
    }
    assert (
        parse_blend_params({"mode": "blend", "chunk_spans": [[0, 3]], "ratio": None, "num_tokens": 5}, 6).num_tokens
        == 5
    )
    with pytest.raises(
        BlendParamsError, match=r"ends at 6, past 5 \(the prompt has 6 tokens, and vLLM computes the last"
    ):
        parse_blend_params({"mode": "blend", "chunk_spans": [[0, 6]]}, 6)
    with pytest.raises(BlendParamsError, match="ends at 1, past 0"):  # a one-token prompt has nothing to blend
        parse_blend_params({"mode": "blend", "chunk_spans": [[0, 1]]}, 1)
    assert blend_params_of({"other_connector": 1}) is None and blend_params_of("x") is None
    assert blend_params_of({"blend": GOOD}, PROMPT_LEN).chunk_spans == ((2, 10), (12, 20))


def test_results_of_a_fallback():
    usage, loading, why = blend_results(not_blended("kv_transfer_params.blend.ratio must be ...", "invalid_params"))
    assert usage == {
        "cached_tokens": 0,
        "recomputed_tokens": 0,
        "chunks_hit": 0,
        "chunks_missed": 0,
        "chunks_computed": 0,
        "recompute_ratio": None,
        "ratio_source": None,
        "calibration_dtype": None,
    }
    assert loading is None and why == "kv_transfer_params.blend.ratio must be ..."
    assert blend_results(None) == ({}, None, None)


LOADING = {
    "recompute_ratio": 0.2,
    "ratio_floor": 0.15,
    "chunks_memory": 1,
    "chunks_disk": 2,
    "chunks_remote": 0,
    "chunks_computed": 1,
    "est_load_ms": 3.5,
    "est_compute_ms": None,
}


def test_results_of_an_older_or_newer_server():
    """An older server's chunks_recomputed is read as chunks_computed, a newer
    one's extra fields are dropped, and the old attribute names still read."""
    old_loading = dict(LOADING)
    old_loading["chunks_recomputed"] = old_loading.pop("chunks_computed")
    usage, loading, why = blend_results(
        {
            "blend": {
                "cached_tokens": 9,
                "chunks_recomputed": 2,
                "deviation_captured": 0.4,
                "tokens_from_the_future": 1,
            },
            "blend_loading": old_loading,
        }
    )
    assert usage == {"cached_tokens": 9, "chunks_computed": 2, "ranking_captured": 0.4} and why is None
    assert loading is not None and loading.chunks_computed == 1
    with pytest.warns(DeprecationWarning, match="use chunks_computed"):
        assert loading.chunks_recomputed == 1
    from blend_integrations.engines.base import Usage

    with pytest.warns(DeprecationWarning, match="use chunks_computed"):
        assert Usage(**usage).chunks_recomputed == 2
    with pytest.warns(DeprecationWarning, match="use ranking_captured"):
        assert Usage(**usage).deviation_captured == 0.4


@pytest.mark.parametrize(
    "params, words",
    [
        ([1, 2], "kv_transfer_params must be a dict, got list"),
        ({"blend": "3"}, "kv_transfer_params['blend'] must be a dict, got str"),
        ({"blend": {"chunks_hit": -1}}, "kv_transfer_params['blend']['chunks_hit'] is -1: expected a count"),
        ({"blend": {"cached_tokens": True}}, "kv_transfer_params['blend']['cached_tokens'] is True"),
        ({"blend": {"cached_tokens": 2.0}}, "kv_transfer_params['blend']['cached_tokens'] is 2.0"),
        ({"blend_loading": {"chunks_memory": 1}}, "kv_transfer_params['blend_loading'] lacks recompute_ratio"),
        ({"blend_loading": 7}, "kv_transfer_params['blend_loading'] must be a dict, got int"),
    ],
)
def test_results_not_written_by_this_package_are_refused(params, words):
    with pytest.raises(ValueError) as err:
        blend_results(params)
    assert words in str(err.value)


def test_where_the_question_ends_travels_and_is_checked():
    assert parse_blend_params(GOOD | {"question_end": 20}).question_end == 20
    assert parse_blend_params(GOOD).question_end is None
    assert TokenizedPrompt(list(range(30)), [(2, 10)], question_end=25).question_end == 25
    for bad in (9, 31, 2.5):
        with pytest.raises(PromptError, match="TokenizedPrompt.question_end must be a token index"):
            TokenizedPrompt(list(range(30)), [(2, 10)], question_end=bad)


def test_tokenized_prompts_are_checked_by_the_same_span_rules():
    ids = list(range(10))
    assert TokenizedPrompt(ids, [(1, 3), (3, 10)]).chunk_spans == [(1, 3), (3, 10)]
    for spans, words in [
        ([(3, 1)], r"chunk_spans\[0\] is \[3, 1\]"),
        ([(1, 4), (2, 5)], r"chunk_spans\[1\] starts at 2"),
        ([(0, 11)], r"ends at 11, past the prompt end \(10 tokens\)"),
        ([(0.5, 2)], "must hold integers"),
        ("0-2", "must be a list"),
        ([(1,)], "must be a \\[start, end\\] pair"),
    ]:
        with pytest.raises(PromptError, match=words):
            TokenizedPrompt(ids, spans)
    with pytest.raises(PromptError, match="token_ids must be a list of integer token ids"):
        TokenizedPrompt(["a", "b"], [])
    assert check_chunk_spans([], 0) == []


def body(blend=None, prompt=None, **kv) -> bytes:
    params = {"blend": blend, **kv} if blend is not None else kv
    return json.dumps(
        {
            "model": "m",
            "prompt": prompt if prompt is not None else list(range(PROMPT_LEN)),
            "kv_transfer_params": params,
        }
    ).encode()


def problem_of(raw: bytes):
    return check_request_body(raw)[1]


def test_the_http_edge():
    assert problem_of(body(GOOD)) is None
    assert problem_of(b'{"model": "m", "prompt": [1, 2, 3]}') is None  # not blended: vLLM's business
    assert problem_of(b"not json kv_transfer_params") is None  # vLLM answers bad JSON itself
    assert problem_of(body(x=1)) is None  # another connector's parameters
    message, field = problem_of(body({**GOOD, "ratio": 2}))
    assert 'ratio must be a number in [0, 1] or "auto", got 2' in message and field == "kv_transfer_params.blend.ratio"
    # the prompt's length is known for token ids, one prompt or several
    assert "num_tokens is 20 but the prompt has 20 tokens" in problem_of(body(GOOD, list(range(20))))[0]
    assert problem_of(body(GOOD, [list(range(30)), list(range(20))]))[1] == "kv_transfer_params.blend.num_tokens"
    # text: the connector checks the rules that need the prompt's tokens
    assert problem_of(body({**GOOD, "num_tokens": 10**6}, "some text")) is None
    # nesting
    deep = b'{"prompt": [1], "kv_transfer_params": {"blend": ' + b"[" * 100000 + b"]" * 100000 + b"}}"
    assert problem_of(deep) == ("the request body nests too deeply to read", None)
    nested = json.loads("[" * (MAX_PARAMS_DEPTH + 1) + "]" * (MAX_PARAMS_DEPTH + 1))
    assert problem_of(body(GOOD, other=nested))[1] == "kv_transfer_params"


async def test_the_middleware_reads_a_blended_request_s_json_once(monkeypatch):
    """The rules and the stream-usage mark of a streamed blended completion
    both read the one parse of its body, which reaches vLLM with its token."""
    from blend_integrations import serve

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    parses = []
    loads = json.loads
    monkeypatch.setattr(json, "loads", lambda *a, **k: parses.append(1) or loads(*a, **k))
    seen = []

    async def app(scope, receive, send):  # what vLLM's app gets
        seen.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    raw = json.dumps({"prompt": list(range(PROMPT_LEN)), "stream": True, "kv_transfer_params": {"blend": GOOD}})
    messages = [{"type": "http.request", "body": raw.encode(), "more_body": False}]
    sent = []

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    await serve.CheckBlendParams(app)(scope, receive, send)
    assert len(parses) == 1
    assert sent[0]["status"] == 200 and len(seen) == 1
    passed = loads(seen[0])["kv_transfer_params"]
    assert passed["blend"] == GOOD and isinstance(passed[serve.stream_usage.TOKEN_KEY], str)


def test_details_are_asked_for_by_a_bool_and_survive_the_separator():
    assert parse_blend_params(GOOD, PROMPT_LEN).details is False
    assert parse_blend_params(GOOD | {"details": True}, PROMPT_LEN).details is True
    by_separator = parse_blend_params({"mode": "blend", "separator": "\n\n", "details": True})
    assert by_separator.with_spans([(2, 10)], PROMPT_LEN).details is True
