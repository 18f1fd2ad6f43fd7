"""Integrations layer: LangChain's retriever-aware pieces, a RAG chain that hands
documents over as chunks, and a cache warmer (the same signature as LlamaIndex's)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from operator import itemgetter
from typing import Any

from langchain_core.documents import BaseDocumentTransformer, Document
from langchain_core.messages import HumanMessage
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import Runnable, RunnableLambda, RunnablePassthrough

from ..chat import RAG_QUESTION, RAG_SYSTEM_PROMPT
from ..engines import Engine
from ..integration import renamed, warm, warmer_engine
from .chat import BlendLLM, ChatBlend, chunk_block, format_docs

# The RAG layout (``rag_prompt``); the chain puts the documents before the question.
DEFAULT_PROMPT = ChatPromptTemplate.from_messages([("system", RAG_SYSTEM_PROMPT), ("human", RAG_QUESTION)])


def create_blend_rag_chain(
    retriever: Runnable, llm: ChatBlend | BlendLLM, prompt: ChatPromptTemplate | None = None
) -> Runnable:
    """question (a string or ``{"question": ...}``) -> ``{"question", "documents", "answer"}``.

    The retrieved ``Document``s go to the model as chunks directly: content
    blocks placed before the text of the prompt's last human message (for a
    ``BlendLLM``, BLEND_SEPARATOR pieces before the rendered prompt's end).
    ``answer`` is the model's message (a string for a ``BlendLLM``); it
    streams. ``prompt`` needs a ``{question}`` variable.
    """
    prompt = prompt or DEFAULT_PROMPT

    def normalize(x: Any) -> dict:
        if isinstance(x, str):
            return {"question": x}
        if isinstance(x, dict) and "question" in x:
            return {**x}
        raise ValueError(f'the chain takes a question string or {{"question": ...}}, got {x!r:.80}')

    def model_input(x: dict):
        docs = [d.page_content for d in x["documents"]]
        variables = {k: v for k, v in x.items() if k != "documents"}
        if isinstance(llm, BlendLLM):
            text = prompt.format(**variables)
            return format_docs(docs) + text
        messages = prompt.format_messages(**variables)
        humans = [i for i, m in enumerate(messages) if isinstance(m, HumanMessage)]
        if not humans:
            raise ValueError("the prompt needs a human message for the documents to go in")
        i = humans[-1]
        text = (
            messages[i].content
            if isinstance(messages[i].content, list)
            else [{"type": "text", "text": messages[i].content}]
        )
        messages[i] = HumanMessage(content=[chunk_block(d) for d in docs] + text)
        return messages

    return (
        RunnableLambda(normalize)
        | RunnablePassthrough.assign(documents=itemgetter("question") | retriever)
        | RunnablePassthrough.assign(answer=RunnableLambda(model_input) | llm)
    ).with_config(run_name="blend_rag_chain")


class BlendCacheWarmer(BaseDocumentTransformer):
    """A document transformer for ingestion: computes and stores every
    document's chunk KV, so the first query that retrieves it already hits.
    Documents pass through unchanged. ``llm``: a ``ChatBlend``, ``BlendLLM`` or
    ``Engine``; ``show_progress=None``: a progress bar for more than 8
    documents. ``calibrate=True``: after warming, calibrate the model on these
    documents if the store holds no calibration of it yet (``Engine.calibrate``;
    ``calibrate_options`` are its options), so that ``recompute_ratio="auto"``
    uses a measured ratio. LlamaIndex's ``BlendCacheWarmer`` takes the same
    arguments (``model=`` and ``progress=`` are the deprecated names of the first two)."""

    def __init__(
        self,
        llm: ChatBlend | BlendLLM | Engine | None = None,
        *,
        show_progress: bool | None = None,
        model: ChatBlend | BlendLLM | Engine | None = None,
        progress: bool | None = None,
        calibrate: bool = False,
        calibrate_options: dict[str, Any] | None = None,
    ) -> None:
        if model is not None:
            llm = renamed("model", "llm", model)
        if progress is not None:
            show_progress = renamed("progress", "show_progress", progress)
        self.engine = warmer_engine(llm, type(self).__name__)
        self.show_progress = show_progress
        self.calibrate = calibrate
        self.calibrate_options = dict(calibrate_options or {})

    def transform_documents(self, documents: Sequence[Document], **kwargs: Any) -> Sequence[Document]:
        texts = [d.page_content for d in documents]
        warm(self.engine, texts, self.show_progress, calibrate=self.calibrate, **self.calibrate_options)
        return documents

    async def atransform_documents(self, documents: Sequence[Document], **kwargs: Any) -> Sequence[Document]:
        return await asyncio.to_thread(self.transform_documents, documents, **kwargs)
