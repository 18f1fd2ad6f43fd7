"""LlamaIndex integration on the real engines (transformers and vLLM) with a small
local model and real local embeddings (all-MiniLM-L6-v2) in a VectorStoreIndex."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import MetadataMode, TextNode

from blend_integrations.chat import BLEND_SEPARATOR, separated
from blend_integrations.llama_index import BlendCacheWarmer, BlendLLM, BlendSynthesizer, as_blend_query_engine
from blend_integrations.prompt import PromptError

# The local embeddings live with the examples, not in the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from local_embeddings import LlamaIndexMiniLM

STATS = {"prompt_tokens", "cached_tokens", "recomputed_tokens", "ttft_s"}


def make_index(docs):
    """Nodes with metadata, so the LLM-formatted text differs from the raw text."""
    nodes = [TextNode(text=d, id_=f"doc{i}", metadata={"source": f"doc{i}.txt"}) for i, d in enumerate(docs)]
    return VectorStoreIndex(nodes, embed_model=LlamaIndexMiniLM())


def llm_texts(response) -> list[str]:
    return [n.node.get_content(metadata_mode=MetadataMode.LLM) for n in response.source_nodes]


def token_count(engine, texts) -> int:
    return sum(len(engine.tokenizer.encode(t, add_special_tokens=False)) for t in texts)


def test_query_engine_reordered_nodes_are_cached_and_ratio_one_is_full(any_engine, docs):
    index = make_index(docs)
    engine = as_blend_query_engine(
        index, BlendLLM(engine=any_engine, max_tokens=8, recompute_ratio=1.0), similarity_top_k=len(docs)
    )
    # a node's own text is its nearest neighbour: each query puts another node first
    first, second = engine.query(docs[0]), engine.query(docs[-1])
    assert llm_texts(first)[0].endswith(docs[0]) and llm_texts(second)[0].endswith(docs[-1])
    assert llm_texts(first) != llm_texts(second) and sorted(llm_texts(first)) == sorted(llm_texts(second))
    assert all(t.startswith("source: doc") for t in llm_texts(first))  # metadata is part of each chunk

    assert set(first.metadata["blend"]) >= STATS and first.metadata["blend"]["chunks_hit"] == 0
    stats = second.metadata["blend"]
    assert stats["cached_tokens"] == token_count(any_engine, llm_texts(second)) > 0
    assert stats["chunks_hit"] == len(docs) and stats["ttft_s"] > 0
    assert stats["prompt_tokens"] > stats["cached_tokens"]

    full = as_blend_query_engine(
        index, BlendLLM(engine=any_engine, max_tokens=8, mode="full"), similarity_top_k=len(docs)
    ).query(docs[-1])
    assert llm_texts(full) == llm_texts(second)
    assert full.response == second.response and full.metadata["blend"]["cached_tokens"] == 0


def test_query_engine_streaming_and_async(any_engine, docs):
    index = make_index(docs)
    llm = BlendLLM(engine=any_engine, max_tokens=10)
    plain = as_blend_query_engine(index, llm, similarity_top_k=3)
    streaming = as_blend_query_engine(index, llm, similarity_top_k=3, streaming=True)
    plain.query(docs[1])  # computes the chunks: every call below blends the same way
    expected = plain.query(docs[1])

    streamed = streaming.query(docs[1])
    assert "".join(streamed.response_gen) == expected.response
    assert streamed.metadata["blend"]["cached_tokens"] == expected.metadata["blend"]["cached_tokens"] > 0

    async def run():
        answer = await plain.aquery(docs[1])
        stream = await streaming.aquery(docs[1])
        text = "".join([t async for t in stream.async_response_gen()])
        return answer, text, stream

    answer, text, stream = asyncio.run(run())
    assert answer.response == text == expected.response
    assert answer.metadata["blend"]["chunks_hit"] == stream.metadata["blend"]["chunks_hit"] == 3


def test_llm_api_sync_async_and_streaming(any_engine, docs):
    any_engine.warm(docs)
    llm = BlendLLM(engine=any_engine, max_tokens=10)
    meta = llm.metadata
    assert (meta.context_window, meta.num_output, meta.model_name, meta.is_chat_model) == (
        any_engine.context_length,
        10,
        any_engine.model_name,
        True,
    )

    prompt = "Read." + separated(docs) + "Question: which city?"
    done = llm.complete(prompt)
    assert done.additional_kwargs["blend"]["chunks_hit"] == len(docs)
    streamed = list(llm.stream_complete(prompt))
    assert "".join(r.delta for r in streamed) == streamed[-1].text == done.text
    assert streamed[-1].additional_kwargs["blend"]["cached_tokens"] == done.additional_kwargs["blend"]["cached_tokens"]

    messages = [
        ChatMessage(role=MessageRole.SYSTEM, content="Answer from the documents."),
        ChatMessage(role=MessageRole.USER, content=separated(docs) + "Which city?"),
    ]
    chat = llm.chat(messages)
    assert chat.message.role == MessageRole.ASSISTANT and chat.additional_kwargs["blend"]["chunks_hit"] == len(docs)
    assert "".join(r.delta for r in llm.stream_chat(messages)) == chat.message.content
    explicit = llm.complete_chunks(docs, "Which city?", system_prompt="Answer from the documents.")
    assert explicit.text == chat.message.content  # the same prompt, chunks given directly

    async def run():
        return (
            await llm.acomplete(prompt),
            [r async for r in await llm.astream_complete(prompt)],
            await llm.achat(messages),
            [r async for r in await llm.astream_chat(messages)],
            await llm.acomplete_chunks(docs[::-1], "Which city?"),
            [
                r
                async for r in llm.astream_complete_chunks(
                    docs, "Which city?", system_prompt="Answer from the documents."
                )
            ],
        )

    acomplete, astream, achat, astream_chat, reordered, astream_chunks = asyncio.run(run())
    assert acomplete.text == "".join(r.delta for r in astream) == done.text
    assert achat.message.content == "".join(r.delta for r in astream_chat) == chat.message.content
    assert "".join(r.delta for r in astream_chunks) == explicit.text
    assert reordered.additional_kwargs["blend"]["cached_tokens"] == token_count(any_engine, docs)

    stop = done.text[2:5]
    assert llm.complete(prompt, stop=[stop]).text == done.text[: done.text.index(stop)]
    assert llm.complete(prompt, max_tokens=2).additional_kwargs["blend"]["completion_tokens"] <= 2
    assert llm.complete(prompt, mode="full").additional_kwargs["blend"]["cached_tokens"] == 0


def test_explicit_chunks_are_tokenized_alone(engine, docs):
    llm = BlendLLM(engine=engine)
    prompt = llm.chunks_prompt(docs, "Which city?", system_prompt="Be brief.")
    assert [prompt.chunk_ids(i) for i in range(len(docs))] == [
        engine.tokenizer.encode(d, add_special_tokens=False) for d in docs
    ]
    rendered = engine.tokenizer.decode(prompt.token_ids)
    assert rendered.startswith("<s><|system|>\nBe brief.</s>\n<|user|>\n") and rendered.endswith(
        "Which city?</s>\n<|assistant|>\n"
    )


def test_stock_response_modes_with_blend_llm_as_a_plain_llm(any_engine, docs):
    index = make_index(docs)
    llm = BlendLLM(engine=any_engine, max_tokens=6)
    for mode in ("compact", "refine", "tree_summarize", "simple_summarize"):
        response = index.as_query_engine(llm=llm, response_mode=mode, similarity_top_k=2).query("Which city?")
        assert isinstance(response.response, str) and len(response.source_nodes) == 2, mode
    streamed = index.as_query_engine(llm=llm, response_mode="compact", streaming=True, similarity_top_k=2).query(
        "Which city?"
    )
    assert isinstance("".join(streamed.response_gen), str)


def test_ingestion_warmup_makes_the_first_query_hit(any_engine, docs):
    llm = BlendLLM(engine=any_engine, max_tokens=6)
    embed = LlamaIndexMiniLM()
    pipeline = IngestionPipeline(
        transformations=[
            SentenceSplitter(chunk_size=64, chunk_overlap=0),
            embed,
            BlendCacheWarmer(llm=llm, show_progress=False),
        ]
    )
    nodes = pipeline.run(documents=[Document(text=d, metadata={"source": f"doc{i}"}) for i, d in enumerate(docs)])
    assert len(nodes) > len(docs)  # the splitter made several nodes per document
    index = VectorStoreIndex(nodes, embed_model=embed)
    response = as_blend_query_engine(index, llm, similarity_top_k=4).query(docs[2])
    assert response.metadata["blend"]["chunks_hit"] == 4 and response.metadata["blend"]["chunks_missed"] == 0

    more = [d + " Also" for d in docs]  # new text: the async pipeline computes it
    async_nodes = asyncio.run(
        IngestionPipeline(
            transformations=[SentenceSplitter(chunk_size=64, chunk_overlap=0), BlendCacheWarmer(llm=any_engine)]
        ).arun(documents=[Document(text=d) for d in more])
    )
    texts = [n.get_content(metadata_mode=MetadataMode.LLM) for n in async_nodes]
    assert all(
        any_engine.chunk_key(any_engine.tokenizer.encode(t, add_special_tokens=False)) in any_engine.store
        for t in texts
    )


def test_errors(engine, docs):
    with pytest.raises(ValueError, match="give model="):
        BlendLLM()
    with pytest.raises(ValueError, match="must be a blend_integrations Engine"):
        BlendLLM(engine="not an engine")
    llm = BlendLLM(engine=engine)
    with pytest.raises(TypeError, match="unexpected generation arguments: colour"):
        llm.complete("hi", colour="red")
    with pytest.raises(PromptError, match="no chunks given"):
        llm.complete_chunks([], "Which city?")
    with pytest.raises(TypeError, match="needs a blend_integrations BlendLLM"):
        BlendSynthesizer(llm=None)
    with pytest.raises(ValueError, match="needs a {query_str} field"):
        BlendSynthesizer(llm, query_template="Question:")
    with pytest.raises(TypeError, match="give an index or a retriever, got list"):
        as_blend_query_engine(docs, llm)
    with pytest.raises(TypeError, match="retriever options .*similarity_top_k.* need an index"):
        as_blend_query_engine(make_index(docs).as_retriever(), llm, similarity_top_k=2)
    assert BLEND_SEPARATOR.strip() == "<blend-chunk/>"
