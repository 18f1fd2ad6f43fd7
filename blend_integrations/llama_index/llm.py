"""``BlendLLM``: a LlamaIndex LLM on a blend engine."""

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
from pydantic import Field, PrivateAttr

from ..chat import render_chat, split_text, text_prompt
from ..config import BlendConfig
from ..engines import Engine, load_engine
from ..prompt import Part, PromptError, TokenizedPrompt, tokenize_parts
from ..store import ChunkStore

SETTINGS = ("max_tokens", "temperature", "top_p", "seed", "mode", "recompute_ratio", "stop")


def _turn(message: ChatMessage) -> dict:
    parts: list[Part] = []
    for block in message.blocks:
        if not isinstance(block, TextBlock):
            raise PromptError(f"a blend model reads text only, got a {type(block).__name__} in a {message.role.value} message")
        parts += split_text(block.text)
    return {"role": message.role.value, "content": parts}


class BlendLLM(LLM):
    """A LlamaIndex LLM that blends. Build it from ``model=`` (a local path or
    hub id, or a server URL) and ``backend=`` ("transformers", "vllm" or "server"), with ``store=`` (a
    ``ChunkStore``) or ``store_path=``, or from ``engine=`` so several indexes
    and chains share one engine and store. ``mode``, ``recompute_ratio``,
    ``max_tokens``, ``temperature``, ``top_p``, ``seed`` and ``stop`` are also
    per-call arguments.

    Prompts: ``complete`` splits text on BLEND_SEPARATOR into chunks; ``chat``
    renders messages through the model's chat template (BLEND_SEPARATOR in a
    message marks chunks too); ``complete_chunks`` takes the chunks explicitly.
    Every response carries ``additional_kwargs["blend"]`` (``Generation.stats()``)."""

    model: str | None = Field(default=None, description="local path or hub id of the model")
    backend: str = Field(default="transformers", description='"transformers", "vllm" or "server"')
    store_path: str | None = Field(default=None, description="chunk store directory (default: the user cache)")
    engine_kwargs: dict = Field(default_factory=dict, description="backend options for load_engine")
    mode: str = Field(default="blend", description='"blend", "full" or "reuse"')
    recompute_ratio: float | None = Field(default=None, description="None: the engine config's ratio")
    max_tokens: int = Field(default=256, description="tokens to generate at most")
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | None = None
    base_url: str | None = Field(default=None, description="a blend server's URL: the server backend, no model= needed")
    api_key: str | None = Field(default=None, exclude=True, repr=False,
                                description="the key of a server started with --api-key (default: $BLEND_API_KEY)")

    _engine: Engine = PrivateAttr()

    def __init__(self, model: str | None = None, *, engine: Engine | None = None, store: ChunkStore | None = None,
                 config: BlendConfig | None = None, **kwargs: Any) -> None:
        super().__init__(model=model, **kwargs)
        if self.base_url is not None:
            if "backend" in self.model_fields_set and self.backend != "server":
                raise ValueError(f"base_url= is a blend server's URL, for backend='server', not {self.backend!r}")
            self.backend = "server"
        if engine is None:
            target = self.base_url or model
            if target is None:
                raise ValueError("give model= (a local path, hub id or server URL), base_url= (a blend server's URL) "
                                 "or engine= (a loaded Engine)")
            kwargs = dict(self.engine_kwargs)
            if self.backend == "server":
                if self.api_key is not None:
                    kwargs.setdefault("api_key", self.api_key)
            elif store is None:  # a server keeps its own store (and in-process engines ignore api_key)
                store = ChunkStore(self.store_path)
            engine = load_engine(target, backend=self.backend, store=store, config=config or BlendConfig(), **kwargs)
        elif not isinstance(engine, Engine):
            raise ValueError(f"engine must be a blend_integrations Engine, got {type(engine).__name__}")
        self._engine = engine

    @classmethod
    def class_name(cls) -> str:
        return "blend_llm"

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self._engine.context_length,
            num_output=self.max_tokens,
            is_chat_model=bool(getattr(self._engine.tokenizer, "chat_template", None)),
            model_name=self._engine.model_name,
        )

    # -- prompts ------------------------------------------------------------------

    def chunks_prompt(self, chunks: Sequence[str], query: str, system_prompt: str | None = None) -> TokenizedPrompt:
        """System prompt, then the chunks, then the query, in the model's chat
        template if it has one; every chunk tokenized alone."""
        system_prompt = system_prompt if system_prompt is not None else self.system_prompt
        if not chunks:
            raise PromptError("no chunks given: pass at least one text (an empty retrieval has nothing to blend)")
        parts = [Part(c, chunk=True) for c in chunks] + [Part(query)]
        if not self.metadata.is_chat_model:
            return tokenize_parts(([Part(system_prompt + "\n\n")] if system_prompt else []) + parts, self._engine.tokenizer)
        turns = ([{"role": "system", "content": [Part(system_prompt)]}] if system_prompt else []) + [
            {"role": "user", "content": parts}]
        return render_chat(turns, self._engine.tokenizer, self._engine.config.separator)

    def _chat_prompt(self, messages: Sequence[ChatMessage]) -> TokenizedPrompt:
        if self.system_prompt and not any(m.role == MessageRole.SYSTEM for m in messages):
            messages = [ChatMessage(role=MessageRole.SYSTEM, content=self.system_prompt), *messages]
        return render_chat([_turn(m) for m in messages], self._engine.tokenizer, self._engine.config.separator)

    def _completion_prompt(self, prompt: str, formatted: bool) -> TokenizedPrompt | str:
        if not formatted and self.completion_to_prompt is not None:
            prompt = self.completion_to_prompt(prompt)
        return text_prompt(prompt, self._engine.tokenizer)

    def _settings(self, kwargs: dict) -> dict:
        unexpected = set(kwargs) - set(SETTINGS)
        if unexpected:
            raise TypeError(f"unexpected generation arguments: {', '.join(sorted(unexpected))}")
        settings = {name: kwargs.get(name, getattr(self, name)) for name in SETTINGS}
        settings["stop"] = list(self.stop or []) + list(kwargs.get("stop") or [])
        return settings

    # -- generation, one implementation per call style ------------------------------

    def _complete(self, prompt: TokenizedPrompt | str, kwargs: dict) -> CompletionResponse:
        gen = self._engine.generate(prompt, **self._settings(kwargs))
        return CompletionResponse(text=gen.text, raw=gen, additional_kwargs={"blend": gen.stats()})

    async def _acomplete(self, prompt: TokenizedPrompt | str, kwargs: dict) -> CompletionResponse:
        gen = await self._engine.agenerate(prompt, **self._settings(kwargs))
        return CompletionResponse(text=gen.text, raw=gen, additional_kwargs={"blend": gen.stats()})

    def _stream(self, prompt: TokenizedPrompt | str, kwargs: dict) -> Iterator[CompletionResponse]:
        stream = self._engine.stream(prompt, **self._settings(kwargs))
        text = ""
        for delta in stream:
            text += delta
            yield CompletionResponse(text=text, delta=delta)
        yield CompletionResponse(text=text, delta="", raw=stream.generation,
                                 additional_kwargs={"blend": stream.generation.stats()})

    async def _astream(self, prompt: TokenizedPrompt | str, kwargs: dict) -> AsyncIterator[CompletionResponse]:
        stream = self._engine.astream(prompt, **self._settings(kwargs))
        text = ""
        async for delta in stream:
            text += delta
            yield CompletionResponse(text=text, delta=delta)
        yield CompletionResponse(text=text, delta="", raw=stream.generation,
                                 additional_kwargs={"blend": stream.generation.stats()})

    @staticmethod
    def _as_chat(r: CompletionResponse) -> ChatResponse:
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=r.text), delta=r.delta, raw=r.raw,
                            additional_kwargs=r.additional_kwargs)

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

    def complete_chunks(self, chunks: Sequence[str], query: str, *, system_prompt: str | None = None,
                        **kwargs: Any) -> CompletionResponse:
        """Answer ``query`` from ``chunks`` (retrieved texts, each its own chunk)."""
        return self._complete(self.chunks_prompt(chunks, query, system_prompt), kwargs)

    def stream_complete_chunks(self, chunks: Sequence[str], query: str, *, system_prompt: str | None = None,
                               **kwargs: Any) -> CompletionResponseGen:
        return self._stream(self.chunks_prompt(chunks, query, system_prompt), kwargs)

    async def acomplete_chunks(self, chunks: Sequence[str], query: str, *, system_prompt: str | None = None,
                               **kwargs: Any) -> CompletionResponse:
        return await self._acomplete(self.chunks_prompt(chunks, query, system_prompt), kwargs)

    def astream_complete_chunks(self, chunks: Sequence[str], query: str, *, system_prompt: str | None = None,
                                **kwargs: Any) -> CompletionResponseAsyncGen:
        return self._astream(self.chunks_prompt(chunks, query, system_prompt), kwargs)
