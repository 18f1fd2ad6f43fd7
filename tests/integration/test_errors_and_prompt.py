"""Prompt assembly, configuration and the errors users see."""

from __future__ import annotations

import json

import pytest

from blend_integrations import BlendConfig, BlendPrompt, PromptError, UnsupportedModelError, load_engine
from blend_integrations.prompt import tokenize_prompt


def test_chunks_are_tokenized_alone_and_spans_mark_them(engine):
    tok = engine.tokenizer
    chunks = ["the river city", "was founded by a sailor", [5, 6, 7]]
    tp = tokenize_prompt(BlendPrompt("System.", chunks, "Answer:"), tok, "\n\n")
    sep = tok.encode("\n\n", add_special_tokens=False)
    assert tp.token_ids[0] == tok.bos_token_id
    for i, chunk in enumerate(chunks):
        alone = chunk if isinstance(chunk, list) else tok.encode(chunk, add_special_tokens=False)
        assert tp.chunk_ids(i) == alone
        start, _ = tp.chunk_spans[i]
        assert tp.token_ids[start - len(sep) : start] == sep
    assert tp.token_ids[-len(tok.encode("Answer:", add_special_tokens=False)) :] == tok.encode(
        "Answer:", add_special_tokens=False
    )


def test_from_text_splits_on_the_separator():
    p = BlendPrompt.from_text("head<sep>doc one<sep>doc two<sep>tail", "<sep>")
    assert (p.prefix, p.chunks, p.suffix) == ("head", ("doc one", "doc two"), "tail")
    with pytest.raises(PromptError, match="at least two"):
        BlendPrompt.from_text("head<sep>tail", "<sep>")


def test_empty_chunk_list_is_a_clear_error():
    with pytest.raises(PromptError, match="at least one chunk"):
        BlendPrompt("prefix", [], "suffix")


def test_empty_chunk_is_a_clear_error(engine):
    with pytest.raises(PromptError, match="chunk 1 is empty"):
        engine.generate(BlendPrompt("prefix", ["a document", "", "another"], "suffix"), max_tokens=1)


def test_prompt_over_the_context_is_a_clear_error(engine):
    long_doc = "the river city was founded by a sailor " * 400
    with pytest.raises(PromptError, match=r"the prompt has \d+ tokens but the model's context is 4096 tokens"):
        engine.generate(BlendPrompt("prefix", [long_doc, long_doc], "suffix"), max_tokens=1)


def test_generation_stops_at_the_context(engine):
    ids = [engine.tokenizer.bos_token_id] + [300] * 4090
    g = engine.generate(ids, max_tokens=50, mode="full")
    assert len(g.token_ids) <= 5


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(recompute_ratio=1.5), "recompute_ratio must be a number in"),
        (dict(recompute_ratio="0.1"), "recompute_ratio must be a number in"),
        (dict(check_layers=()), "at least one layer"),
        (dict(check_layers=(2, 1)), "strictly increasing"),
        (dict(check_layers=(-1,)), "non-negative"),
        (dict(deviation="q"), 'deviation must be "k" or "v"'),
        (dict(sink_tokens=-1), "sink_tokens"),
        (dict(separator=None), "separator must be a string"),
        (dict(quality_check=2), "quality_check must be a number in"),
        (dict(quality_check_risk=0), r"quality_check_risk must be a number in \(0, 1\] \(at 0 no check would start"),
        (dict(quality_check_risk=1.5), r"quality_check_risk must be a number in \(0, 1\]"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BlendConfig(**kwargs)


def test_gradual_filtering_schedule():
    assert BlendConfig(recompute_ratio=0.2).check_schedule() == [(1, 0.2)]
    sched = BlendConfig(recompute_ratio=0.2, check_layers=(1, 2, 3)).check_schedule()
    assert [layer for layer, _ in sched] == [1, 2, 3]
    assert sched[-1][1] == pytest.approx(0.2) and sched[0][1] > sched[1][1] > sched[2][1]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(mode="fast"), "mode must be one of blend, full, reuse"),
        (dict(recompute_ratio=2), "recompute_ratio must be a number in"),
        (dict(max_tokens=0), "max_tokens must be a positive integer"),
        (dict(temperature=-1), "temperature must be >= 0"),
        (dict(top_p=0), "top_p must be in"),
    ],
)
def test_generate_argument_errors(engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(BlendPrompt("p", ["a doc"], "s"), **kwargs)


def test_unsupported_architecture_is_named(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*'gpt2'.*llama, mistral, qwen2, qwen3"):
        load_engine(tmp_path, device="cpu")


def test_check_layer_beyond_the_model(model_dirs, store):
    with pytest.raises(ValueError, match=r"check_layers \(9,\) must be below the model's 4 layers"):
        load_engine(model_dirs("llama"), store=store, config=BlendConfig(check_layers=(9,)), device="cpu")


def test_bad_backend_dtype_and_missing_model(model_dirs, store, tmp_path):
    with pytest.raises(ValueError, match="backend must be one of"):
        load_engine(model_dirs("llama"), backend="onnx", store=store)
    with pytest.raises(ValueError, match="dtype must be"):
        load_engine(model_dirs("llama"), store=store, dtype="int8")
    with pytest.raises(FileNotFoundError, match="neither a local directory nor a hub id"):
        load_engine(str(tmp_path / "no-such-model"), store=store)


def test_local_model_config_is_what_was_asked(model_dirs):
    config = json.loads(open(f"{model_dirs('qwen3')}/config.json").read())
    assert config["model_type"] == "qwen3" and config["num_hidden_layers"] == 4


def test_hub_id_resolves_through_the_hub_cache(model_dirs, tmp_path):
    """A hub id goes through huggingface_hub's cache (offline here) to the same loading path."""
    import os
    import shutil
    import subprocess
    import sys

    repo = tmp_path / "hub" / "models--local--tiny-llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(model_dirs("llama"), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    code = (
        "from blend_integrations import load_engine, ChunkStore\n"
        f"e = load_engine('local/tiny-llama', store=ChunkStore({str(tmp_path / 'store')!r}), device='cpu')\n"
        "print(e.generate('the river city', max_tokens=3, mode='full').prompt_token_ids)\n"
    )
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().startswith("[1,")


def test_spans_from_separator_in_token_ids():
    from blend_integrations.prompt import spans_from_separator

    sep = [[9, 9]]
    ids = [1, 5, 9, 9, 6, 7, 9, 9, 9, 9, 8, 9, 9, 4]  # prefix, chunk, empty piece, chunk, suffix
    assert spans_from_separator(ids, sep) == [(4, 6), (10, 11)]
    assert spans_from_separator([1, 2, 3], sep) == []
    assert spans_from_separator(ids, []) == [] and spans_from_separator(ids, [[]]) == []
    # a separator in either of its forms; the longer form where both match
    assert spans_from_separator([1, 9, 9, 6, 3, 7, 9, 9, 4], [[3], [9, 9]]) == [(3, 4), (5, 6)]
    assert spans_from_separator([1, 9, 9, 6, 9, 9, 2], [[9], [9, 9]]) == [(3, 4)]


def test_a_separator_is_found_in_the_forms_a_tokenizer_gives_it_in_context():
    """SmolLM2's byte-level BPE tokenizes "\\n\\n" alone as one token, and before a word as two:
    both are the separator, and a text prompt's chunks are found either way."""
    from transformers import AutoTokenizer

    from blend_integrations.models.smollm2 import smollm2_dir
    from blend_integrations.prompt import separator_forms, spans_from_separator

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    forms = separator_forms(tokenizer, "\n\n")
    assert len(forms) == 2 and all(tokenizer.decode(f) == "\n\n" for f in forms)
    pieces = ["Documents:", "Brimford lies north.", "The mill made paper.", "Question: where? Answer:"]
    ids = tokenizer.encode("\n\n".join(pieces), add_special_tokens=False)
    chunks = [tokenizer.decode(ids[a:b]) for a, b in spans_from_separator(ids, forms)]
    assert chunks == pieces[1:3]
    assert separator_forms(tokenizer, "\n---\n") == [tokenizer.encode("\n---\n", add_special_tokens=False)]
    assert separator_forms(tokenizer, "") == []


@pytest.mark.parametrize(
    ("config", "design"),
    [
        ("MixtralConfig", "mixture-of-experts"),
        ("DeepseekV3Config", r"mixture-of-experts or multi-head latent attention \(MLA\)"),
    ],
)
def test_designs_the_walk_does_not_implement_are_named(config, design):
    import transformers

    from blend_integrations.models.hf import check_supported

    with pytest.raises(UnsupportedModelError, match=f"is not supported \\(blending does not support {design}\\)"):
        check_supported(getattr(transformers, config)())
