"""Integrations layer: a LlamaIndex synthesizer that keeps every retrieved node
its own chunk, a query engine built on it, and an ingestion step that
precomputes chunk KV (``BlendCacheWarmer``, the same signature as LangChain's)."""

from __future__ import annotations

import asyncio
import warnings
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

from ..chat import RAG_QUESTION, RAG_SYSTEM_PROMPT
from ..engines import Engine
from ..integration import warm, warmer_engine
from .llm import BlendLLM

# The RAG layout's question line, with LlamaIndex's name for the query.
DEFAULT_QUERY_TEMPLATE = RAG_QUESTION.format(question="{query_str}")


class BlendSynthesizer(BaseSynthesizer):
    """Hands each node's text, formatted the way LlamaIndex formats it for an
    LLM (``MetadataMode.LLM``), to the engine as one chunk, all in one call:
    unlike the stock response modes, node texts are never repacked, so their
    chunk KV is reused wherever they land. ``Response.metadata["blend"]`` holds
    ``prompt_tokens``, ``cached_tokens``, ``recomputed_tokens``, ``ttft_s`` and
    more (for a streaming response it is filled once the stream is consumed)."""

    def __init__(
        self,
        llm: BlendLLM,
        *,
        system_prompt: str | None = RAG_SYSTEM_PROMPT,
        query_template: str = DEFAULT_QUERY_TEMPLATE,
        streaming: bool = False,
        callback_manager: CallbackManager | None = None,
        **generation: Any,
    ) -> None:
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

    def synthesize(
        self,
        query: QueryType,
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None,
        **kwargs: Any,
    ) -> RESPONSE_TYPE:
        stats: dict = {}
        response = super().synthesize(query, nodes, additional_source_nodes, blend_stats=stats, **kwargs)
        response.metadata = {**(response.metadata or {}), "blend": stats}
        return response

    async def asynthesize(
        self,
        query: QueryType,
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None,
        **kwargs: Any,
    ) -> RESPONSE_TYPE:
        stats: dict = {}
        response = await super().asynthesize(query, nodes, additional_source_nodes, blend_stats=stats, **kwargs)
        response.metadata = {**(response.metadata or {}), "blend": stats}
        return response


def as_blend_query_engine(
    index_or_retriever: Any,
    llm: BlendLLM,
    *,
    streaming: bool = False,
    system_prompt: str | None = RAG_SYSTEM_PROMPT,
    query_template: str = DEFAULT_QUERY_TEMPLATE,
    node_postprocessors: list[BaseNodePostprocessor] | None = None,
    **retriever_kwargs: Any,
) -> RetrieverQueryEngine:
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


class BlendCacheWarmer(TransformComponent):
    """An ingestion step (``IngestionPipeline(transformations=[splitter, ...,
    BlendCacheWarmer(llm)])``): computes and stores the chunk KV of every node,
    as the synthesizer will send it, so the first query that retrieves it
    already hits. Nodes pass through unchanged; put it after the splitter.
    LangChain's ``BlendCacheWarmer`` takes the same arguments."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    llm: Any = Field(description="a BlendLLM or an Engine")
    show_progress: bool | None = Field(default=None, description="progress bar; None: for more than 8 nodes")
    calibrate: bool = Field(
        default=False, description="calibrate the model on the nodes if the store has no calibration"
    )
    calibrate_options: dict[str, Any] = Field(default_factory=dict, description="options of Engine.calibrate")

    def __init__(
        self,
        llm: BlendLLM | Engine,
        *,
        show_progress: bool | None = None,
        calibrate: bool = False,
        calibrate_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(
            llm=llm, show_progress=show_progress, calibrate=calibrate, calibrate_options=dict(calibrate_options or {})
        )

    @property
    def engine(self) -> Engine:
        return warmer_engine(self.llm, type(self).__name__)

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        show_progress = True if kwargs.get("show_progress") else self.show_progress  # the pipeline's flag wins
        texts = [n.get_content(metadata_mode=MetadataMode.LLM) for n in nodes]
        warm(self.engine, texts, show_progress, calibrate=self.calibrate, **self.calibrate_options)
        return nodes

    async def acall(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        return await asyncio.to_thread(self.__call__, nodes, **kwargs)


class BlendKVWarmup(BlendCacheWarmer):
    """Deprecated: the old name of ``BlendCacheWarmer``."""

    def __init__(self, llm: BlendLLM | Engine, *, show_progress: bool | None = None) -> None:
        warnings.warn("BlendKVWarmup is deprecated; use BlendCacheWarmer", DeprecationWarning, stacklevel=2)
        super().__init__(llm, show_progress=show_progress)
