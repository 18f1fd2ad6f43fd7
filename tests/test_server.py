"""The blend server (vLLM's OpenAI server with the connector) and its client, over loopback."""

from __future__ import annotations

import pytest

from blend_integrations import BlendPrompt, load_engine
from blend_integrations.engines.server_engine import ServerError

QUESTION = "Question: which city is named in the documents? Answer:"


@pytest.fixture(scope="module")
def client(blend_server):
    return load_engine(blend_server, backend="server")


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
    assert blended.usage.recomputed_tokens == embedded.usage.recomputed_tokens == round(0.15 * blended.usage.cached_tokens)
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


def test_server_errors_are_clear(client):
    with pytest.raises(ValueError, match="server's chunk store"):
        load_engine(client.base_url, backend="server", store=object())
    with pytest.raises(ServerError, match="cannot reach the blend server"):
        load_engine("http://127.0.0.1:9", backend="server")


def test_text_only_caller_with_the_separator_fallback(client, docs):
    """A plain HTTP client with nothing but text: the server finds the chunks between separators."""
    import json
    import urllib.request

    text = "\n\n".join(["You answer questions."] + docs + [QUESTION])

    def complete(blend):
        body = {"model": client.model_name, "prompt": text, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        if blend:
            body["kv_transfer_params"] = {"blend": {"mode": "blend", "ratio": 1.0, "separator": "\n\n"}}
        req = urllib.request.Request(client.base_url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=300).read())

    full = complete(False)
    first = complete(True)
    assert first["kv_transfer_params"]["blend"]["chunks_missed"] == len(docs)
    again = complete(True)  # the chunks found in the text were saved after the first request
    assert again["kv_transfer_params"]["blend"]["chunks_hit"] == len(docs)
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"] == full["choices"][0]["token_ids"]


def test_integrations_reach_the_server_by_url(blend_server, docs):
    """ChatBlend and the LlamaIndex BlendLLM built from the server's URL: the server keeps the store."""
    from blend_integrations.langchain import ChatBlend
    from blend_integrations.llama_index import BlendLLM

    chat = ChatBlend(model=blend_server, backend="server", max_tokens=4)
    llm = BlendLLM(blend_server, backend="server", max_tokens=4)
    chat.engine.warm(docs)
    stats = llm.complete_chunks(docs[::-1], QUESTION).additional_kwargs["blend"]
    assert (stats["chunks_hit"], stats["chunks_missed"]) == (len(docs), 0)
    assert chat.invoke("Say something.").response_metadata["chunks_hit"] == 0
