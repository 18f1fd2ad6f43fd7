"""The blend server (vLLM's OpenAI server with the connector) and its client, over loopback."""

from __future__ import annotations

import dataclasses
import json
import re
import time
import urllib.error
import urllib.request

import pytest

from blend_integrations import BlendPrompt, PromptError, load_engine
from blend_integrations.calibration import RELOAD_S, CalibrationRecord, record_name
from blend_integrations.engines.base import Generation
from blend_integrations.engines.server_engine import CALIBRATION_PATH, ServerError
from blend_integrations.prompt import TokenizedPrompt
from tests.fixtures.commands import ROOT
from tests.fixtures.local_models import sample_text

QUESTION = "Question: which city is named in the documents? Answer:"


@pytest.fixture(scope="module")
def client(blend_server):
    return load_engine(blend_server.url, backend="server", api_key=blend_server.api_key)


def test_server_returns_the_same_tokens_as_the_embedded_engine(client, vllm_engine, docs):
    client.warm(docs)  # computed and saved by the server's worker
    prompt = BlendPrompt("You answer questions.", docs[::-1], QUESTION)
    served = client.generate(prompt, max_tokens=10, recompute_ratio=1.0, logprobs=1)
    assert (served.usage.chunks_hit, served.usage.chunks_missed) == (4, 0)
    assert served.usage.cached_tokens == served.usage.recomputed_tokens > 0
    embedded_full = vllm_engine.generate(prompt, max_tokens=10, mode="full")
    assert served.token_ids == embedded_full.token_ids
    assert client.generate(prompt, max_tokens=10, mode="full").token_ids == embedded_full.token_ids
    blended = client.generate(prompt, max_tokens=10)
    embedded = vllm_engine.generate(prompt, max_tokens=10)  # same store: the server's chunks serve it
    assert embedded.usage.chunks_hit == 4
    assert (
        blended.usage.recomputed_tokens == embedded.usage.recomputed_tokens == round(0.15 * blended.usage.cached_tokens)
    )
    assert [max(lp, key=lp.get) for lp in served.logprobs] == served.token_ids


def test_server_stream(client, docs):
    client.warm(docs)
    prompt = BlendPrompt("Read.", docs, QUESTION)
    stream = client.stream(prompt, max_tokens=12)
    text = "".join(stream)
    gen = client.generate(prompt, max_tokens=12)
    assert text == gen.text == stream.generation.text
    assert stream.generation.usage.completion_tokens == len(gen.token_ids)
    assert 0 < stream.generation.ttft_s <= stream.generation.total_s
    # The blend usage reaches the client at the stream's end, as on a plain response.
    streamed, plain = stream.generation.usage, gen.usage
    assert streamed.chunks_hit == plain.chunks_hit == len(docs) and streamed.cached_tokens == plain.cached_tokens > 0
    assert streamed.recomputed_tokens == plain.recomputed_tokens > 0
    assert streamed.recompute_ratio == plain.recompute_ratio and stream.generation.fallback is None
    # vLLM's front end aborts a request it stops on a stop string and drops the connector's answer:
    # the server asks the workers for it, on a plain response and on a stream
    stop = gen.text[3:6]
    for answer in (client.generate(prompt, max_tokens=12, stop=stop), client.stream(prompt, max_tokens=12, stop=stop)):
        if not isinstance(answer, Generation):
            "".join(answer)
            answer = answer.generation
        assert answer.finish_reason == "stop" and answer.text == gen.text[: gen.text.index(stop)]
        assert dataclasses.replace(answer.usage, completion_tokens=0) == dataclasses.replace(plain, completion_tokens=0)


def sse_events(client, path: str, body: dict) -> list:
    """A streamed request's server-sent events, [DONE] as the string "[DONE]"."""
    req = urllib.request.Request(
        client.base_url + path,
        data=json.dumps({"model": client.model_name, "stream": True, **body}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {client._api_key}"},
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        lines = [raw.decode().strip() for raw in resp]
    return [json.loads(x[5:]) if x != "data: [DONE]" else "[DONE]" for x in lines if x.startswith("data:")]


def test_a_streamed_chat_ends_with_its_blend_usage(client, docs):
    """A plain HTTP client streaming a chat with the separator fallback gets the
    connector's answer in one more event before [DONE]; a token it sends itself
    (naming a file) is dropped, and a stream that asks nothing of blending is untouched."""
    client.warm(docs)
    content = "\n\n".join(["Read."] + docs + [QUESTION])
    blend = {"mode": "blend", "ratio": 0.5, "separator": "\n\n"}
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}
    events = sse_events(
        client, "/v1/chat/completions", {**body, "kv_transfer_params": {"blend": blend, "blend_stream": "../../x"}}
    )
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert last["choices"] == [] and last["object"] == "chat.completion.chunk" and last["id"] == events[0]["id"]
    usage = last["kv_transfer_params"]["blend"]
    assert usage["chunks_hit"] + usage["chunks_missed"] == len(docs) and usage["recompute_ratio"] == 0.5
    assert not any("kv_transfer_params" in e for e in events[:-2])
    plain = sse_events(client, "/v1/chat/completions", body)
    assert plain[-1] == "[DONE]" and not any("kv_transfer_params" in e for e in plain[:-1])
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in plain[:-1] if e["choices"])


def test_server_errors_are_clear(client):
    with pytest.raises(ValueError, match="server's chunk store"):
        load_engine(client.base_url, backend="server", store=object())
    with pytest.raises(ServerError, match="cannot reach the blend server"):
        load_engine("http://127.0.0.1:9", backend="server")


def test_text_only_caller_with_the_separator_fallback(client, docs):
    """A plain HTTP client with nothing but text: the server finds the chunks between separators."""
    text = "\n\n".join(["You answer questions."] + docs + [QUESTION])

    def complete(blend):
        body = {"model": client.model_name, "prompt": text, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        if blend:
            body["kv_transfer_params"] = {"blend": {"mode": "blend", "ratio": 1.0, "separator": "\n\n"}}
        req = urllib.request.Request(
            client.base_url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {client._api_key}"},
        )
        return json.loads(urllib.request.urlopen(req, timeout=300).read())

    full = complete(False)
    first = complete(True)
    assert first["kv_transfer_params"]["blend"]["chunks_missed"] == len(docs)
    again = complete(True)  # the chunks found in the text were saved after the first request
    assert again["kv_transfer_params"]["blend"]["chunks_hit"] == len(docs)
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"] == full["choices"][0]["token_ids"]


def test_integrations_reach_the_server_by_url(blend_server, docs):
    """ChatBlend and the LlamaIndex BlendLLM built from the server's URL and key
    (LangChain's base_url and api_key): the server keeps the store."""
    from blend_integrations.langchain import ChatBlend
    from blend_integrations.llama_index import BlendLLM

    chat = ChatBlend(base_url=blend_server.url, api_key=blend_server.api_key, max_tokens=4)
    llm = BlendLLM(base_url=blend_server.url, api_key=blend_server.api_key, max_tokens=4)
    assert chat.engine.backend == llm.engine.backend == "server"
    assert blend_server.api_key not in repr(chat) + repr(llm) + json.dumps(llm.to_dict())
    chat.engine.warm(docs)
    stats = llm.complete_chunks(docs[::-1], QUESTION).additional_kwargs["blend"]
    assert (stats["chunks_hit"], stats["chunks_missed"]) == (len(docs), 0)
    assert chat.invoke("Say something.").response_metadata["chunks_hit"] == 0


def test_the_server_runs_behind_its_api_key(blend_server, docs):
    """Without the key every /v1 request is refused with 401, a malformed blend body
    included (authentication comes first); clients that lack the key are told so."""

    def post(body: dict, key: str | None) -> tuple[int, str]:
        headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
        req = urllib.request.Request(
            blend_server.url + "/v1/completions", data=json.dumps(body).encode(), headers=headers
        )
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    malformed = {
        "model": "m",
        "prompt": [1, 2, 3],
        "max_tokens": 1,
        "kv_transfer_params": {"blend": {"mode": "blend", "chunk_spans": [[2, 1]]}},
    }
    assert post(malformed, None)[0] == post(malformed, "wrong-key")[0] == 401
    status, text = post(malformed, blend_server.api_key)
    assert status == 400 and json.loads(text)["error"]["param"] == "kv_transfer_params.blend.chunk_spans"
    with urllib.request.urlopen(blend_server.url + "/health", timeout=30) as r:  # outside /v1: open
        assert r.status == 200
    with pytest.raises(ServerError, match=r"HTTP 401 \(unauthorized\): pass api_key= \(or set \$BLEND_API_KEY\)"):
        load_engine(blend_server.url, backend="server")
    with pytest.raises(ServerError, match="the api_key given is not one of the server's keys"):
        load_engine(blend_server.url, backend="server", api_key="wrong-key")


def test_the_server_calibrates_over_http_and_its_auto_uses_it(client, blend_server, store, engine, docs):
    """ServerEngine.calibrate measures over HTTP and stores the record through
    /v1/blend/calibration in the server's store; the server's "auto" uses it;
    a foreign or broken record is refused with 400 and nothing is stored."""
    info = client.served_model()
    assert (info["fingerprint"], info["dtype"], info["num_layers"]) == (
        engine.fingerprint,
        "float32",
        engine.num_layers,
    )
    assert info["record"] is None and info["settings"] == engine.config.settings()
    name = record_name(info["fingerprint"], info["dtype"])
    texts = [" ".join(sample_text(4, seed=700 + i)) for i in range(6)]
    options = dict(num_prompts=4, ratios=(0.5, 0.9), variants=[], target=0.05, confidence=0.5, min_speedup=0.01)
    try:
        record = client.calibrate(texts, progress=False, **options)
        assert record.meets_target and record.ratio in (0.5, 0.9) and record.engine == "server" and record.n == 4
        assert client.calibration() == record
        assert CalibrationRecord.from_bytes(store.get_record(name), fingerprint=engine.fingerprint, dtype="float32")
        time.sleep(RELOAD_S + 0.2)  # the connector reads its store's record at most once a second
        client.warm(docs)
        gen = client.generate(BlendPrompt("Docs:", docs, QUESTION), max_tokens=2)
        assert (gen.usage.ratio_source, gen.usage.recompute_ratio) == ("calibrated", record.ratio)
        assert gen.usage.recomputed_tokens == round(record.ratio * gen.usage.cached_tokens)

        def put(body: bytes, key: str | None = blend_server.api_key) -> tuple[int, str]:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            req = urllib.request.Request(blend_server.url + CALIBRATION_PATH, data=body, method="PUT", headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    return r.status, r.read().decode()
            except urllib.error.HTTPError as exc:
                return exc.code, exc.read().decode()

        foreign = dataclasses.replace(record, fingerprint="0" * 64, ratio=0.05)
        for body, why in (
            (foreign.to_bytes(), "another model"),
            (dataclasses.replace(record, ratio=1.7).to_bytes(), "damaged"),
            (b"not json", "not JSON"),
        ):
            status, text = put(body)
            assert status == 400 and why in json.loads(text)["error"]["message"], text
        assert put(foreign.to_bytes(), key=None)[0] == 401
        assert client.calibration() == record  # nothing refused was stored
    finally:
        store.delete_record(name)
        time.sleep(RELOAD_S + 0.2)  # no other test sees it
    assert client.calibration() is None


def test_the_client_checks_spans_before_sending(client):
    ids = client.tokenize(BlendPrompt("Read.", ["one two three"], QUESTION)).token_ids
    with pytest.raises(PromptError, match="the prompt ends with chunk 0"):
        client.generate(TokenizedPrompt(ids, [(2, len(ids))]), max_tokens=1)


def test_fuzzing_never_takes_the_server_down(blend_server, capsys):
    """At least 200 malformed bodies from the generator (wrong types, missing fields,
    NaN and infinities, bad spans, huge span lists, deep nesting, non-ASCII
    separators, num_tokens at and past the end, one-token prompts, batches, chat),
    sent four at a time and interleaved with good requests."""
    from benchmarks import fuzz, fuzz_cases

    report = fuzz.run(blend_server.url, cases=240, seed=1, api_key=blend_server.api_key)
    with capsys.disabled():
        print("\n" + fuzz.render(report))
    assert report["malformed"] >= 200 and report["good"] >= 50
    assert not report["violations"], report["violations"]
    assert report["totals"]["rejected"] + report["totals"]["fallback"] == report["malformed"]
    assert report["totals"]["fallback"] > 0 and len(report["outcomes"]) == len(fuzz_cases.GENERATORS)
    assert report["good_same_tokens"] == report["good"] and report["good_after_same_tokens"] == report["good_requests"]
    assert report["ratio_one_equals_full"] and report["healthy_after"] and blend_server.healthy()
    assert fuzz.passed(report)


def test_metrics_equal_the_usage_the_responses_reported(client, blend_server, docs):
    """Blended requests, one computed in full because its separator is not in the
    prompt, one refused at the HTTP edge: the blend series on /metrics move by
    exactly what the responses reported, and the refusal is counted by its field."""
    client.warm(docs)
    before = blend_server.blend_series()
    prompts = [BlendPrompt("Read.", docs[::-1], QUESTION), BlendPrompt("Read.", docs, QUESTION)]
    usages = [client.generate(p, max_tokens=2, recompute_ratio=r).usage for p, r in zip(prompts, (0.15, 0.3))]

    def post(blend: dict) -> int:
        body = {
            "model": client.model_name,
            "prompt": "Read. " + docs[0],
            "max_tokens": 1,
            "kv_transfer_params": {"blend": blend},
        }
        req = urllib.request.Request(
            blend_server.url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {blend_server.api_key}"},
        )
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                assert json.loads(r.read())["kv_transfer_params"]["blend_fallback_reason"] == "invalid_params"
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code

    assert post({"mode": "blend", "separator": "@@no such separator@@"}) == 200  # computed in full
    assert post({"mode": "blend", "ratio": 1.5, "separator": "\n\n"}) == 400  # refused at the edge

    expected = {
        ("vllm:blend_requests_total", (("outcome", "blend"), ("reason", ""))): 2,
        ("vllm:blend_requests_total", (("outcome", "full"), ("reason", "invalid_params"))): 1,
        ("vllm:blend_requests_refused_total", (("reason", "kv_transfer_params.blend.ratio"),)): 1,
        ("vllm:blend_cached_tokens_total", ()): sum(u.cached_tokens for u in usages),
        ("vllm:blend_recomputed_tokens_total", ()): sum(u.recomputed_tokens for u in usages),
        ("vllm:blend_chunks_hit_total", ()): sum(u.chunks_hit for u in usages),
        ("vllm:blend_recompute_ratio_count", ()): 2,
        "store hits, every tier": sum(u.chunks_hit for u in usages),  # the worker's reads of those chunks
    }

    def store_hits(series):
        return sum(v for (name, _), v in series.items() if name == "vllm:blend_store_hits_total")

    deadline = time.monotonic() + 30  # the API server records a step's stats after its outputs
    while True:
        after = blend_server.blend_series()
        moved = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in expected if isinstance(key, tuple)}
        moved["store hits, every tier"] = store_hits(after) - store_hits(before)
        if moved == expected or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert moved == expected
    assert all(u.chunks_hit == len(docs) for u in usages)
    read = {labels: v - before.get((name, labels), 0.0) for (name, labels), v in after.items() if "store_read" in name}
    assert read and all(v >= 0 for v in read.values()) and sum(read.values()) > 0  # bytes and seconds moved too

    # Every series the dashboard and the docs' queries use is on /metrics.
    served = {sample.name for sample in blend_server.metric_samples()}
    used = set()
    for source in (ROOT / "examples" / "grafana-blend.json", ROOT / "docs" / "metrics.md"):
        used |= set(re.findall(r"vllm:[a-z_]+", source.read_text()))
    assert {"vllm:blend_store_hits_total", "vllm:prompt_tokens_total"} <= used
    assert used - {"vllm:blend_recompute_ratio"} <= served  # a histogram's samples: _bucket, _count, _sum


def test_prompt_logprobs_are_vllms_own_and_the_response_says_the_prompt_was_not_blended(client, docs):
    """vLLM computes every prompt token of a request that asks for prompt
    logprobs (it ignores a connector's match then): the connector does not
    blend it, says why, and the logprobs are full prefill's."""
    client.warm(docs)
    tp = client.tokenize(BlendPrompt("Read.", docs[::-1], QUESTION))

    def complete(blend: dict | None) -> dict:
        body = {"model": client.model_name, "prompt": list(tp.token_ids), "max_tokens": 4, "temperature": 0}
        body |= {"prompt_logprobs": 1} | ({"kv_transfer_params": {"blend": blend}} if blend else {})
        req = urllib.request.Request(
            client.base_url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {client._api_key}"},
        )
        with urllib.request.urlopen(req, timeout=300) as resp:
            return json.loads(resp.read())

    spans = [list(s) for s in tp.chunk_spans]
    blended = complete({"mode": "blend", "ratio": 0.15, "chunk_spans": spans, "num_tokens": len(tp) - 1})
    full = complete(None)
    answer = blended["kv_transfer_params"]
    assert answer["blend_fallback_reason"] == "prompt_logprobs" and "prompt logprobs" in answer["blend_fallback"]
    assert answer["blend"]["cached_tokens"] == 0
    (choice,), (full_choice,) = blended["choices"], full["choices"]
    assert len(choice["prompt_logprobs"]) == len(tp) and choice["prompt_logprobs"][0] is None
    assert all(lp is not None for lp in choice["prompt_logprobs"][1:])

    def chosen(logprobs: list) -> list:
        return [{k: round(v["logprob"], 4) for k, v in step.items()} for step in logprobs[1:]]

    assert chosen(choice["prompt_logprobs"]) == chosen(full_choice["prompt_logprobs"])
    assert choice["text"] == full_choice["text"]


def test_the_server_refuses_prefix_caching_by_name(model_dirs, tmp_path):
    """``--enable-prefix-caching`` passed through to vLLM: the connector
    refuses to start (it would serve blended KV from vLLM's prefix cache),
    naming the setting, and the server exits."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "blend_integrations.serve", model_dirs("llama"), "--store", str(tmp_path)]
    cmd += ["--max-model-len", "2048", "--kv-cache-gib", "1", "--enable-prefix-caching"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode != 0
    assert "the blend connector refuses enable_prefix_caching" in done.stderr + done.stdout
    assert "--no-enable-prefix-caching" in done.stderr + done.stdout
