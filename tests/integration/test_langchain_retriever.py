"""A real vector-store retriever reorders the same documents between two questions:
the blend RAG chain still reads every chunk from the cache, on both engines."""

from __future__ import annotations

import sys
from pathlib import Path

from langchain_core.documents import Document
from langchain_core.vectorstores import InMemoryVectorStore

from blend_integrations.langchain import ChatBlend, create_blend_rag_chain

# The local embeddings live with the examples, not in the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from local_embeddings import LangChainMiniLM


def contents(result: dict) -> list[str]:
    return [d.page_content for d in result["documents"]]


def test_retriever_reorder_reads_every_chunk_from_the_cache(any_engine, docs):
    store = InMemoryVectorStore.from_documents([Document(page_content=d) for d in docs], LangChainMiniLM())
    retriever = store.as_retriever(search_kwargs={"k": len(docs)})
    chain = create_blend_rag_chain(retriever, ChatBlend(engine=any_engine, max_tokens=8, recompute_ratio=1.0))

    # A document's own text is its nearest neighbour, so each question puts another document first.
    first = chain.invoke(docs[0])
    second = chain.invoke(docs[-1])
    assert contents(first)[0] == docs[0] and contents(second)[0] == docs[-1]
    assert contents(first) != contents(second) and sorted(contents(first)) == sorted(contents(second)) == sorted(docs)

    # The docs are new, so the first question computed the chunks and the second read all of them back.
    assert first["answer"].response_metadata["chunks_hit"] == 0
    chunk_tokens = sum(len(any_engine.tokenizer.encode(d, add_special_tokens=False)) for d in docs)
    assert chunk_tokens > 0
    assert second["answer"].usage_metadata["input_token_details"]["cache_read"] == chunk_tokens
    assert second["answer"].response_metadata["chunks_hit"] == len(docs)

    # At ratio 1.0 blending recomputes every token: the answer is full prefill's, documents in the same order.
    full = create_blend_rag_chain(retriever, ChatBlend(engine=any_engine, max_tokens=8, mode="full")).invoke(docs[-1])
    assert contents(full) == contents(second)
    assert second["answer"].content == full["answer"].content
