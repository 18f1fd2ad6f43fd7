"""The transformers engine against plain Hugging Face prefill, on real small models."""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil

import pytest
import torch

from blend_integrations import BlendConfig, BlendPrompt, ChunkStore, load_engine
from tests.fixtures.exactness import chosen, exact_at_ratio_one

QUESTION = "Question: which city is named in the documents? Answer:"


def hf_logprobs(engine, prompt_ids, token_ids):
    """Log-probabilities of ``token_ids`` after ``prompt_ids`` from one plain HF forward."""
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(engine.hf_model(ids).logits[0].float(), dim=-1)
    n = len(prompt_ids)
    return [float(logp[n - 1 + i, t]) for i, t in enumerate(token_ids)]


def test_full_matches_plain_hf_greedy(engine, docs):
    gen = engine.generate(BlendPrompt("You answer questions.", docs, QUESTION), max_tokens=16, mode="full", logprobs=2)
    prompt = torch.tensor([gen.prompt_token_ids])
    with torch.no_grad():
        ref = engine.hf_model.generate(prompt, max_new_tokens=16, do_sample=False)[0, prompt.shape[1] :].tolist()
    assert gen.token_ids == ref[: len(gen.token_ids)]
    assert len(gen.token_ids) == 16 or gen.finish_reason == "stop"
    assert chosen(gen) == pytest.approx(hf_logprobs(engine, gen.prompt_token_ids, gen.token_ids), abs=1e-4)
    assert gen.usage.cached_tokens == 0 and gen.usage.chunks_hit == 0


def test_the_end_token_is_returned_as_vllm_returns_it(model_dirs, tmp_path, docs):
    """A generation that the model's end token stops has it last in its
    token_ids (counted, with its logprob, its text empty), as vLLM's engine
    returns it: the two engines' tokens match however a generation ends."""
    source = model_dirs("llama")
    prompt = BlendPrompt("You answer questions.", docs, QUESTION)
    ids = load_engine(source, store=ChunkStore(tmp_path / "a")).generate(prompt, max_tokens=8, mode="full").token_ids
    stop = next(i for i, t in enumerate(ids) if t not in ids[:i] and i)  # a token not generated before it
    model = tmp_path / "model"
    shutil.copytree(source, model)
    config = model / "generation_config.json"
    settings = json.loads(config.read_text()) if config.exists() else {}
    (model / "generation_config.json").write_text(json.dumps(settings | {"eos_token_id": ids[stop]}))
    engine = load_engine(model, store=ChunkStore(tmp_path / "b"))
    gen = engine.generate(prompt, max_tokens=8, mode="full", logprobs=1)
    before = engine.generate(prompt, max_tokens=stop, mode="full")
    assert gen.finish_reason == "stop"
    assert gen.token_ids == ids[: stop + 1]
    assert len(gen.logprobs) == gen.usage.completion_tokens == stop + 1
    assert gen.text == before.text


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "olmo2", "granite"]


@pytest.mark.parametrize("name", [*FAMILIES, "llama3_rope"])
def test_blend_at_ratio_one_equals_full(engines, name, docs):
    engine = engines(name)
    engine.warm(docs)
    prompt = BlendPrompt("You answer questions.", docs[::-1], QUESTION)
    full = engine.generate(prompt, max_tokens=12, mode="full", logprobs=3)
    blend = engine.generate(prompt, max_tokens=12, mode="blend", recompute_ratio=1.0, logprobs=3)
    assert blend.usage.chunks_hit == len(docs)
    assert blend.usage.cached_tokens == blend.usage.recomputed_tokens > 0
    assert blend.token_ids == full.token_ids
    assert chosen(blend) == pytest.approx(chosen(full), abs=1e-5)
    # and full itself is plain HF prefill for every family
    assert chosen(full) == pytest.approx(hf_logprobs(engine, full.prompt_token_ids, full.token_ids), abs=1e-4)


def test_bf16_blend_at_ratio_one_equals_full(engines, docs):
    engine = engines("llama", "bfloat16")
    engine.warm(docs)
    exact_at_ratio_one(engine, BlendPrompt("You answer questions.", docs[::-1], QUESTION), len(docs), max_tokens=8)


@pytest.mark.parametrize("name", ["llama", "qwen3", "llama3_rope", "gemma3_text", "phi3"])
@pytest.mark.parametrize("new_start", [1, 37, 300])
def test_moved_chunk_kv_equals_isolated_kv_at_new_position(engines, name, new_start, docs):
    """A stored chunk rotated to a new position equals the chunk computed alone there."""
    engine = engines(name)
    ids = engine.tokenizer.encode(docs[0], add_special_tokens=False)
    stored = engine.compute_chunk(ids).kv  # [L, 2, Hkv, n, D], K before RoPE
    bos = engine.tokenizer.bos_token_id
    positions = torch.arange(new_start - 1, new_start + len(ids))
    with torch.no_grad():
        out = engine.hf_model(torch.tensor([[bos] + ids]), position_ids=positions[None], use_cache=True)
    rotary = engine.layers.rotary(positions[1:])
    for layer in range(engine.layers.num_layers):
        # a sliding-window layer's cache keeps only its window's last rows
        k_ref = out.past_key_values.layers[layer].keys[0]
        v_ref = out.past_key_values.layers[layer].values[0]
        n = min(k_ref.shape[1], len(ids))
        torch.testing.assert_close(rotary(layer, stored[layer, 0])[:, -n:], k_ref[:, -n:], atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(stored[layer, 1][:, -n:], v_ref[:, -n:], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("name", FAMILIES[4:])
def test_family_reordered_chunks_hit_and_match_full(engines, name, docs):
    """Each newer family: chunks (longer than its sliding window, where it has
    one) stored in one order hit in another; at r=1 the answer is full
    prefill's; at the default ratio the blend recomputes its share."""
    engine = engines(name)
    engine.warm(docs)
    shuffled = BlendPrompt("Read.", [docs[2], docs[0], docs[3], docs[1]], QUESTION)
    blend = engine.generate(shuffled, max_tokens=4, recompute_ratio=0.15)
    chunk_tokens = sum(len(engine.tokenizer.encode(d, add_special_tokens=False)) for d in docs)
    window = max(w or 0 for w in engine.layers.windows)
    assert window == 0 or min(len(engine.tokenizer.encode(d, add_special_tokens=False)) for d in docs) > window
    assert (blend.usage.chunks_hit, blend.usage.chunks_missed) == (len(docs), 0)
    assert blend.usage.cached_tokens == chunk_tokens
    assert blend.usage.recomputed_tokens == round(0.15 * chunk_tokens)
    full = engine.generate(shuffled, max_tokens=8, mode="full", logprobs=1)
    exact = engine.generate(shuffled, max_tokens=8, recompute_ratio=1.0, logprobs=1)
    assert exact.token_ids == full.token_ids
    assert chosen(exact) == pytest.approx(chosen(full), abs=1e-5)


def test_reordered_chunks_are_all_hits(engine, docs):
    first = engine.generate(BlendPrompt("Read.", docs, QUESTION), max_tokens=4)
    assert first.usage.chunks_missed == len(docs) and first.usage.cached_tokens == 0
    again = engine.generate(BlendPrompt("Read.", [docs[2], docs[0], docs[3], docs[1]], QUESTION), max_tokens=4)
    chunk_tokens = sum(len(engine.tokenizer.encode(d, add_special_tokens=False)) for d in docs)
    assert again.usage.chunks_hit == len(docs) and again.usage.chunks_missed == 0
    assert again.usage.cached_tokens == chunk_tokens
    assert again.usage.recomputed_tokens == round(0.15 * chunk_tokens)


def test_hole_in_the_middle(engine, docs):
    engine.warm([docs[0], docs[2], docs[3]])
    prompt = BlendPrompt("Read.", docs, QUESTION)
    full = engine.generate(prompt, max_tokens=10, mode="full")
    holed = engine.generate(prompt, max_tokens=10, recompute_ratio=1.0)
    assert (holed.usage.chunks_hit, holed.usage.chunks_missed) == (3, 1)
    assert holed.token_ids == full.token_ids
    # reuse continues after the hole, and the missed chunk was saved for next time
    assert engine.generate(prompt, max_tokens=2).usage.chunks_hit == 4


def test_question_before_documents(engine, docs):
    engine.warm(docs)
    prompt = BlendPrompt("Question: which city is named? Documents follow.", docs[::-1], "Answer:")
    full = engine.generate(prompt, max_tokens=10, mode="full")
    blend = engine.generate(prompt, max_tokens=10, recompute_ratio=1.0)
    assert blend.usage.chunks_hit == len(docs)
    assert blend.token_ids == full.token_ids
    assert engine.generate(prompt, max_tokens=3, recompute_ratio=0.15).usage.cached_tokens > 0


def test_reuse_mode_recomputes_nothing_and_differs_from_full(engine, docs):
    engine.warm(docs)
    prompt = BlendPrompt("Read.", docs[::-1], QUESTION)
    reuse = engine.generate(prompt, max_tokens=6, mode="reuse", logprobs=0)
    full = engine.generate(prompt, max_tokens=6, mode="full", logprobs=0)
    assert reuse.usage.recomputed_tokens == 0 and reuse.usage.cached_tokens > 0
    # cross-chunk attention is missing in reuse, so its distribution moves
    assert chosen(reuse)[0] != pytest.approx(chosen(full)[0], abs=1e-4) or reuse.token_ids[0] != full.token_ids[0]


def test_blend_moves_toward_full_as_ratio_grows(engine, docs):
    """Mean |logprob| error of the first token against full shrinks as r grows."""
    engine.warm(docs)
    prompt = BlendPrompt("Read.", docs[::-1], QUESTION)
    full = engine.generate(prompt, max_tokens=1, mode="full", logprobs=50)
    errors = []
    for r in (0.0, 0.5, 1.0):
        g = engine.generate(prompt, max_tokens=1, recompute_ratio=r, logprobs=50)
        errors.append(sum(abs(g.logprobs[0].get(t, -50.0) - lp) for t, lp in full.logprobs[0].items()))
    assert errors[2] < 1e-3
    assert errors[0] > errors[1] > errors[2]


def test_gradual_filtering_and_sink_tokens(engines, docs):
    engine = engines("llama", config=BlendConfig(check_layers=(1, 2), sink_tokens=2))
    engine.warm(docs)
    prompt = BlendPrompt("Read.", docs[::-1], QUESTION)
    full = engine.generate(prompt, max_tokens=8, mode="full")
    assert engine.generate(prompt, max_tokens=8, recompute_ratio=1.0).token_ids == full.token_ids
    g = engine.generate(prompt, max_tokens=2, recompute_ratio=0.2)
    chunk_tokens = sum(len(engine.tokenizer.encode(d, add_special_tokens=False)) for d in docs)
    assert g.usage.cached_tokens == chunk_tokens - 2 * len(docs)
    assert g.usage.recomputed_tokens == round(0.2 * g.usage.cached_tokens)


def test_different_models_and_dtypes_never_share_entries(engines, docs):
    a, b, a16 = engines("llama"), engines("llama_seed1"), engines("llama", "bfloat16")
    ids = a.tokenizer.encode(docs[0], add_special_tokens=False)
    assert a.tokenizer.encode(docs[0], add_special_tokens=False) == b.tokenizer.encode(
        docs[0], add_special_tokens=False
    )
    assert len({a.chunk_key(ids), b.chunk_key(ids), a16.chunk_key(ids)}) == 3
    a.warm(docs)
    prompt = BlendPrompt("Read.", docs, QUESTION)
    assert b.generate(prompt, max_tokens=1).usage.chunks_hit == 0
    assert a16.generate(prompt, max_tokens=1).usage.chunks_hit == 0
    assert a.generate(prompt, max_tokens=1).usage.chunks_hit == len(docs)


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_corrupt_entry_is_recomputed_not_used(model_dirs, tmp_path, docs, damage):
    path = tmp_path / "store"
    engine = load_engine(model_dirs("llama"), store=ChunkStore(path), device="cpu")
    engine.warm(docs)
    prompt = BlendPrompt("Read.", docs, QUESTION)
    full = engine.generate(prompt, max_tokens=8, mode="full")
    key = engine.chunk_key(engine.tokenizer.encode(docs[1], add_special_tokens=False))
    other = engine.chunk_key(engine.tokenizer.encode(docs[2], add_special_tokens=False))
    engine.store.close()

    import diskcache

    with diskcache.Cache(str(path)) as raw:
        data = bytes(raw[key])
        if damage == "flip":
            bad = bytearray(data)
            bad[len(bad) // 2] ^= 0xFF
            raw[key] = bytes(bad)
        elif damage == "truncate":
            raw[key] = data[: len(data) // 3]
        else:  # a valid entry filed under the wrong key
            raw[key] = bytes(raw[other])

    fresh = ChunkStore(path)  # a new process would see the disk as this does
    engine.store = fresh
    g = engine.generate(prompt, max_tokens=8, recompute_ratio=1.0)
    assert (g.usage.chunks_hit, g.usage.chunks_missed) == (len(docs) - 1, 1)
    assert fresh.stats.corrupt == 1
    assert g.token_ids == full.token_ids
    assert engine.generate(prompt, max_tokens=1).usage.chunks_hit == len(docs)  # recomputed and saved again


def _warm_in_other_process(model_dir, store_path, docs, queue):
    engine = load_engine(model_dir, store=ChunkStore(store_path), device="cpu")
    queue.put(engine.warm(docs))


def test_store_shared_across_processes(model_dirs, tmp_path, docs):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_warm_in_other_process, args=(model_dirs("llama"), str(tmp_path), docs, queue))
    proc.start()
    computed = queue.get(timeout=300)
    proc.join(timeout=60)
    assert proc.exitcode == 0 and computed == len(docs)
    engine = load_engine(model_dirs("llama"), store=ChunkStore(tmp_path), device="cpu")
    g = engine.generate(BlendPrompt("Read.", docs[::-1], QUESTION), max_tokens=2)
    assert g.usage.chunks_hit == len(docs)


def test_stream_yields_the_generated_text(engine, docs):
    engine.warm(docs)
    prompt = BlendPrompt("Read.", docs, QUESTION)
    stream = engine.stream(prompt, max_tokens=12)
    deltas = list(stream)
    gen = engine.generate(prompt, max_tokens=12)
    assert "".join(deltas) == gen.text == stream.generation.text
    assert stream.generation.token_ids == gen.token_ids
    assert stream.generation.ttft_s > 0 and stream.generation.ttft_s <= stream.generation.total_s


def test_interleaved_streams_each_keep_their_own_cache(engine, docs):
    """A request's dense KV cache is reused by the next one on a CPU; a
    stream still being read holds its own: another request started in
    between (the same thread) gets a cache of its own."""
    engine.warm(docs)
    first, second = BlendPrompt("Read.", docs, QUESTION), BlendPrompt("Read.", docs[::-1], "Say a city.")
    alone = [engine.generate(p, max_tokens=12, mode="full").token_ids for p in (first, second)]
    held = engine.stream(first, max_tokens=12, mode="full")
    next(held)  # its prefill is done and its cache in use
    between = engine.generate(second, max_tokens=12, mode="full")
    list(held)
    assert [held.generation.token_ids, between.token_ids] == alone
    assert engine.generate(first, max_tokens=12, mode="full").token_ids == alone[0]


def test_stop_strings(engine, docs):
    engine.warm(docs)
    prompt = BlendPrompt("Read.", docs, QUESTION)
    text = engine.generate(prompt, max_tokens=24).text
    assert len(text) > 6
    stop = text[4:7]
    stopped = engine.generate(prompt, max_tokens=24, stop=[stop])
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[: text.index(stop)]
    assert "".join(engine.stream(prompt, max_tokens=24, stop=stop)) == stopped.text


def test_sampling_is_reproducible_with_a_seed(engine, docs):
    engine.warm(docs)
    prompt = BlendPrompt("Read.", docs, QUESTION)
    a = engine.generate(prompt, max_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    b = engine.generate(prompt, max_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    c = engine.generate(prompt, max_tokens=10, temperature=1.0, top_p=0.9, seed=8)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_plain_text_prompt_and_max_tokens(engine):
    g = engine.generate("The city by the river was", max_tokens=5)
    assert g.usage.completion_tokens == len(g.token_ids) <= 5
    assert g.prompt_token_ids[0] == engine.tokenizer.bos_token_id
    assert g.finish_reason in ("stop", "length")


def test_a_walk_pass_is_timed_without_touching_the_measured_throughput(engine):
    """``Blender.pass_seconds``: new tokens through the walk after a context, plain or scoring their
    attention (the oracle benchmark's fixed costs of a pass and of the scoring); the loading
    controller's throughput is measured on real prefills only."""
    speed = engine.blender.walk_speed
    before = speed.samples
    assert engine.blender.pass_seconds(64, repeats=2) > 0
    assert engine.blender.pass_seconds(64, repeats=2, tokens=16, scored=8) > 0
    assert speed.samples == before
    for bad in (-1, 1.5, "64", True):
        with pytest.raises(ValueError, match="context must be an int"):
            engine.blender.pass_seconds(bad)
    with pytest.raises(ValueError, match="tokens must be an int >= 1"):
        engine.blender.pass_seconds(64, tokens=0)
    for bad in (-1, 2, True, "1"):
        with pytest.raises(ValueError, match="scored must be an int from 0 to tokens"):
            engine.blender.pass_seconds(64, tokens=1, scored=bad)
