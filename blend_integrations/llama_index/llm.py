"""Integrations layer: ``BlendLLM``, a LlamaIndex LLM on a blend engine, an
adapter from LlamaIndex's prompts, messages and responses to the shared core
(``blend_integrations.integration``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    TextBlock,
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.llm import LLM

from ..chat import rag_prompt, render_chat, split_text, text_prompt
from ..integration import BlendModelBase
from ..prompt import Part, PromptError, TokenizedPrompt


def _turn(message: ChatMessage) -> dict:
    parts: list[Part] = []
    for block in message.blocks:
        if not isinstance(block, TextBlock):
            raise PromptError(
                f"a blend model reads text only, got a {type(block).__name__} in a {message.role.value} message"
            )
        parts += split_text(block.text)
    return {"role": message.role.value, "content": parts}


class BlendLLM(BlendModelBase, LLM):
    """A LlamaIndex LLM that blends. Build it from ``model=`` (a local path,
    GGUF file or hub id) and ``backend=``, from ``base_url=`` (a blend server),
    or from ``engine=`` so several indexes and chains share one engine and
    store; the fields are those of ``blend_integrations.integration.BlendModelBase``.
    ``mode``, ``recompute_ratio``, ``max_tokens``, ``temperature``, ``top_p``,
    ``seed`` and ``stop`` are also per-call arguments.

    Prompts: ``complete`` splits text on BLEND_SEPARATOR into chunks; ``chat``
    renders messages through the model's chat template (BLEND_SEPARATOR in a
    message marks chunks too); ``complete_chunks`` takes the chunks explicitly.
    Every response carries ``additional_kwargs["blend"]`` (``Generation.stats()``)."""

    def __init__(self, model: str | None = None, **fields: Any) -> None:
        super().__init__(model=model, **fields)

    @classmethod
    def class_name(cls) -> str:
        return "blend_llm"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self.engine.context_length,
            num_output=self.max_tokens,
            is_chat_model=bool(getattr(self.engine.tokenizer, "chat_template", None)),
            model_name=self.engine.model_name,
        )

    # -- prompts ------------------------------------------------------------------

    def chunks_prompt(self, chunks: Sequence[str], query: str, system_prompt: str | None = None) -> TokenizedPrompt:
        """The RAG layout (``rag_prompt``) with ``query`` as the question, as
        given: system prompt, then the chunks, then the query; every chunk
        tokenized alone. ``system_prompt=None``: the ``system_prompt`` field."""
        if not chunks:
            raise PromptError("no chunks given: pass at least one text (an empty retrieval has nothing to blend)")
        return rag_prompt(
            chunks,
            query,
            self.engine.tokenizer,
            self.engine.config.separator,
            system=system_prompt if system_prompt is not None else self.system_prompt,
            question_template="{question}",
        )

    def _chat_prompt(self, messages: Sequence[ChatMessage]) -> TokenizedPrompt:
        if self.system_prompt and not any(m.role == MessageRole.SYSTEM for m in messages):
            messages = [ChatMessage(role=MessageRole.SYSTEM, content=self.system_prompt), *messages]
        return render_chat([_turn(m) for m in messages], self.engine.tokenizer, self.engine.config.separator)

    def _completion_prompt(self, prompt: str, formatted: bool) -> TokenizedPrompt | str:
        if not formatted and self.completion_to_prompt is not None:
            prompt = self.completion_to_prompt(prompt)
        return text_prompt(prompt, self.engine.tokenizer)

    # -- generation, one implementation per call style ------------------------------

    def _complete(self, prompt: TokenizedPrompt | str, kwargs: dict) -> CompletionResponse:
        gen = self.engine.generate(prompt, **self._call_settings(kwargs))
        return CompletionResponse(text=gen.text, raw=gen, additional_kwargs={"blend": gen.stats()})

    async def _acomplete(self, prompt: TokenizedPrompt | str, kwargs: dict) -> CompletionResponse:
        gen = await self.engine.agenerate(prompt, **self._call_settings(kwargs))
        return CompletionResponse(text=gen.text, raw=gen, additional_kwargs={"blend": gen.stats()})

    def _stream(self, prompt: TokenizedPrompt | str, kwargs: dict) -> Iterator[CompletionResponse]:
        stream = self.engine.stream(prompt, **self._call_settings(kwargs))
        text = ""
        for delta in stream:
            text += delta
            yield CompletionResponse(text=text, delta=delta)
        yield CompletionResponse(
            text=text, delta="", raw=stream.result(), additional_kwargs={"blend": stream.result().stats()}
        )

    async def _astream(self, prompt: TokenizedPrompt | str, kwargs: dict) -> AsyncIterator[CompletionResponse]:
        stream = self.engine.astream(prompt, **self._call_settings(kwargs))
        text = ""
        async for delta in stream:
            text += delta
            yield CompletionResponse(text=text, delta=delta)
        yield CompletionResponse(
            text=text, delta="", raw=stream.result(), additional_kwargs={"blend": stream.result().stats()}
        )

    @staticmethod
    def _as_chat(r: CompletionResponse) -> ChatResponse:
        return ChatResponse(
            message=ChatMessage(role=MessageRole.ASSISTANT, content=r.text),
            delta=r.delta,
            raw=r.raw,
            additional_kwargs=r.additional_kwargs,
        )

    # -- LlamaIndex LLM API ---------------------------------------------------------

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._complete(self._completion_prompt(prompt, formatted), kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._stream(self._completion_prompt(prompt, formatted), kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await self._acomplete(self._completion_prompt(prompt, formatted), kwargs)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        return self._astream(self._completion_prompt(prompt, formatted), kwargs)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._as_chat(self._complete(self._chat_prompt(messages), kwargs))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return (self._as_chat(r) for r in self._stream(self._chat_prompt(messages), kwargs))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._as_chat(await self._acomplete(self._chat_prompt(messages), kwargs))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        async def gen() -> ChatResponseAsyncGen:
            async for r in self._astream(self._chat_prompt(messages), kwargs):
                yield self._as_chat(r)

        return gen()

    # -- chunks given explicitly ----------------------------------------------------

    def complete_chunks(
        self, chunks: Sequence[str], query: str, *, system_prompt: str | None = None, **kwargs: Any
    ) -> CompletionResponse:
        """Answer ``query`` from ``chunks`` (retrieved texts, each its own chunk)."""
        return self._complete(self.chunks_prompt(chunks, query, system_prompt), kwargs)

    def stream_complete_chunks(
        self, chunks: Sequence[str], query: str, *, system_prompt: str | None = None, **kwargs: Any
    ) -> CompletionResponseGen:
        return self._stream(self.chunks_prompt(chunks, query, system_prompt), kwargs)

    async def acomplete_chunks(
        self, chunks: Sequence[str], query: str, *, system_prompt: str | None = None, **kwargs: Any
    ) -> CompletionResponse:
        return await self._acomplete(self.chunks_prompt(chunks, query, system_prompt), kwargs)

    def astream_complete_chunks(
        self, chunks: Sequence[str], query: str, *, system_prompt: str | None = None, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        return self._astream(self.chunks_prompt(chunks, query, system_prompt), kwargs)
