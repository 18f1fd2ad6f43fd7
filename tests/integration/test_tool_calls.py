"""Tool calling: the parser of each format (whole and streamed), and ChatBlend.bind_tools
on the real engines, whose local model's chat template renders tools in the Hermes format."""

from __future__ import annotations

import asyncio
import json

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

from blend_integrations import tool_calls
from blend_integrations.langchain import ChatBlend, chunk_block, messages_to_prompt
from tests.fixtures.local_models import CHAT_TEMPLATE

# (format, generated text, expected content, expected calls [(name, args)], expected bad call names)
CASES = [
    ("hermes", "Paris is sunny today.", "Paris is sunny today.", [], []),
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "Let me check.",
        [("get_weather", {"city": "Paris"})],
        [],
    ),
    (
        "hermes",
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": [2, 3]}"}</tool_call>',
        "",
        [("a", {"x": 1}), ("b", {"y": [2, 3]})],
        [],
    ),
    ("hermes", '<tool_call>{"name": "a", "arguments": {"x": 1</tool_call>', "", [], ["a"]),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', "", [], [None]),
    ("hermes", "a < b and <tool but no call", "a < b and <tool but no call", [], []),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]',
        "",
        [("a", {"x": 1}), ("b", {})],
        [],
    ),
    ("mistral", '[{"name": "a", "arguments": {"x": 1}}]', "", [("a", {"x": 1})], []),  # marker dropped by decoding
    ("mistral", "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", [], []),
    ("mistral", '[TOOL_CALLS][{"name": "a", "argum', "", [], [None]),
    (
        "mistral-args",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]b[ARGS]{}',
        "",
        [("get_weather", {"city": "Paris"}), ("b", {})],
        [],
    ),
    ("mistral-args", 'get_weather{"city": "Paris"}', "", [("get_weather", {"city": "Paris"})], []),
    ("mistral-args", "Paris is nice", "Paris is nice", [], []),
    ("mistral-args", '[TOOL_CALLS]get_weather[ARGS]{"city": ', "", [], ["get_weather"]),
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [("get_weather", {"city": "Paris"})],
        [],
    ),
    (
        "llama3",
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"q": "x"}}',
        "",
        [("a", {}), ("b", {"q": "x"})],
        [],
    ),
    ("llama3", "{not json, just braces}", "{not json, just braces}", [], []),
    ("llama3", "<|python_tag|>{not json", "", [], [None]),
    ("llama3", "The answer is 4.", "The answer is 4.", [], []),
]


def summary(reply: tool_calls.Reply):
    return reply.content, [(c.name, c.arguments) for c in reply.calls], [b.name for b in reply.bad]


@pytest.mark.parametrize(("fmt", "text", "content", "calls", "bad"), CASES)
def test_parse(fmt, text, content, calls, bad):
    assert summary(tool_calls.parse(text, fmt)) == (content, calls, bad)


@pytest.mark.parametrize(("fmt", "text", "content", "calls", "bad"), CASES)
def test_streamed_reply_never_shows_a_call_as_content(fmt, text, content, calls, bad):
    for pieces in ([text[i : i + 1] for i in range(len(text))], [text[:7], text[7:]], [text]):
        stream = tool_calls.ReplyStream(fmt)
        shown = "".join(stream.feed(p) for p in pieces)
        tail, reply = stream.finish()
        assert content.startswith(shown)
        assert shown + tail == content
        assert summary(reply) == (content, calls, bad)


def test_ids_from_the_model_are_kept_and_others_are_unique():
    reply = tool_calls.parse(
        '[{"name": "a", "arguments": {}, "id": "abc123XYZ"}, {"name": "b", "arguments": {}}]', "mistral"
    )
    assert reply.calls[0].id == "abc123XYZ"
    other = tool_calls.parse('{"name": "b", "parameters": {}}', "llama3").calls[0].id
    assert reply.calls[1].id.startswith("call_") and reply.calls[1].id != other


@pytest.mark.parametrize("fmt", tool_calls.FORMATS)
def test_forced_reply_starts_with_the_prefill(fmt):
    closing = {"hermes": "}\n</tool_call>", "mistral": "}]", "mistral-args": "", "llama3": "}"}[fmt]
    named = tool_calls.prefill(fmt, "get_weather") + '{"city": "Oslo"}' + closing
    assert summary(tool_calls.parse(named, fmt, forced=True)) == ("", [("get_weather", {"city": "Oslo"})], [])
    if fmt != "mistral-args":
        key = "parameters" if fmt == "llama3" else "arguments"
        anyone = tool_calls.prefill(fmt, None) + f'lookup", "{key}": {{"q": 1}}' + closing
        assert summary(tool_calls.parse(anyone, fmt, forced=True)) == ("", [("lookup", {"q": 1})], [])
    # a forced reply the model botched is a bad call, not content
    assert tool_calls.parse(tool_calls.prefill(fmt, "get_weather") + "Oslo", fmt, forced=True).bad


def test_format_detection():
    assert tool_calls.detect_format(CHAT_TEMPLATE) == "hermes"
    assert (
        tool_calls.detect_format("{% if tools %}{{ '[AVAILABLE_TOOLS]' }}{% endif %}[TOOL_CALLS]{{ c | tojson }}")
        == "mistral"
    )
    assert (
        tool_calls.detect_format("{% for t in tools %}[TOOL_CALLS]{{ c.name }}[ARGS]{{ c.arguments }}{% endfor %}")
        == "mistral-args"
    )
    assert tool_calls.detect_format("{% if tools %}<|python_tag|>{% endif %}{{ 'ipython' }}") == "llama3"
    assert tool_calls.detect_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert tool_calls.detect_format("{% if tools %}<function_call>{% endif %}") is None
    with pytest.raises(ValueError, match="tool_call_format must be one of hermes"):
        tool_calls.check_format("xml")


# -- ChatBlend on the real engines ----------------------------------------------------------


def get_weather(city: str) -> str:
    """Today's weather in a city."""
    return f"sunny in {city}"


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def history(docs):
    return [
        SystemMessage("Answer from the documents; call tools when needed."),
        HumanMessage(content=[chunk_block(d) for d in docs] + [{"type": "text", "text": "Weather in the city?"}]),
        AIMessage(
            [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Oslo"}},
            ],
            tool_calls=[{"name": "get_weather", "args": {"city": "Oslo"}, "id": "c1", "type": "tool_call"}],
        ),
        ToolMessage("sunny", tool_call_id="c1", name="get_weather"),
    ]


def test_tools_and_tool_history_render_through_the_template_with_chunks_kept(engine, docs):
    chat = ChatBlend(engine=engine)
    schemas = chat.bind_tools([get_weather, add]).kwargs["tools"]
    assert [s["function"]["name"] for s in schemas] == ["get_weather", "add"]
    tp = messages_to_prompt(history(docs), engine.tokenizer, "\n\n", tools=schemas)
    assert [tp.chunk_ids(i) for i in range(len(docs))] == [
        engine.tokenizer.encode(d, add_special_tokens=False) for d in docs
    ]
    expected = engine.tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "Answer from the documents; call tools when needed."},
            {"role": "user", "content": "\n\n".join([*docs, "Weather in the city?"])},
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
                ],
            },
            {"role": "tool", "content": "sunny"},
        ],
        tools=schemas,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert engine.tokenizer.decode(tp.token_ids) == expected
    assert (
        '"name": "add"' in expected
        and '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in expected
    )


def test_forced_tool_call_comes_back_parsed_from_the_engine(any_engine, docs):
    any_engine.warm(docs)
    chat = ChatBlend(engine=any_engine, max_tokens=24)
    forced = chat.bind_tools([get_weather, add], tool_choice="get_weather")
    messages = history(docs)[:2]
    message = forced.invoke(messages)
    # the engine's own reply after the forced opening, parsed
    prefix = tool_calls.prefill("hermes", "get_weather")
    prompt = messages_to_prompt(
        messages, any_engine.tokenizer, any_engine.config.separator, tools=forced.kwargs["tools"], reply_prefix=prefix
    )
    raw = any_engine.generate(prompt, max_tokens=24).text
    expected = tool_calls.parse(prefix + raw, "hermes", forced=True)
    assert message.content == expected.content == ""
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [(c.name, c.arguments) for c in expected.calls]
    assert [c["name"] for c in message.invalid_tool_calls] == [c.name for c in expected.bad]
    assert [c["name"] for c in message.tool_calls + message.invalid_tool_calls] == ["get_weather"]
    assert message.usage_metadata["input_token_details"]["cache_read"] > 0

    streamed = list(forced.stream(messages))
    assert all(c.content == "" for c in streamed)  # nothing of the call shows as text
    total = sum(streamed[1:], streamed[0])
    assert [c["name"] for c in total.tool_calls + total.invalid_tool_calls] == ["get_weather"]


def test_auto_tool_choice_streams_plain_answers_as_text(any_engine, docs):
    any_engine.warm(docs)  # every call hits, so all of them blend the same way
    chat = ChatBlend(engine=any_engine, max_tokens=12).bind_tools([get_weather])
    messages = history(docs)
    message = chat.invoke(messages)
    streamed = list(chat.stream(messages))
    assert "".join(c.content for c in streamed) == message.content

    async def run():
        return [c async for c in chat.astream(messages)], await chat.ainvoke(messages)

    astreamed, ainvoked = asyncio.run(run())
    assert "".join(c.content for c in astreamed) == ainvoked.content == message.content
    # with tool_choice="none" the tools are not rendered and the reply is plain text
    plain = ChatBlend(engine=any_engine, max_tokens=12).bind_tools([get_weather], tool_choice="none").invoke(messages)
    assert plain.tool_calls == [] and plain.usage_metadata["input_tokens"] < message.usage_metadata["input_tokens"]


def test_tool_errors(engine, monkeypatch):
    chat = ChatBlend(engine=engine)
    with pytest.raises(ValueError, match=r"tool_choice must be .* bound tools \(get_weather, add\), got 'weather'"):
        chat.bind_tools([get_weather, add], tool_choice="weather")
    assert chat.bind_tools([get_weather], tool_choice="any").kwargs["tool_choice"] == "get_weather"
    assert (
        chat.bind_tools([get_weather, add], tool_choice={"type": "function", "function": {"name": "add"}}).kwargs[
            "tool_choice"
        ]
        == "add"
    )
    with pytest.raises(ValueError, match="tool_call_format must be one of"):
        ChatBlend(engine=engine, tool_call_format="xml").bind_tools([add])
    monkeypatch.setattr(engine.tokenizer, "chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ValueError, match="renders no tools"):
        chat.bind_tools([get_weather])
    monkeypatch.setattr(engine.tokenizer, "chat_template", "{% if tools %}<fn>{{ tools | tojson }}</fn>{% endif %}")
    with pytest.raises(ValueError, match="writes tool calls in a format not parsed here"):
        chat.bind_tools([get_weather])


def test_tool_call_arguments_round_trip_through_history(engine):
    """A parsed call, put back into the history, renders as the model wrote it."""
    text = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    reply = tool_calls.parse(text, "hermes")
    message = AIMessage("", tool_calls=[{"name": c.name, "args": c.arguments, "id": c.id} for c in reply.calls])
    rendered = engine.tokenizer.decode(
        messages_to_prompt([HumanMessage("1+2?"), message], engine.tokenizer, "\n\n", tools=[]).token_ids
    )
    assert text in rendered and json.loads(text[len("<tool_call>") : -len("</tool_call>")])["arguments"] == {
        "a": 1,
        "b": 2,
    }
