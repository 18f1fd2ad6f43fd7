"""The vLLM engine with the blend connector, on vLLM's real CPU engine and a small local model."""

from __future__ import annotations

import asyncio

import pytest

from blend_integrations import BlendPrompt, PromptError, UnsupportedModelError, load_engine
from blend_integrations.engines.vllm_engine import check_vllm_version

QUESTION = "Question: which city is named in the documents? Answer:"


def chosen(gen):
    return [lp[t] for lp, t in zip(gen.logprobs, gen.token_ids)]


def test_blend_at_ratio_one_equals_plain_vllm_prefill(vllm_engine, docs):
    vllm_engine.warm(docs)
    prompt = BlendPrompt("You answer questions.", docs[::-1], QUESTION)
    full = vllm_engine.generate(prompt, max_tokens=12, mode="full", logprobs=2)  # no connector involved
    blend = vllm_engine.generate(prompt, max_tokens=12, recompute_ratio=1.0, logprobs=2)
    assert blend.usage.chunks_hit == len(docs)
    assert blend.usage.cached_tokens == blend.usage.recomputed_tokens > 0
    assert full.usage.cached_tokens == 0
    assert blend.token_ids == full.token_ids
    assert chosen(blend) == pytest.approx(chosen(full), abs=1e-3)


def test_vllm_full_prefill_equals_the_transformers_engine(vllm_engine, engine, docs):
    prompt = BlendPrompt("You answer questions.", docs, QUESTION)
    assert vllm_engine.generate(prompt, max_tokens=12, mode="full").token_ids == engine.generate(
        prompt, max_tokens=12, mode="full"
    ).token_ids


def test_reordered_chunks_are_all_hits(vllm_engine, docs):
    first = vllm_engine.generate(BlendPrompt("Read.", docs, QUESTION), max_tokens=2)
    assert first.usage.chunks_missed == len(docs)
    # misses are saved at the next engine step, off the first request's time to first token
    again = vllm_engine.generate(BlendPrompt("Read.", [docs[1], docs[3], docs[0], docs[2]], QUESTION), max_tokens=2)
    chunk_tokens = sum(len(vllm_engine.tokenizer.encode(d, add_special_tokens=False)) for d in docs)
    assert (again.usage.chunks_hit, again.usage.chunks_missed) == (len(docs), 0)
    assert again.usage.cached_tokens == chunk_tokens
    assert again.usage.recomputed_tokens == round(0.15 * chunk_tokens)


def test_same_counts_as_the_transformers_engine(vllm_engine, engine, docs):
    engine.warm(docs)
    prompt = BlendPrompt("Read.", docs[::-1], QUESTION)
    a, b = engine.generate(prompt, max_tokens=1), vllm_engine.generate(prompt, max_tokens=1)
    assert (a.usage.cached_tokens, a.usage.recomputed_tokens, a.usage.chunks_hit) == (
        b.usage.cached_tokens, b.usage.recomputed_tokens, b.usage.chunks_hit)


def test_hole_in_the_middle_and_question_first(vllm_engine, docs):
    vllm_engine.warm([docs[0], docs[1], docs[3]])
    holed = BlendPrompt("Read.", docs, QUESTION)
    full = vllm_engine.generate(holed, max_tokens=10, mode="full")
    blend = vllm_engine.generate(holed, max_tokens=10, recompute_ratio=1.0)
    assert (blend.usage.chunks_hit, blend.usage.chunks_missed) == (3, 1)
    assert blend.token_ids == full.token_ids

    question_first = BlendPrompt("Question: which city is named? Documents follow.", docs[::-1], "Answer:")
    full = vllm_engine.generate(question_first, max_tokens=10, mode="full")
    blend = vllm_engine.generate(question_first, max_tokens=10, recompute_ratio=1.0)
    assert blend.usage.chunks_hit == 4
    assert blend.token_ids == full.token_ids


def test_chunks_are_shared_between_engines(vllm_engine, engine, docs):
    """Both engines key chunks by the checkpoint files' fingerprint, dtype and token ids,
    and compute the same standalone recipe, so one engine's chunks serve the other."""
    engine.warm(docs[:2])  # stored by the transformers engine
    vllm_engine.warm(docs[2:])  # stored by the vLLM worker
    prompt = BlendPrompt("Read.", docs[::-1], QUESTION)
    for e in (vllm_engine, engine):
        g = e.generate(prompt, max_tokens=8, recompute_ratio=1.0)
        assert (g.usage.chunks_hit, g.usage.chunks_missed) == (4, 0), e
        assert g.token_ids == e.generate(prompt, max_tokens=8, mode="full").token_ids


def test_many_concurrent_requests_are_batched(vllm_engine, docs):
    vllm_engine.warm(docs)
    prompts = [BlendPrompt("Read.", [docs[i % 4], docs[(i + 1) % 4], docs[(i + 2) % 4]], QUESTION) for i in range(16)]
    gens = vllm_engine.generate_many(prompts, max_tokens=6)
    assert len(gens) == 16 and all(g.usage.chunks_hit == 3 for g in gens)
    assert all(len(g.token_ids) == 6 or g.finish_reason == "stop" for g in gens)
    alone = vllm_engine.generate(prompts[5], max_tokens=6)
    assert alone.token_ids == gens[5].token_ids


def test_stream_stop_and_async(vllm_engine, docs):
    vllm_engine.warm(docs)
    prompt = BlendPrompt("Read.", docs, QUESTION)
    gen = vllm_engine.generate(prompt, max_tokens=20)
    stream = vllm_engine.stream(prompt, max_tokens=20)
    assert "".join(stream) == gen.text == stream.generation.text
    assert len(gen.text) > 6
    stop = gen.text[3:6]
    stopped = vllm_engine.generate(prompt, max_tokens=20, stop=stop)
    assert stopped.finish_reason == "stop" and stopped.text == gen.text[: gen.text.index(stop)]

    async def both():
        deltas = [d async for d in vllm_engine.astream(prompt, max_tokens=20)]
        return "".join(deltas), await vllm_engine.agenerate(prompt, max_tokens=20)

    streamed, agen = asyncio.run(both())
    assert streamed == agen.text == gen.text


def test_seeded_sampling(vllm_engine, docs):
    vllm_engine.warm(docs)
    prompt = BlendPrompt("Read.", docs, QUESTION)
    a = vllm_engine.generate(prompt, max_tokens=10, temperature=1.0, top_p=0.9, seed=3)
    b = vllm_engine.generate(prompt, max_tokens=10, temperature=1.0, top_p=0.9, seed=3)
    assert a.token_ids == b.token_ids


def test_prompt_over_max_model_len(vllm_engine):
    doc = "the river city was founded by a sailor " * 300
    with pytest.raises(PromptError, match="model's context is 2048 tokens"):
        vllm_engine.generate(BlendPrompt("p", [doc, doc], "s"), max_tokens=1)


def test_unsupported_architecture_is_named_before_vllm_starts(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_engine(tmp_path, backend="vllm")


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0"])
def test_unsupported_vllm_version(version):
    with pytest.raises(RuntimeError, match=f"vLLM {version} is not supported.*>= 0.32 and < 0.33"):
        check_vllm_version(version)
    check_vllm_version("0.32.0")


def test_preempted_requests_are_blended_again(vllm_engine):
    """When vLLM preempts a request for lack of KV blocks and resumes it later in new
    blocks, the connector must run the blend pass into those blocks again."""
    from blend_integrations.local_models import sample_text

    docs = [" ".join(sample_text(6, seed=7000 + i)) for i in range(8)]
    vllm_engine.warm(docs)
    prompts = [BlendPrompt("Read.", [docs[i], docs[(i + 3) % 8], docs[(i + 5) % 8], docs[(i + 1) % 8]], "Answer:")
               for i in range(8)]

    def preemptions():
        return sum(m.value for m in vllm_engine.llm.get_metrics() if m.name == "vllm:num_preemptions")

    alone = [vllm_engine.generate(p, max_tokens=80).token_ids for p in prompts]
    before = preemptions()
    together = vllm_engine.generate_many(prompts, max_tokens=80)
    assert preemptions() > before, "the test needs vLLM to preempt; shrink the KV cache"
    assert [g.token_ids for g in together] == alone
