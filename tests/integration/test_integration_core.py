"""The integration core (blend_integrations.integration) that the LangChain and
LlamaIndex models share: fields, engine loading, call settings, the one RAG
layout, the one warmer signature, and the deprecated names that still work."""

from __future__ import annotations

import warnings

import pytest
from langchain_core.documents import Document
from langchain_core.runnables import RunnableLambda

from blend_integrations import ChunkStore, integration, rag_prompt
from blend_integrations.chat import RAG_SYSTEM_PROMPT, render_chat
from blend_integrations.integration import BlendModelBase
from blend_integrations.langchain import (
    BlendCacheWarmer,
    BlendLLM,
    ChatBlend,
    create_blend_rag_chain,
    messages_to_prompt,
)
from blend_integrations.llama_index import BlendCacheWarmer as LlamaIndexWarmer
from blend_integrations.llama_index import BlendKVWarmup
from blend_integrations.llama_index import BlendLLM as LlamaIndexBlendLLM
from blend_integrations.llama_index.rag import DEFAULT_QUERY_TEMPLATE
from blend_integrations.prompt import Part

MODELS = (ChatBlend, BlendLLM, LlamaIndexBlendLLM)


def test_every_model_has_the_core_fields_each_documented():
    core = set(BlendModelBase.model_fields)
    assert {"model", "base_url", "api_key", "model_kwargs", "engine", "store", "config"} <= core
    for model in MODELS:
        assert issubclass(model, BlendModelBase) and core <= set(model.model_fields), model
    undocumented = [name for name, field in BlendModelBase.model_fields.items() if not field.description]
    assert not undocumented and ChatBlend.model_fields["tool_call_format"].description


@pytest.mark.parametrize("model", MODELS)
def test_call_settings_are_the_fields_overridden_per_call(model, engine):
    llm = model(engine=engine, max_tokens=7, stop=["a"], mode="full", selection="mixed")
    settings = llm._call_settings({"max_tokens": 2, "stop": ["b"], "selection": "query"}, ["c"])
    assert settings == {
        "max_tokens": 2,
        "temperature": 0.0,
        "top_p": 1.0,
        "seed": None,
        "mode": "full",
        "recompute_ratio": None,
        "selection": "query",
        "stop": ["a", "b", "c"],
    }
    assert llm._call_settings({})["selection"] == "mixed"
    with pytest.raises(TypeError, match="unexpected generation arguments: colour"):
        llm._call_settings({"colour": "red"})


@pytest.mark.parametrize("model", MODELS)
def test_engine_loading_in_process_and_from_a_server(model, engine, monkeypatch, tmp_path):
    calls = []

    def fake_load_engine(target, **kwargs):
        calls.append((target, kwargs))
        return engine

    monkeypatch.setattr(integration, "load_engine", fake_load_engine)
    monkeypatch.setenv("BLEND_API_KEY", "from-env")
    local = model(model="some/model", store_path=str(tmp_path / "s"), model_kwargs={"device": "cpu"}, timeout=5)
    target, kwargs = calls[-1]
    assert target == "some/model" and local.engine is engine and kwargs["backend"] == "transformers"
    assert isinstance(kwargs["store"], ChunkStore) and kwargs["store"].path == tmp_path / "s"
    assert kwargs["device"] == "cpu" and "timeout_s" not in kwargs and "api_key" not in kwargs

    remote = model(base_url="http://127.0.0.1:9", timeout=5, model_kwargs={"tokenizer": "t"})
    target, kwargs = calls[-1]
    assert target == "http://127.0.0.1:9" and remote.backend == kwargs["backend"] == "server"
    assert kwargs["store"] is None and kwargs["timeout_s"] == 5 and kwargs["tokenizer"] == "t"
    assert kwargs["api_key"] == "from-env" and "from-env" not in repr(remote)
    with pytest.raises(ValueError, match="base_url= is a blend server's URL, for backend='server', not 'vllm'"):
        model(base_url="http://127.0.0.1:9", backend="vllm")


def test_one_rag_layout_for_both_frameworks(engine, docs):
    """LangChain's default chain prompt and LlamaIndex's default synthesizer prompt are rag_prompt's tokens."""
    tokenizer, separator = engine.tokenizer, engine.config.separator
    expected = rag_prompt(docs, "which city?", tokenizer, separator)

    sent = []
    retriever = RunnableLambda(lambda q: [Document(page_content=d) for d in docs])
    create_blend_rag_chain(retriever, RunnableLambda(lambda m: sent.append(m) or "ok")).invoke("which city?")
    assert messages_to_prompt(sent[0], tokenizer, separator) == expected

    llm = LlamaIndexBlendLLM(engine=engine)
    query = DEFAULT_QUERY_TEMPLATE.format(query_str="which city?")
    assert llm.chunks_prompt(docs, query, RAG_SYSTEM_PROMPT) == expected


def test_the_question_ends_before_the_chat_templates_tail(engine, docs, monkeypatch):
    """``question_end``: after the question's own tokens, before the template's end of turn and the
    assistant's header ("query-tail" scores the question's last tokens, not the template's)."""
    tokenizer, separator = engine.tokenizer, engine.config.separator
    tp = rag_prompt(docs, "which city?", tokenizer, separator)
    assert tp.question_end is not None and tp.chunk_spans[-1][1] < tp.question_end < len(tp) - 1
    assert tokenizer.decode(tp.token_ids[: tp.question_end]).endswith("Question: which city?")
    assert tokenizer.decode(tp.token_ids[tp.question_end :]) == "</s>\n<|assistant|>\n"
    # the tokens are the ones rendered without knowing where the question ends
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": RAG_SYSTEM_PROMPT}, {"role": "user", "content": "x"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert tokenizer.encode(text.split("x")[-1], add_special_tokens=False) == tp.token_ids[tp.question_end :]
    # a conversation that ends with the assistant's turn has no question at its end
    ended = render_chat(
        [
            {"role": "user", "content": [Part(docs[0], chunk=True), Part("Hi")]},
            {"role": "assistant", "content": [Part("Yes")]},
        ],
        tokenizer,
        separator,
    )
    assert ended.question_end is None
    # without a template the question is the prompt's end
    monkeypatch.setattr(tokenizer, "chat_template", None)
    assert rag_prompt(docs, "which city?", tokenizer, separator).question_end is None


def test_the_rag_layout_without_a_chat_template(engine, docs, monkeypatch):
    """A model without a chat template gets the layout's pieces as plain text."""
    monkeypatch.setattr(engine.tokenizer, "chat_template", None)
    prompt = LlamaIndexBlendLLM(engine=engine).chunks_prompt(docs, "Which city?", system_prompt="Be brief.")
    assert prompt == rag_prompt(
        docs,
        "Which city?",
        engine.tokenizer,
        engine.config.separator,
        system="Be brief.",
        question_template="{question}",
    )
    assert [prompt.chunk_ids(i) for i in range(len(docs))] == [
        engine.tokenizer.encode(d, add_special_tokens=False) for d in docs
    ]
    assert engine.tokenizer.decode(prompt.token_ids).startswith("<s>Be brief.\n\n")


def test_both_warmers_take_the_same_arguments(engine, docs):
    chat = ChatBlend(engine=engine)
    llm = LlamaIndexBlendLLM(engine=engine)
    for warmer in (BlendCacheWarmer(chat, show_progress=False), LlamaIndexWarmer(llm, show_progress=False)):
        assert warmer.engine is engine and warmer.show_progress is False
    for warmer in (BlendCacheWarmer(engine), LlamaIndexWarmer(llm=engine)):
        assert warmer.engine is engine and warmer.show_progress is None
    with pytest.raises(TypeError, match="BlendCacheWarmer needs a BlendLLM or an Engine, got str"):
        BlendCacheWarmer("not a model")
    with pytest.raises(TypeError, match="BlendCacheWarmer needs a BlendLLM or an Engine, got str"):
        LlamaIndexWarmer("not a model")([])


def test_deprecated_names_warn_and_still_work(engine, model_dirs, tmp_path):
    with pytest.warns(DeprecationWarning, match="engine_kwargs= is deprecated; use model_kwargs=") as caught:
        loaded = LlamaIndexBlendLLM(model_dirs("llama"), store_path=str(tmp_path), engine_kwargs={"device": "cpu"})
    assert caught[0].filename == __file__  # the warning points at the caller
    assert loaded.model_kwargs == {"device": "cpu"} and str(loaded.engine.device) == "cpu"
    with pytest.warns(DeprecationWarning, match="use model_kwargs=") as caught:
        chat = ChatBlend(engine=engine, engine_kwargs={"a": 1}, model_kwargs={"b": 2})
    assert caught[0].filename == __file__ and chat.model_kwargs == {"a": 1, "b": 2}

    with pytest.warns(DeprecationWarning) as caught:
        warmer = BlendCacheWarmer(model=chat, progress=False)
    assert [str(w.message) for w in caught] == [
        "model= is deprecated; use llm=",
        "progress= is deprecated; use show_progress=",
    ]
    assert warmer.engine is engine and warmer.show_progress is False

    with pytest.warns(DeprecationWarning, match="BlendKVWarmup is deprecated; use BlendCacheWarmer"):
        old = BlendKVWarmup(llm=engine, show_progress=False)
    assert isinstance(old, LlamaIndexWarmer) and old.engine is engine and old.show_progress is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new names warn about nothing
        BlendCacheWarmer(chat, show_progress=False)
        LlamaIndexWarmer(engine, show_progress=False)
        ChatBlend(engine=engine, model_kwargs={"a": 1})
