"""The transformers engine on a GPU (``device="cuda"``), in float32 and bfloat16.

These run where torch sees a CUDA device (the results of the last run on one
are in docs/results/, named by the device); CI has none, so there they are
skipped with that reason. Each mirrors a CPU test of test_transformers_engine.py.
"""

from __future__ import annotations

import pytest
import torch

from blend_integrations import BlendConfig, BlendPrompt, ChunkStore, load_engine
from tests.fixtures.exactness import chosen, exact_at_ratio_one

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: torch.cuda.is_available() is False"
)

QUESTION = "Question: which city is named in the documents? Answer:"
# log-probability tolerance of two computations of one token: float32 on CUDA
# runs other kernels than on CPU; bfloat16 keeps 8 bits of mantissa
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}


@pytest.fixture(scope="module")
def cuda_engines(model_dirs, tmp_path_factory):
    store = ChunkStore(tmp_path_factory.mktemp("cuda-store"))
    made = {}

    def get(name: str = "llama", dtype: str = "float32", config: BlendConfig | None = None):
        key = (name, dtype, config)
        if key not in made:
            made[key] = load_engine(model_dirs(name), store=store, dtype=dtype, device="cuda", config=config)
        return made[key]

    yield get
    store.close()


def hf_logprobs(engine, prompt_ids, token_ids):
    ids = torch.tensor([prompt_ids + token_ids], device=engine.device)
    with torch.no_grad():
        logp = torch.log_softmax(engine.hf_model(ids).logits[0].float(), dim=-1)
    n = len(prompt_ids)
    return [float(logp[n - 1 + i, t]) for i, t in enumerate(token_ids)]


def test_auto_device_is_cuda(model_dirs, tmp_path):
    engine = load_engine(model_dirs("llama"), store=ChunkStore(tmp_path))
    assert engine.device.type == "cuda"
    assert next(engine.hf_model.parameters()).device.type == "cuda"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_full_matches_plain_hf_on_cuda(cuda_engines, dtype, docs):
    engine = cuda_engines("llama", dtype)
    gen = engine.generate(BlendPrompt("You answer questions.", docs, QUESTION), max_tokens=12, mode="full", logprobs=1)
    prompt = torch.tensor([gen.prompt_token_ids], device=engine.device)
    with torch.no_grad():
        ref = engine.hf_model.generate(prompt, max_new_tokens=12, do_sample=False)[0, prompt.shape[1] :].tolist()
    assert gen.token_ids == ref[: len(gen.token_ids)]
    assert chosen(gen) == pytest.approx(hf_logprobs(engine, gen.prompt_token_ids, gen.token_ids), abs=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma2", "gemma3_text", "phi3", "granite"])
def test_blend_at_ratio_one_equals_full_on_cuda(cuda_engines, name, dtype, docs):
    engine = cuda_engines(name, dtype)
    engine.warm(docs)
    prompt = BlendPrompt("You answer questions.", docs[::-1], QUESTION)
    exact_at_ratio_one(engine, prompt, len(docs), max_tokens=8, tolerance=TOLERANCE[dtype])
    partial = engine.generate(prompt, max_tokens=2, recompute_ratio=0.15)
    chunk_tokens = sum(len(engine.tokenizer.encode(d, add_special_tokens=False)) for d in docs)
    assert partial.usage.recomputed_tokens == round(0.15 * chunk_tokens)


@pytest.mark.parametrize("name", ["llama", "gemma3_text"])
def test_moved_chunk_kv_on_cuda_equals_isolated_kv(cuda_engines, name, docs):
    """The re-rotation on the GPU: a stored chunk moved to position 37 equals
    the chunk computed alone there."""
    engine = cuda_engines(name)
    ids = engine.tokenizer.encode(docs[0], add_special_tokens=False)
    stored = engine.compute_chunk(ids).kv.to(engine.device)
    positions = torch.arange(36, 37 + len(ids), device=engine.device)
    with torch.no_grad():
        out = engine.hf_model(
            torch.tensor([[engine.tokenizer.bos_token_id] + ids], device=engine.device),
            position_ids=positions[None],
            use_cache=True,
        )
    rotary = engine.layers.rotary(positions[1:])
    for layer in range(engine.layers.num_layers):
        k_ref = out.past_key_values.layers[layer].keys[0]
        n = min(k_ref.shape[1], len(ids))
        torch.testing.assert_close(rotary(layer, stored[layer, 0])[:, -n:], k_ref[:, -n:], atol=2e-4, rtol=1e-4)


def test_chunks_from_a_cpu_engine_are_used_on_cuda(model_dirs, cuda_engines, tmp_path, docs):
    """One store across devices: chunks a CPU engine computed hit on the GPU
    engine of the same model and dtype, and r=1 still equals full prefill there."""
    store = ChunkStore(tmp_path / "shared")
    cpu = load_engine(model_dirs("llama"), store=store, device="cpu")
    assert cpu.warm(docs) == len(docs)
    gpu = cuda_engines("llama")
    gpu.store = ChunkStore(tmp_path / "shared")  # as another process would open it
    prompt = BlendPrompt("Read.", docs[::-1], QUESTION)
    full = gpu.generate(prompt, max_tokens=8, mode="full", logprobs=1)
    blend = gpu.generate(prompt, max_tokens=8, recompute_ratio=1.0, logprobs=1)
    assert (blend.usage.chunks_hit, blend.usage.chunks_missed) == (len(docs), 0)
    assert blend.token_ids == full.token_ids
    assert chosen(blend) == pytest.approx(chosen(full), abs=TOLERANCE["float32"])


@pytest.mark.parametrize("codec", ["fp8", "int8"])
def test_coded_chunks_are_decoded_on_the_gpu(model_dirs, tmp_path, docs, codec):
    """A coded store's memory tier keeps page-locked codes; the walk copies
    them to the GPU and decodes them there, to what decoding on the CPU gives
    (then rounded to the engine's bfloat16), and r=1 still equals full prefill."""
    store = ChunkStore(tmp_path, kv_codec=codec)
    engine = load_engine(model_dirs("llama"), store=store, dtype="bfloat16", device="cuda")
    ids = engine.tokenizer.encode(docs[0], add_special_tokens=False)
    chunk = engine.compute_chunk(ids)
    store.put(chunk)
    entry = store.get(chunk.key)
    assert entry.codec == codec and entry.kv.is_pinned()
    for layer in range(entry.num_layers):
        on_gpu = entry.kv.layer(layer, engine.device)
        assert on_gpu.device.type == "cuda"
        assert torch.equal(on_gpu.cpu(), entry.kv.layer(layer))
    engine.warm(docs)
    prompt = BlendPrompt("You answer questions.", docs[::-1], QUESTION)
    exact_at_ratio_one(engine, prompt, len(docs), max_tokens=8, tolerance=TOLERANCE["bfloat16"])


def test_stream_and_seeded_sampling_on_cuda(cuda_engines, docs):
    engine = cuda_engines("llama", "bfloat16")
    prompt = BlendPrompt("Read.", docs, QUESTION)
    stream = engine.stream(prompt, max_tokens=10)
    assert "".join(stream) == stream.generation.text
    a = engine.generate(prompt, max_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    b = engine.generate(prompt, max_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    assert a.token_ids == b.token_ids
