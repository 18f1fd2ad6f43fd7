"""How the recomputed tokens are chosen (``BlendConfig.selection``): by KV
deviation, by the query's attention, or half each, on every engine."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch

from blend_integrations import BlendConfig, BlendPrompt, ChunkStore, load_engine
from blend_integrations.chat import rag_prompt
from blend_integrations.config import SELECTIONS
from blend_integrations.fusion import KVCache, ReusedSpan, forward
from blend_integrations.langchain import BlendLLM
from blend_integrations.prompt import TokenizedPrompt

QUESTION = "Question: which city is named in the documents? Answer:"


@pytest.mark.parametrize("selection", SELECTIONS)
def test_ratio_one_equals_full_prefill_for_every_selection(any_engine, docs, selection):
    any_engine.warm(docs)
    for prompt in (
        BlendPrompt("You answer questions.", docs[::-1], QUESTION),
        BlendPrompt("Question: which city is named? Documents follow.", docs, "Answer:"),  # the question first
    ):
        full = any_engine.generate(prompt, max_tokens=10, mode="full")
        blend = any_engine.generate(prompt, max_tokens=10, recompute_ratio=1.0, selection=selection)
        assert blend.usage.chunks_hit == len(docs)
        assert blend.usage.cached_tokens == blend.usage.recomputed_tokens > 0
        assert blend.token_ids == full.token_ids


def test_every_selection_reports_the_same_usage_on_both_engines(vllm_engine, engine, docs):
    """The usage counts tokens, whichever are chosen: the vLLM connector reports
    its plan's, the transformers engine the walk's."""
    engine.warm(docs)
    prompt = BlendPrompt("Read.", docs[::-1], QUESTION)
    for selection in SELECTIONS:
        a = engine.generate(prompt, max_tokens=1, selection=selection)
        b = vllm_engine.generate(prompt, max_tokens=1, selection=selection)
        assert (a.usage.cached_tokens, a.usage.recomputed_tokens) == (b.usage.cached_tokens, b.usage.recomputed_tokens)


def test_query_tail_scores_the_questions_own_tail_on_both_engines(vllm_engine, engine, docs):
    """Through a chat template, "query-tail" scores the question's last tokens, not the template's
    end of turn and assistant header after them: where the question ends travels with the prompt to
    the walk on both engines (to vLLM's in ``kv_transfer_params``), and they keep the same tokens."""
    tp = rag_prompt(docs, "Which city is named in the documents?", engine.tokenizer, engine.config.separator)
    assert tp.question_end is not None and tp.question_end < len(tp) - 1
    engine.warm(docs)
    asked = {"max_tokens": 1, "selection": "query-tail", "recompute_ratio": 0.3, "check_layers": [0]}
    here, there = engine.generate(tp, **asked), vllm_engine.generate(tp, **asked)
    assert here.recomputed_positions and here.recomputed_positions == there.recomputed_positions
    # scored at the prompt's end instead (the template's tokens), the walk keeps others
    untold = TokenizedPrompt(tp.token_ids, tp.chunk_spans)
    assert engine.generate(untold, **asked).recomputed_positions != here.recomputed_positions


DOCS = [
    "Maplewood Press was founded by Zorbex Quill in 1931. Its first office stood in Tarrant, near the old harbour.",
    "Lina Vost was born in Okafor City. She studied engineering and later moved to Kestrel Bay to build bridges.",
    "Harbor Glassworks makes bottles and jars. The company employs two hundred people and ships across the region.",
]
QUESTIONS = [  # one about each document
    "Who founded Maplewood Press?",
    "Where was Lina Vost born?",
    "How many people does Harbor Glassworks employ?",
]


def recomputed_per_document(engine, question: str, selection: str) -> list[int]:
    """How many tokens of each document the walk recomputes at ratio 0.3,
    on the engine's own model and standalone chunk KV."""
    tp = rag_prompt(DOCS, question, engine.tokenizer, engine.config.separator)
    spans = tp.chunk_spans
    reused = [ReusedSpan(a, engine.blender.compute_chunk(tp.token_ids[a:b]).kv) for a, b in spans]
    with torch.inference_mode():
        _, stats = forward(
            engine.layers,
            KVCache.allocate(engine.layers, len(tp)),
            torch.tensor(tp.token_ids),
            reused=reused,
            schedule=[(1, 0.3)],
            selection=selection,
            query_start=spans[-1][1],
        )
    return [sum(a <= i < b for i in stats.kept) for a, b in spans]


def test_the_question_decides_which_document_is_recomputed(smollm2_gguf, tmp_path):
    """On SmolLM2 (a real model: its attention reads the question): a document
    gets more of its tokens recomputed when the question is about it than
    when it is about another document. Deviation cannot tell: the documents
    come before the question, so their deviation is the same whatever is asked."""
    engine = load_engine(str(smollm2_gguf), store=ChunkStore(tmp_path / "store"), device="cpu")
    by_query = [recomputed_per_document(engine, q, "query") for q in QUESTIONS]
    by_deviation = [recomputed_per_document(engine, q, "deviation") for q in QUESTIONS]
    assert by_deviation[0] == by_deviation[1] == by_deviation[2]
    for doc, asked in enumerate(by_query):
        others = [counts[doc] for counts in by_query if counts is not asked]
        assert asked[doc] > max(others), (doc, by_query)


def test_bad_selections_get_clear_errors(engine, docs, blend_server):
    with pytest.raises(ValueError, match="selection must be one of deviation, query, query-tail, mixed; got 'hkvd'"):
        BlendConfig(selection="hkvd")
    with pytest.raises(
        ValueError, match="selection must be one of deviation, query, query-tail, mixed; got 'attention'"
    ):
        engine.generate(BlendPrompt("Read.", docs, QUESTION), max_tokens=1, selection="attention")
    llm = BlendLLM(engine=engine, max_tokens=2, selection="Query")
    with pytest.raises(ValueError, match="selection must be one of deviation, query, query-tail, mixed; got 'Query'"):
        llm.invoke("Say something.")
    # over HTTP: refused at the server's edge, naming the field; the server goes on
    body = {
        "model": "m",
        "prompt": list(range(1, 40)),
        "max_tokens": 1,
        "kv_transfer_params": {"blend": {"mode": "blend", "chunk_spans": [[2, 10]], "selection": "best"}},
    }
    request = urllib.request.Request(
        blend_server.url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {blend_server.api_key}"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=300)
    error = json.loads(refused.value.read())["error"]
    assert refused.value.code == 400 and error["param"] == "kv_transfer_params.blend.selection"
    served = load_engine(blend_server.url, backend="server", api_key=blend_server.api_key)
    prompt = BlendPrompt("Read.", docs, QUESTION)
    full = served.generate(prompt, max_tokens=6, mode="full")
    assert served.generate(prompt, max_tokens=6, recompute_ratio=1.0, selection="query").token_ids == full.token_ids


def test_sink_tokens_and_gradual_filtering_compose_with_query_selection(engines, docs):
    engine = engines(config=BlendConfig(sink_tokens=2, check_layers=(1, 2), selection="query"))
    engine.warm(docs)
    prompt = BlendPrompt("Read.", docs[::-1], QUESTION)
    full = engine.generate(prompt, max_tokens=8, mode="full")
    assert engine.generate(prompt, max_tokens=8, recompute_ratio=1.0).token_ids == full.token_ids
    usage = engine.generate(prompt, max_tokens=1).usage
    chunk_tokens = sum(len(engine.tokenizer.encode(d, add_special_tokens=False)) for d in docs)
    assert usage.cached_tokens == chunk_tokens - 2 * len(docs)  # each chunk's first 2 tokens are fresh
    assert usage.recomputed_tokens == round(0.15 * usage.cached_tokens)  # the last check layer's share
