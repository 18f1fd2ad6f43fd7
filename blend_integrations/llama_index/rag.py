"""A synthesizer that keeps every retrieved node its own chunk, a query engine
built on it, and an ingestion step that precomputes chunk KV."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.response.schema import RESPONSE_TYPE
from llama_index.core.callbacks import CallbackManager
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts.mixin import PromptDictType
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.response_synthesizers import BaseSynthesizer
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, QueryType, TransformComponent
from llama_index.core.types import RESPONSE_TEXT_TYPE
from pydantic import ConfigDict, Field

from ..chat import RAG_SYSTEM_PROMPT
from ..engines import Engine
from .llm import BlendLLM

DEFAULT_QUERY_TEMPLATE = "Question: {query_str}"


class BlendSynthesizer(BaseSynthesizer):
    """Hands each node's text, formatted the way LlamaIndex formats it for an
    LLM (``MetadataMode.LLM``), to the engine as one chunk, all in one call:
    unlike the stock response modes, node texts are never repacked, so their
    chunk KV is reused wherever they land. ``Response.metadata["blend"]`` holds
    ``prompt_tokens``, ``cached_tokens``, ``recomputed_tokens``, ``ttft_s`` and
    more (for a streaming response it is filled once the stream is consumed)."""

    def __init__(self, llm: BlendLLM, *, system_prompt: str | None = RAG_SYSTEM_PROMPT,
                 query_template: str = DEFAULT_QUERY_TEMPLATE, streaming: bool = False,
                 callback_manager: CallbackManager | None = None, **generation: Any) -> None:
        if not isinstance(llm, BlendLLM):
            raise TypeError(f"BlendSynthesizer needs a blend_integrations BlendLLM, got {type(llm).__name__}")
        if "{query_str}" not in query_template:
            raise ValueError(f"query_template needs a {{query_str}} field, got {query_template!r}")
        super().__init__(llm=llm, callback_manager=callback_manager, streaming=streaming)
        self._blend_llm = llm
        self.system_prompt, self.query_template, self.generation = system_prompt, query_template, generation

    def _get_prompts(self) -> PromptDictType:
        return {}

    def _update_prompts(self, prompts_dict: PromptDictType) -> None:
        pass

    def _call(self, query_str: str, text_chunks: Sequence[str], kwargs: dict) -> tuple[tuple, dict, dict]:
        """(chunks, query) for the LLM, its options, and the dict the stats go to."""
        stats = kwargs.pop("blend_stats", {})
        args = (list(text_chunks), self.query_template.format(query_str=query_str))
        return args, {"system_prompt": self.system_prompt, **self.generation, **kwargs}, stats

    def get_response(self, query_str: str, text_chunks: Sequence[str], **kwargs: Any) -> RESPONSE_TEXT_TYPE:
        args, options, stats = self._call(query_str, text_chunks, kwargs)
        if self._streaming:
            return self._deltas(self._blend_llm.stream_complete_chunks(*args, **options), stats)
        response = self._blend_llm.complete_chunks(*args, **options)
        stats.update(response.additional_kwargs["blend"])
        return response.text

    async def aget_response(self, query_str: str, text_chunks: Sequence[str], **kwargs: Any) -> RESPONSE_TEXT_TYPE:
        args, options, stats = self._call(query_str, text_chunks, kwargs)
        if self._streaming:
            return self._adeltas(self._blend_llm.astream_complete_chunks(*args, **options), stats)
        response = await self._blend_llm.acomplete_chunks(*args, **options)
        stats.update(response.additional_kwargs["blend"])
        return response.text

    @staticmethod
    def _deltas(responses: Iterator, stats: dict) -> Iterator[str]:
        for r in responses:
            stats.update(r.additional_kwargs.get("blend", {}))
            if r.delta:
                yield r.delta

    @staticmethod
    async def _adeltas(responses: AsyncIterator, stats: dict) -> AsyncIterator[str]:
        async for r in responses:
            stats.update(r.additional_kwargs.get("blend", {}))
            if r.delta:
                yield r.delta

    def synthesize(self, query: QueryType, nodes: list[NodeWithScore],
                   additional_source_nodes: Sequence[NodeWithScore] | None = None, **kwargs: Any) -> RESPONSE_TYPE:
        stats: dict = {}
        response = super().synthesize(query, nodes, additional_source_nodes, blend_stats=stats, **kwargs)
        response.metadata = {**(response.metadata or {}), "blend": stats}
        return response

    async def asynthesize(self, query: QueryType, nodes: list[NodeWithScore],
                          additional_source_nodes: Sequence[NodeWithScore] | None = None, **kwargs: Any) -> RESPONSE_TYPE:
        stats: dict = {}
        response = await super().asynthesize(query, nodes, additional_source_nodes, blend_stats=stats, **kwargs)
        response.metadata = {**(response.metadata or {}), "blend": stats}
        return response


def as_blend_query_engine(index_or_retriever: Any, llm: BlendLLM, *, streaming: bool = False,
                          system_prompt: str | None = RAG_SYSTEM_PROMPT, query_template: str = DEFAULT_QUERY_TEMPLATE,
                          node_postprocessors: list[BaseNodePostprocessor] | None = None,
                          **retriever_kwargs: Any) -> RetrieverQueryEngine:
    """A query engine over an index (``retriever_kwargs``, e.g. ``similarity_top_k``,
    go to ``index.as_retriever``) or a retriever, answering with ``BlendSynthesizer``."""
    if isinstance(index_or_retriever, BaseRetriever):
        if retriever_kwargs:
            raise TypeError(f"retriever options ({', '.join(sorted(retriever_kwargs))}) need an index, not a retriever")
        retriever = index_or_retriever
    elif hasattr(index_or_retriever, "as_retriever"):
        retriever = index_or_retriever.as_retriever(**retriever_kwargs)
    else:
        raise TypeError(f"give an index or a retriever, got {type(index_or_retriever).__name__}")
    synthesizer = BlendSynthesizer(llm, system_prompt=system_prompt, query_template=query_template, streaming=streaming)
    return RetrieverQueryEngine(retriever, response_synthesizer=synthesizer, node_postprocessors=node_postprocessors)


class BlendKVWarmup(TransformComponent):
    """An ingestion step (``IngestionPipeline(transformations=[splitter, ...,
    BlendKVWarmup(llm=...)])``): computes and stores the chunk KV of every node,
    as the synthesizer will send it, so the first query that retrieves it
    already hits. Nodes pass through unchanged; put it after the splitter."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    llm: Any = Field(description="a BlendLLM or an Engine")
    show_progress: bool | None = Field(default=None, description="progress bar; None: for more than 8 nodes")

    @property
    def engine(self) -> Engine:
        return self.llm.engine if isinstance(self.llm, BlendLLM) else self.llm

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        if not isinstance(self.engine, Engine):
            raise TypeError(f"BlendKVWarmup needs a BlendLLM or an Engine, got {type(self.llm).__name__}")
        texts = [n.get_content(metadata_mode=MetadataMode.LLM) for n in nodes]
        progress = True if kwargs.get("show_progress") else self.show_progress  # the pipeline's flag wins
        self.engine.warm([t for t in texts if t], progress=progress)
        return nodes

    async def acall(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        return await asyncio.to_thread(self.__call__, nodes, **kwargs)
