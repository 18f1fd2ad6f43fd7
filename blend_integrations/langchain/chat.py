"""Integrations layer: ``BlendLLM`` (a LangChain ``LLM``) and ``ChatBlend`` (a
``BaseChatModel``), adapters from LangChain's prompts, messages and results to
the shared core (``blend_integrations.integration``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.llms import LLM
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ToolMessage
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult, GenerationChunk, LLMResult
from langchain_core.outputs import Generation as LCGeneration
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool

from .. import tool_calls
from ..chat import render_chat, separated, split_text, text_prompt
from ..engines import Generation
from ..integration import BlendModelBase
from ..prompt import Part, PromptError, TokenizedPrompt

ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool", "chat": "user"}


def chunk_block(text: str) -> dict:
    """A content block that marks ``text`` (a retrieved document) as a chunk."""
    return {"type": "text", "text": text, "chunk": True}


def format_docs(docs: Sequence[Any]) -> str:
    """LCEL ``format_docs`` that makes every document a chunk."""
    return separated([getattr(d, "page_content", d) for d in docs])


def _content_parts(content: str | list) -> list[Part]:
    if isinstance(content, str):
        return split_text(content)
    parts: list[Part] = []
    for block in content:
        if isinstance(block, str):
            parts += split_text(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts += [Part(block["text"], chunk=True)] if block.get("chunk") else split_text(block["text"])
        elif isinstance(block, dict) and block.get("type") in ("tool_use", "tool_call"):
            continue  # an AIMessage's tool_calls field carries the same call
        else:
            raise PromptError(f"unsupported content block for a blend model: {block!r:.80}")
    return parts


def _turn(message: BaseMessage) -> dict:
    """One message as a chat-template turn (the OpenAI-style dicts HF templates read)."""
    turn = {"role": ROLES.get(message.type, message.type), "content": _content_parts(message.content)}
    if isinstance(message, AIMessage) and message.tool_calls:
        turn["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["args"]}}
            for c in message.tool_calls
        ]
    if isinstance(message, ToolMessage):
        turn["tool_call_id"] = message.tool_call_id
        if message.name:
            turn["name"] = message.name
    return turn


def messages_to_prompt(
    messages: Sequence[BaseMessage],
    tokenizer,
    separator: str,
    *,
    tools: list[dict] | None = None,
    reply_prefix: str = "",
) -> TokenizedPrompt:
    """Render messages through the model's own chat template with every chunk
    (chunk block or BLEND_SEPARATOR piece) kept a separate, alone-tokenized part.
    ``tools``: OpenAI-style tool schemas; ``reply_prefix``: text the reply starts with."""
    return render_chat([_turn(m) for m in messages], tokenizer, separator, tools=tools, reply_prefix=reply_prefix)


class _BlendModel(BlendModelBase):
    """What both LangChain classes add to the shared core: LangSmith's
    parameters, and a generation's usage and metadata in LangChain's terms."""

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs):
        params = super()._get_ls_params(stop=stop, **kwargs)  # type: ignore[misc]  # the framework class mixed in
        params["ls_provider"] = "blend_integrations"
        params["ls_model_name"] = kwargs.get("model") or self.engine.model_name
        params["ls_temperature"] = kwargs.get("temperature", self.temperature)
        params["ls_max_tokens"] = kwargs.get("max_tokens", self.max_tokens)
        if stop or self.stop:
            params["ls_stop"] = list(self.stop or []) + list(stop or [])
        return params

    @property
    def _identifying_params(self) -> dict:
        return {"model": self.engine.model_name, "backend": self.engine.backend, "mode": self.mode}

    def _metadata(self, gen: Generation) -> dict:
        return {"model_name": self.engine.model_name, **gen.stats()}

    @staticmethod
    def _usage(gen: Generation) -> dict:
        u = gen.usage
        return {
            "input_tokens": u.prompt_tokens,
            "output_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "input_token_details": {"cache_read": u.cached_tokens},
        }


class BlendLLM(_BlendModel, LLM):
    """A text-completion model that blends: chunks are marked by BLEND_SEPARATOR."""

    @property
    def _llm_type(self) -> str:
        return "blend"

    def _prompt(self, prompt: str) -> TokenizedPrompt | str:
        return text_prompt(prompt, self.engine.tokenizer)

    def _call(
        self, prompt: str, stop: list[str] | None = None, run_manager: CallbackManagerForLLMRun | None = None, **kwargs
    ) -> str:
        return self.engine.generate(self._prompt(prompt), **self._call_settings(kwargs, stop)).text

    def _info(self, gen: Generation) -> dict:
        return {**self._metadata(gen), "usage": self._usage(gen)}

    def _result(self, gens: list[Generation]) -> LLMResult:
        return LLMResult(generations=[[LCGeneration(text=g.text, generation_info=self._info(g))] for g in gens])

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs,
    ) -> LLMResult:
        settings = self._call_settings(kwargs, stop)
        return self._result(self.engine.generate_many([self._prompt(p) for p in prompts], **settings))

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs,
    ) -> LLMResult:
        settings = self._call_settings(kwargs, stop)
        gens = await asyncio.gather(*(self.engine.agenerate(self._prompt(p), **settings) for p in prompts))
        return self._result(list(gens))

    def _stream(
        self, prompt: str, stop: list[str] | None = None, run_manager: CallbackManagerForLLMRun | None = None, **kwargs
    ) -> Iterator[GenerationChunk]:
        stream = self.engine.stream(self._prompt(prompt), **self._call_settings(kwargs, stop))
        for delta in stream:
            chunk = GenerationChunk(text=delta)
            if run_manager:
                run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        yield GenerationChunk(text="", generation_info=self._info(stream.result()))

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs,
    ) -> AsyncIterator[GenerationChunk]:
        stream = self.engine.astream(self._prompt(prompt), **self._call_settings(kwargs, stop))
        async for delta in stream:
            chunk = GenerationChunk(text=delta)
            if run_manager:
                await run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        yield GenerationChunk(text="", generation_info=self._info(stream.result()))


def _tool_choice(choice: Any, tools: list[dict]) -> str:
    """ "auto", "none", "any", or the name of the tool the reply must call."""
    names = [t["function"]["name"] for t in tools]
    if isinstance(choice, dict):  # {"type": "function", "function": {"name": ...}} or {"name": ...}
        choice = choice.get("function", choice).get("name", choice)
    if choice in (None, "auto"):
        return "auto"
    if choice in ("none", False):
        return "none"
    if choice in ("any", "required", True):
        return names[0] if len(names) == 1 else "any"
    if isinstance(choice, str) and choice in names:
        return choice
    raise ValueError(
        f"tool_choice must be 'auto', 'none', 'any', 'required' or one of the bound tools "
        f"({', '.join(names)}), got {choice!r:.80}"
    )


class ChatBlend(_BlendModel, BaseChatModel):
    """A chat model that blends: messages go through the model's chat template,
    and chunk content blocks or BLEND_SEPARATOR pieces stay separate chunks."""

    tool_call_format: str | None = None
    """How the model writes tool calls: ``"hermes"``, ``"mistral"``, ``"mistral-args"``
    or ``"llama3"`` (see ``blend_integrations.tool_calls``); ``None``: read from the chat template."""

    @property
    def _llm_type(self) -> str:
        return "blend-chat"

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: str | dict | bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools for chat templates that render them. ``tool_choice``:
        "auto" (default, the model decides), "none", "any"/"required" (some
        tool) or a tool's name; a forced call is made by starting the reply
        with the call's opening in the template's format."""
        self._tool_format()
        schemas = [convert_to_openai_tool(t) for t in tools]
        return super().bind(tools=schemas, tool_choice=_tool_choice(tool_choice, schemas), **kwargs)

    def _tool_format(self) -> str:
        if self.tool_call_format is not None:
            return tool_calls.check_format(self.tool_call_format)
        template = tool_calls.template_text(self.engine.tokenizer)
        fmt = tool_calls.detect_format(template)
        if fmt is None:
            what = "renders no tools" if "tools" not in template else "writes tool calls in a format not parsed here"
            raise ValueError(
                f"the chat template of {self.engine.model_name} {what}; tool calling needs a template "
                f"in one of the formats {', '.join(tool_calls.FORMATS)} (set tool_call_format= "
                "if the template uses one of them but is not recognised)"
            )
        return fmt

    def _request(
        self, messages: list[BaseMessage], kwargs: dict
    ) -> tuple[TokenizedPrompt, tool_calls.ReplyStream | None]:
        """The prompt, and (with tools) the parser of the reply."""
        tools = [convert_to_openai_tool(t) for t in kwargs.pop("tools", None) or []]
        choice = _tool_choice(kwargs.pop("tool_choice", None), tools) if tools else "none"
        if choice == "none":
            return messages_to_prompt(messages, self.engine.tokenizer, self.engine.config.separator), None
        fmt = self._tool_format()
        prefix = "" if choice == "auto" else tool_calls.prefill(fmt, None if choice == "any" else choice)
        prompt = messages_to_prompt(
            messages, self.engine.tokenizer, self.engine.config.separator, tools=tools, reply_prefix=prefix
        )
        return prompt, tool_calls.ReplyStream(fmt, forced=bool(prefix), prefix=prefix)

    def _result(self, gen: Generation, replies: tool_calls.ReplyStream | None) -> ChatResult:
        content, calls = gen.text, {}
        if replies is not None:
            replies.feed(gen.text)
            reply = replies.finish()[1]
            content, calls = (
                reply.content,
                {
                    "tool_calls": [tool_call(name=c.name, args=c.arguments, id=c.id) for c in reply.calls],
                    "invalid_tool_calls": [
                        invalid_tool_call(name=c.name, args=c.arguments, id=c.id, error=c.error) for c in reply.bad
                    ],
                },
            )
        message = AIMessage(
            content=content, usage_metadata=self._usage(gen), response_metadata=self._metadata(gen), **calls
        )
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _final(self, gen: Generation, reply: tool_calls.Reply | None) -> AIMessageChunk:
        # the calls go as chunks; LangChain builds tool_calls/invalid_tool_calls from them
        chunks = (
            []
            if reply is None
            else (
                [
                    tool_call_chunk(name=c.name, args=json.dumps(c.arguments), id=c.id, index=i)
                    for i, c in enumerate(reply.calls)
                ]
                + [
                    tool_call_chunk(name=c.name, args=c.arguments, id=c.id, index=len(reply.calls) + i)
                    for i, c in enumerate(reply.bad)
                ]
            )
        )
        return AIMessageChunk(
            content="",
            usage_metadata=self._usage(gen),
            response_metadata=self._metadata(gen),
            tool_call_chunks=chunks,
            chunk_position="last",
        )

    # Not built from _stream with LangChain's generate_from_stream: merging streamed chunks rebuilds
    # tool calls from their text, which drops an invalid call's error and can read a cut-off call as valid.
    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs,
    ) -> ChatResult:
        prompt, replies = self._request(messages, kwargs)
        return self._result(self.engine.generate(prompt, **self._call_settings(kwargs, stop)), replies)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs,
    ) -> ChatResult:
        prompt, replies = self._request(messages, kwargs)
        return self._result(await self.engine.agenerate(prompt, **self._call_settings(kwargs, stop)), replies)

    @staticmethod
    def _content(delta: str, replies: tool_calls.ReplyStream | None) -> ChatGenerationChunk | None:
        text = replies.feed(delta) if replies is not None else delta
        return ChatGenerationChunk(message=AIMessageChunk(content=text)) if text else None

    def _tail(self, gen: Generation, replies: tool_calls.ReplyStream | None) -> Iterator[ChatGenerationChunk]:
        tail, reply = replies.finish() if replies is not None else ("", None)
        if tail:
            yield ChatGenerationChunk(message=AIMessageChunk(content=tail))
        yield ChatGenerationChunk(message=self._final(gen, reply))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs,
    ) -> Iterator[ChatGenerationChunk]:
        prompt, replies = self._request(messages, kwargs)
        stream = self.engine.stream(prompt, **self._call_settings(kwargs, stop))
        for delta in stream:
            if chunk := self._content(delta, replies):
                if run_manager:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        for chunk in self._tail(stream.result(), replies):
            if run_manager and chunk.text:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs,
    ) -> AsyncIterator[ChatGenerationChunk]:
        prompt, replies = self._request(messages, kwargs)
        stream = self.engine.astream(prompt, **self._call_settings(kwargs, stop))
        async for delta in stream:
            if chunk := self._content(delta, replies):
                if run_manager:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        for chunk in self._tail(stream.result(), replies):
            if run_manager and chunk.text:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk
