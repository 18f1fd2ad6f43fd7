"""Every model family on the embedded vLLM engine, beside the transformers
engine: blend at r=1 is vLLM's own full prefill, reordered chunks hit, and
chunks computed by either engine are hits on the other.

The small random models come from transformers' own configs
(``tests/fixtures/local_models.py``): the Gemma ones with sliding windows
shorter than the chunks and a rope base per layer type, Gemma 2 with
soft-capping, Phi-3 with partial rotary, Granite with its four multipliers,
OLMo 2 through vLLM's Transformers backend.
One vLLM engine per family, started and closed in its own test (~45 s each).
"""

from __future__ import annotations

import pytest

from blend_integrations import BlendPrompt, ChunkStore, load_engine
from blend_integrations.models.hf import SUPPORTED_MODEL_TYPES
from tests.fixtures.exactness import chosen, exact_at_ratio_one

QUESTION = "Question: which city is named in the documents? Answer:"


# llama runs through every other vLLM test (the session's vllm_engine)
@pytest.mark.parametrize("name", [t for t in SUPPORTED_MODEL_TYPES if t != "llama"])
def test_family_on_vllm(name, model_dirs, tmp_path, docs):
    store = ChunkStore(tmp_path / "store")
    transformers = load_engine(model_dirs(name), store=store, device="cpu")
    # vLLM's kernel for the layers without a window (the session's engine attends with SDPA)
    vllm = load_engine(
        model_dirs(name), backend="vllm", store=store, max_model_len=2048, kv_cache_gib=1, walk_attention="kernel"
    )
    try:
        # chunks the transformers engine computed are hits on vLLM ...
        transformers.warm(docs)
        prompt = BlendPrompt("You answer questions.", docs[::-1], QUESTION)
        full = exact_at_ratio_one(vllm, prompt, len(docs))
        # ... vLLM's full prefill is the transformers engine's ...
        reference = transformers.generate(prompt, max_tokens=10, mode="full", logprobs=1)
        assert reference.token_ids == full.token_ids
        assert chosen(reference) == pytest.approx(chosen(full), abs=1e-3)
        # ... reordered chunks all hit, and a blend recomputes its share ...
        shuffled = BlendPrompt("Read.", [docs[2], docs[0], docs[3], docs[1]], QUESTION)
        blend = vllm.generate(shuffled, max_tokens=4, recompute_ratio=0.15)
        chunk_tokens = sum(len(vllm.tokenizer.encode(d, add_special_tokens=False)) for d in docs)
        assert (blend.usage.chunks_hit, blend.usage.chunks_missed) == (len(docs), 0)
        assert blend.usage.recomputed_tokens == round(0.15 * chunk_tokens)
        # ... and chunks vLLM computed are hits for the transformers engine
        more = [d + " The end." for d in docs]
        assert vllm.warm(more) == len(more)
        back = transformers.generate(BlendPrompt("Read.", more, QUESTION), max_tokens=4, recompute_ratio=1.0)
        assert back.usage.chunks_hit == len(more)
        assert (
            back.token_ids
            == transformers.generate(BlendPrompt("Read.", more, QUESTION), max_tokens=4, mode="full").token_ids
        )
    finally:
        vllm.close()
