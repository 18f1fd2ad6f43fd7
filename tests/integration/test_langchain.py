"""LangChain classes on the real engines (transformers and vLLM) with a small local model."""

from __future__ import annotations

import asyncio

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import HumanMessage, SystemMessage

from blend_integrations.langchain import (
    BLEND_SEPARATOR,
    BlendLLM,
    ChatBlend,
    chunk_block,
    format_docs,
    messages_to_prompt,
)

QUESTION = "Question: which city is named in the documents?"


def chat_messages(docs):
    return [
        SystemMessage("Answer from the documents."),
        HumanMessage(content=[chunk_block(d) for d in docs] + [{"type": "text", "text": QUESTION}]),
    ]


class Results(BaseCallbackHandler):
    def __init__(self):
        self.results = []

    def on_llm_end(self, response, **kwargs):
        self.results.append(response)


class Tokens(BaseCallbackHandler):
    def __init__(self):
        self.tokens = []

    def on_llm_new_token(self, token, **kwargs):
        self.tokens.append(token)


def test_chunks_keep_their_own_tokens_inside_the_chat_template(engine, docs):
    tp = messages_to_prompt(chat_messages(docs), engine.tokenizer, "\n\n")
    assert [tp.chunk_ids(i) for i in range(len(docs))] == [
        engine.tokenizer.encode(d, add_special_tokens=False) for d in docs
    ]
    rendered = engine.tokenizer.decode(tp.token_ids)
    assert "<|system|>" in rendered and "<|user|>" in rendered and rendered.rstrip().endswith("<|assistant|>")
    # BLEND_SEPARATOR inside a message's text marks the same chunks
    text_form = messages_to_prompt(
        [chat_messages(docs)[0], HumanMessage(format_docs(docs) + QUESTION)], engine.tokenizer, "\n\n"
    )
    assert [text_form.chunk_ids(i) for i in range(len(docs))] == [tp.chunk_ids(i) for i in range(len(docs))]


def test_chat_reordered_documents_are_cache_reads_and_ratio_one_is_full(any_engine, docs):
    chat = ChatBlend(engine=any_engine, max_tokens=10)
    chat.invoke(chat_messages(docs))
    reordered = chat_messages(docs[::-1])
    again = chat.invoke(reordered, recompute_ratio=1.0)
    chunk_tokens = sum(len(any_engine.tokenizer.encode(d, add_special_tokens=False)) for d in docs)
    assert again.usage_metadata["input_token_details"]["cache_read"] == chunk_tokens
    assert again.response_metadata["chunks_hit"] == len(docs)
    assert again.response_metadata["model_name"] == any_engine.model_name
    assert again.response_metadata["ttft_s"] > 0
    assert again.content == chat.invoke(reordered, mode="full").content


def test_chat_stream_async_batch_and_callbacks(any_engine, docs):
    any_engine.warm(docs)
    chat = ChatBlend(engine=any_engine, max_tokens=12)
    msgs = chat_messages(docs)
    expected = chat.invoke(msgs).content
    handler = Tokens()
    chunks = list(chat.stream(msgs, config={"callbacks": [handler]}))
    assert "".join(c.content for c in chunks) == expected == "".join(handler.tokens)
    assert chunks[-1].usage_metadata["output_tokens"] > 0

    async def run():
        streamed = [c async for c in chat.astream(msgs)]
        return streamed, await chat.ainvoke(msgs)

    streamed, ainvoked = asyncio.run(run())
    assert "".join(c.content for c in streamed) == ainvoked.content == expected
    assert streamed[-1].usage_metadata["input_token_details"]["cache_read"] > 0
    assert [m.content for m in chat.batch([msgs, msgs])] == [expected, expected]
    assert chat.bind(max_tokens=3).invoke(msgs).usage_metadata["output_tokens"] <= 3


def test_chat_stop(engine, docs):
    engine.warm(docs)
    chat = ChatBlend(engine=engine, max_tokens=20)
    full = chat.invoke(chat_messages(docs)).content
    stop = full[4:7]
    assert chat.invoke(chat_messages(docs), stop=[stop]).content == full[: full.index(stop)]


def test_llm_invoke_stream_async_batch_stop(any_engine, docs):
    any_engine.warm(docs)
    llm = BlendLLM(engine=any_engine, max_tokens=12)
    prompt = "Answer from the documents." + format_docs(docs) + QUESTION
    text = llm.invoke(prompt)
    assert "".join(llm.stream(prompt)) == text
    assert llm.batch([prompt, prompt]) == [text, text]

    async def run():
        return "".join([c async for c in llm.astream(prompt)]), await llm.ainvoke(prompt)

    assert asyncio.run(run()) == (text, text)
    stop = text[3:6]
    assert llm.invoke(prompt, stop=[stop]) == text[: text.index(stop)]
    result = llm.generate([prompt]).generations[0][-1].generation_info
    assert result["chunks_hit"] == len(docs) and result["usage"]["input_token_details"]["cache_read"] > 0


def test_llm_separator_text_is_split_into_chunks(engine, docs):
    llm = BlendLLM(engine=engine, max_tokens=4)
    prompt = "Read." + BLEND_SEPARATOR + BLEND_SEPARATOR.join(docs) + BLEND_SEPARATOR + QUESTION
    llm.invoke(prompt)
    info = llm.generate([prompt]).generations[0][-1].generation_info
    assert info["chunks_hit"] == len(docs)


def test_stuff_documents_chain_with_blend_separator(any_engine, docs):
    """LangChain's stuff-documents chain: BLEND_SEPARATOR as document_separator, and
    around {context} in the prompt, makes every document a chunk."""
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain
    from langchain_core.documents import Document
    from langchain_core.prompts import ChatPromptTemplate, PromptTemplate

    any_engine.warm(docs)
    documents = [Document(page_content=d) for d in docs]
    context = "Documents:" + BLEND_SEPARATOR + "{context}" + BLEND_SEPARATOR + QUESTION
    chat_prompt = ChatPromptTemplate.from_messages([("system", "Answer from the documents."), ("human", context)])
    seen = Results()
    answers = {}
    for mode in ("blend", "full"):
        chain = create_stuff_documents_chain(
            ChatBlend(engine=any_engine, max_tokens=8, mode=mode, recompute_ratio=1.0),
            chat_prompt,
            document_separator=BLEND_SEPARATOR,
        )
        answers[mode] = chain.invoke({"context": documents}, config={"callbacks": [seen]})
    meta = seen.results[0].generations[0][0].message.response_metadata
    assert meta["chunks_hit"] == len(docs) and meta["chunks_missed"] == 0
    assert answers["blend"] == answers["full"]

    text_chain = create_stuff_documents_chain(
        BlendLLM(engine=any_engine, max_tokens=4),
        PromptTemplate.from_template(context),
        document_separator=BLEND_SEPARATOR,
    )
    text_chain.invoke({"context": documents}, config={"callbacks": [seen]})
    assert seen.results[-1].generations[0][0].generation_info["chunks_hit"] == len(docs)


def test_construction_errors(engine):
    with pytest.raises(ValueError, match="give model="):
        ChatBlend()
    with pytest.raises(ValueError, match="must be a blend_integrations Engine"):
        ChatBlend(engine=object())
    with pytest.raises(TypeError, match="unexpected generation arguments: colour"):
        ChatBlend(engine=engine).invoke("hi", colour="red")


def _retriever(docs_in_order):
    from langchain_core.documents import Document
    from langchain_core.runnables import RunnableLambda

    return RunnableLambda(lambda question: [Document(page_content=d) for d in docs_in_order()])


def test_rag_chain_warmed_documents_hit_and_the_answer_streams(any_engine, docs):
    """(The reorder through a real vector-store retriever is in test_langchain_retriever.py.)"""
    from langchain_core.documents import Document

    from blend_integrations.langchain import BlendCacheWarmer, create_blend_rag_chain

    BlendCacheWarmer(any_engine, show_progress=False).transform_documents([Document(page_content=d) for d in docs])
    chain = create_blend_rag_chain(_retriever(lambda: docs), ChatBlend(engine=any_engine, max_tokens=8))
    first = chain.invoke("which city?")
    assert [d.page_content for d in first["documents"]] == docs
    assert first["answer"].response_metadata["chunks_hit"] == len(docs)
    assert chain.invoke({"question": "which city?"})["answer"].content == first["answer"].content
    streamed = [c for c in chain.stream("which city?") if "answer" in c]
    assert "".join(c["answer"].content for c in streamed) == first["answer"].content


def test_rag_chain_with_text_llm(engine, docs):
    from blend_integrations.langchain import create_blend_rag_chain

    engine.warm(docs)
    chain = create_blend_rag_chain(_retriever(lambda: docs), BlendLLM(engine=engine, max_tokens=6))
    out = chain.invoke("which city?")
    assert isinstance(out["answer"], str)
    with pytest.raises(ValueError, match="question string"):
        chain.invoke(42)
