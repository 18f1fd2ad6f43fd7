"""The vLLM engine with the blend connector, on vLLM's real CPU engine and a small local model."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import re
import shlex

import pytest
import torch

from blend_integrations import BlendConfig, BlendPrompt, ChunkStore, PromptError, UnsupportedModelError, load_engine
from blend_integrations.engines.base import Generation
from blend_integrations.engines.vllm_contract import (
    KV_CACHE_ENV,
    blend_engine_args,
    blend_engine_env,
    check_vllm_version,
    connector_store_args,
    engine_block_size,
)
from blend_integrations.engines.vllm_host import tcmalloc_library, tcmalloc_preload
from blend_integrations.fusion.plan import Planner
from blend_integrations.prompt import TokenizedPrompt
from blend_integrations.store import DEFAULT_READ_BANDWIDTH
from tests.fixtures.exactness import chosen
from tests.fixtures.gpu import vllm_gpu_args

QUESTION = "Question: which city is named in the documents? Answer:"


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


@pytest.mark.parametrize("selection", ["deviation", "query"])
def test_the_walk_attending_with_vllms_kernel_keeps_what_sdpa_keeps(vllm_engine, docs, selection):
    """In a connector job the walk writes every layer into vLLM's paged cache
    and attends there with the backend's kernel; it keeps the same tokens as
    the walk attending over its dense cache with SDPA, and computes the same KV."""
    tp = vllm_engine.tokenize(BlendPrompt("Read.", docs[::-1], QUESTION))
    spans = [list(span) for span in tp.chunk_spans]
    [(paged, dense, diff)] = vllm_engine.llm.collective_rpc(
        "blend_walk_both_ways", args=(list(tp.token_ids), spans, 0.15, selection)
    )
    assert paged and paged == dense
    assert diff < 1e-3


def test_vllm_full_prefill_equals_the_transformers_engine(vllm_engine, engine, docs):
    prompt = BlendPrompt("You answer questions.", docs, QUESTION)
    assert (
        vllm_engine.generate(prompt, max_tokens=12, mode="full").token_ids
        == engine.generate(prompt, max_tokens=12, mode="full").token_ids
    )


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
        b.usage.cached_tokens,
        b.usage.recomputed_tokens,
        b.usage.chunks_hit,
    )
    # which tokens each reused and recomputed, in the same shape (the vLLM worker reports them)
    assert a.reused_spans == b.reused_spans and len(b.reused_spans) == len(docs)
    assert sum(end - start for start, end in b.reused_spans) == b.usage.cached_tokens
    assert len(b.recomputed_positions) == b.usage.recomputed_tokens > 0
    assert a.recomputed_positions == b.recomputed_positions
    full = vllm_engine.generate(prompt, max_tokens=1, mode="full")
    assert full.reused_spans == full.recomputed_positions == ()


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
    # vLLM's front end stops a request on a stop string by aborting it in the engine core, which drops
    # the connector's answer: the engine asks the worker for it, and reports the same blend as without
    assert gen.usage.chunks_hit == len(docs) and gen.usage.recomputed_tokens > 0
    for answer in (stopped, vllm_engine.stream(prompt, max_tokens=20, stop=stop)):
        if not isinstance(answer, Generation):
            assert "".join(answer) == gen.text[: gen.text.index(stop)]
            answer = answer.generation
        assert dataclasses.replace(answer.usage, completion_tokens=0) == dataclasses.replace(
            gen.usage, completion_tokens=0
        )
        assert (answer.reused_spans, answer.recomputed_positions) == (gen.reused_spans, gen.recomputed_positions)

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


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0"])
def test_unsupported_vllm_version(version):
    with pytest.raises(RuntimeError, match=f"vLLM {version} is not supported.*>= 0.32 and < 0.34"):
        check_vllm_version(version)
    check_vllm_version("0.32.0")
    check_vllm_version("0.33.0")


def test_the_session_engines_kv_cache_is_sized_in_tokens(vllm_engine):
    """conftest asks for KV_CACHE_TOKENS (3,072) in blocks of the size the
    engine arguments set (32 tokens on a CPU, 16 on a GPU's FlashAttention):
    whatever the block size, vLLM holds that many tokens, over max_model_len."""
    import torch

    cache = vllm_engine.llm.llm_engine.vllm_config.cache_config
    on_gpu = torch.cuda.is_available()
    assert cache.block_size == engine_block_size(on_gpu) == (16 if on_gpu else 32)
    assert cache.num_gpu_blocks * cache.block_size == 3072 > vllm_engine.context_length
    if not on_gpu:  # kv_cache_gib=1, set for its own start, and not left for the next engine
        assert cache.kv_cache_memory_bytes == 2**30 and KV_CACHE_ENV not in os.environ


def test_engine_args_set_the_block_size_on_either_device(tmp_path):
    store = ChunkStore(tmp_path, remote="")
    for on_gpu, size in ((False, 32), (True, 16)):
        args = blend_engine_args(store=store, config=BlendConfig(), max_model_len=2048, on_gpu=on_gpu)
        assert args["block_size"] == engine_block_size(on_gpu) == size


def test_preempted_requests_are_blended_again(vllm_engine):
    """When vLLM preempts a request for lack of KV blocks and resumes it later in new
    blocks, the connector must run the blend pass into those blocks again."""
    from tests.fixtures.local_models import sample_text

    # 12 requests of about 380 tokens each at their end: well over the engine's KV cache of 3,072 tokens
    # (conftest's KV_CACHE_TOKENS; 8 requests sat on the edge)
    docs = [" ".join(sample_text(6, seed=7000 + i)) for i in range(12)]
    vllm_engine.warm(docs)
    prompts = [
        BlendPrompt("Read.", [docs[i], docs[(i + 3) % 12], docs[(i + 5) % 12], docs[(i + 1) % 12]], "Answer:")
        for i in range(12)
    ]

    def preemptions():
        return sum(m.value for m in vllm_engine.llm.get_metrics() if m.name == "vllm:num_preemptions")

    alone = [vllm_engine.generate(p, max_tokens=80).token_ids for p in prompts]
    before = preemptions()
    together = vllm_engine.generate_many(prompts, max_tokens=80)
    assert preemptions() > before, "the test needs vLLM to preempt; shrink the KV cache"
    assert [g.token_ids for g in together] == alone


# -- the Redis tier in vLLM's processes ----------------------------------------


def test_chunks_in_redis_are_hits_for_the_vllm_engine(vllm_engine, model_dirs, redis_url, tmp_path, docs):
    """The connector opens the store's Redis tier in vLLM's processes (the session engine's URL has a
    password, which reaches them in $BLEND_STORE_REMOTE): chunks that a transformers engine wrote to
    Redis from another directory are hits, and the worker copies them to its own directory."""
    writer = load_engine(model_dirs("llama"), store=ChunkStore(tmp_path / "elsewhere", remote=redis_url), device="cpu")
    assert writer.warm(docs) == len(docs)
    keys = [writer.chunk_key(writer.tokenizer.encode(d, add_special_tokens=False)) for d in docs]
    assert keys == [vllm_engine.chunk_key(vllm_engine.tokenizer.encode(d, add_special_tokens=False)) for d in docs]
    vllm_disk = ChunkStore(vllm_engine.store.path, memory_limit_bytes=0, remote="")  # its directory alone
    assert not any(k in vllm_disk for k in keys)

    prompt = BlendPrompt("Read.", [docs[2], docs[0], docs[3], docs[1]], QUESTION)
    blend = vllm_engine.generate(prompt, max_tokens=8, recompute_ratio=1.0)
    assert (blend.usage.chunks_hit, blend.usage.chunks_missed) == (len(docs), 0)
    assert blend.token_ids == vllm_engine.generate(prompt, max_tokens=8, mode="full").token_ids
    assert all(k in vllm_disk for k in keys)  # Redis hits are copied down to the disk tier


def test_engine_args_carry_the_redis_tier_without_its_password(tmp_path, monkeypatch):
    monkeypatch.delenv("BLEND_STORE_REMOTE", raising=False)
    url = "redis://blend:hunter2@cache-host:6380/3"
    store = ChunkStore(tmp_path, remote=url, remote_size_limit_bytes=2**20, remote_timeout_s=0.5)
    args = blend_engine_args(store=store, config=BlendConfig(), max_model_len=2048, on_gpu=False)
    extra = args["kv_transfer_config"]["kv_connector_extra_config"]
    assert "hunter2" not in json.dumps(args)
    assert extra["store_remote"] == "redis://blend:***@cache-host:6380/3" and extra["store_remote_in_env"] is True
    assert (extra["store_remote_size_limit_bytes"], extra["store_remote_timeout_s"]) == (2**20, 0.5)
    # on a CPU, with tcmalloc preloaded for vLLM's processes where it is installed; everywhere with
    # vLLM's V1 model runner (vllm_limits refuses V2, vLLM's default on a GPU)
    preload = tcmalloc_preload()
    v1 = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert blend_engine_env(store) == v1 | {"BLEND_STORE_REMOTE": url} | ({"LD_PRELOAD": preload} if preload else {})
    assert blend_engine_env(store, on_gpu=True) == v1 | {"BLEND_STORE_REMOTE": url}

    # the connector's side: the full URL from the environment vLLM's processes inherit
    with pytest.raises(
        ValueError,
        match=r"'redis://blend:\*\*\*@cache-host:6380/3' has a password.*"
        r"set BLEND_STORE_REMOTE.*\(it is not set\)",
    ):
        connector_store_args(extra)
    monkeypatch.setenv("BLEND_STORE_REMOTE", "redis://blend:other@elsewhere:6380/3")
    with pytest.raises(ValueError, match=r"\(it is 'redis://blend:\*\*\*@elsewhere:6380/3'\)"):
        connector_store_args(extra)
    monkeypatch.setenv("BLEND_STORE_REMOTE", url)
    assert connector_store_args(extra) == {
        "path": str(tmp_path),
        "size_limit_bytes": store.size_limit_bytes,
        "memory_limit_bytes": store.memory_limit_bytes,
        "remote": url,
        "remote_size_limit_bytes": 2**20,
        "remote_timeout_s": 0.5,
        "read_bandwidth": DEFAULT_READ_BANDWIDTH,
        "kv_codec": None,
    }

    # without a password the URL is in the config and nothing in the environment
    plain = ChunkStore(tmp_path, remote="redis://cache-host:6380/3")
    extra = blend_engine_args(store=plain, config=BlendConfig(), max_model_len=2048, on_gpu=False)[
        "kv_transfer_config"
    ]["kv_connector_extra_config"]
    assert (extra["store_remote"], extra["store_remote_in_env"], blend_engine_env(plain, on_gpu=True)) == (
        "redis://cache-host:6380/3",
        False,
        v1,
    )
    assert connector_store_args(extra)["remote"] == "redis://cache-host:6380/3"

    # no Redis tier: the connector opens none, even with $BLEND_STORE_REMOTE set
    none = blend_engine_args(
        store=ChunkStore(tmp_path, remote=""), config=BlendConfig(), max_model_len=2048, on_gpu=False
    )["kv_transfer_config"]["kv_connector_extra_config"]
    assert none["store_remote"] is None and connector_store_args(none)["remote"] == ""


def test_walk_attention_is_checked_and_reaches_the_connector(tmp_path, capsys):
    from blend_integrations import serve
    from blend_integrations.engines.vllm_contract import check_walk_attention

    store = ChunkStore(tmp_path, remote="")
    for choice in ("auto", "kernel", "sdpa"):
        args = blend_engine_args(
            store=store, config=BlendConfig(), max_model_len=512, on_gpu=False, walk_attention=choice
        )
        assert args["kv_transfer_config"]["kv_connector_extra_config"]["walk_attention"] == choice
    with pytest.raises(ValueError, match=r"walk_attention must be one of 'auto', 'kernel', 'sdpa', got 'fast'"):
        blend_engine_args(store=store, config=BlendConfig(), max_model_len=512, on_gpu=False, walk_attention="fast")

    with pytest.raises(ValueError, match="walk_attention must be one of .* got 'cuda'"):
        check_walk_attention("cuda")  # what the connector calls on kv_connector_extra_config's value

    serve.main(["some/model", "--store", str(tmp_path), "--walk-attention", "sdpa", "--print"])
    assert '"walk_attention": "sdpa"' in capsys.readouterr().out
    with pytest.raises(SystemExit):
        serve.main(["some/model", "--store", str(tmp_path), "--walk-attention", "fast", "--print"])
    assert "--walk-attention: invalid choice: 'fast'" in capsys.readouterr().err


def test_walk_attention_auto_keeps_what_it_measured_faster(vllm_engine):
    """The session engine attends with SDPA (walk_attention="sdpa": nothing
    timed); asked to choose as "auto" does, its worker times vLLM's kernel and
    SDPA on a blend-like active set and keeps the kernel unless SDPA was
    faster by more than the margin."""
    from blend_integrations.models.vllm import KERNEL_AGREEMENT, KERNEL_MARGIN

    [how] = vllm_engine.llm.collective_rpc("blend_attention")
    assert (how["backend"], how["kernel"], how["probe"]) == ("CPU_ATTN", False, {})
    [auto] = vllm_engine.llm.collective_rpc("blend_choose_attention")
    probe = auto["probe"]
    assert probe["kernel_ms"] > 0 and probe["sdpa_ms"] > 0
    assert probe["kernel_error"] <= KERNEL_AGREEMENT[torch.float32]  # the kernel reads what the walk wrote
    assert auto["kernel"] == (probe["kernel_ms"] <= probe["sdpa_ms"] * KERNEL_MARGIN)
    assert vllm_engine.llm.collective_rpc("blend_attention") == [how]  # the engine's own setting is back


def test_a_walk_pass_is_timed_on_the_worker(vllm_engine):
    """The oracle benchmark's fixed cost of a pass, on the worker's model; a
    bad context is refused there without harming the engine."""
    [seconds] = vllm_engine.llm.collective_rpc("blend_pass_seconds", args=(64,))
    assert seconds > 0
    [scored] = vllm_engine.llm.collective_rpc("blend_pass_seconds", args=(64, 16, 8))  # a query selection's pass
    assert scored > 0
    with pytest.raises(Exception, match="context must be an int"):
        vllm_engine.llm.collective_rpc("blend_pass_seconds", args=(-1,))
    assert vllm_engine.generate("Hello", mode="full", max_tokens=2).token_ids


def test_a_kernel_that_disagrees_with_sdpa_is_never_used(vllm_engine):
    """A backend kernel whose output differs from SDPA's on the probe (as one
    that read vLLM's cache otherwise than the walk writes it would) is not
    used, even where walk_attention="kernel" asks for it: the pass attends
    with SDPA. Unbroken, the forced kernel is used."""
    from blend_integrations.models.vllm import KERNEL_AGREEMENT

    [forced] = vllm_engine.llm.collective_rpc("blend_choose_attention", args=("kernel",))
    assert forced["kernel"] and forced["probe"]["kernel_error"] <= KERNEL_AGREEMENT[torch.float32]
    for setting in ("kernel", "auto"):
        [broken] = vllm_engine.llm.collective_rpc("blend_choose_attention", args=(setting, True))
        assert not broken["kernel"], setting
        assert broken["probe"]["kernel_error"] > 0.05, setting  # outputs 10% off


def test_vllm_workers_run_on_tcmalloc_where_it_is_installed(vllm_engine):
    """On a CPU the engine starts vLLM's processes with tcmalloc preloaded, as
    vLLM's CPU guide asks (`make test` installs it, as root); where it is not installed
    they run on the system's malloc."""
    expected = "tcmalloc" if tcmalloc_library() is not None else "system"
    assert vllm_engine.llm.collective_rpc("blend_allocator") == [expected]


def test_vllm_workers_run_vllms_v1_model_runner(vllm_engine):
    """The engine starts vLLM's processes with VLLM_USE_V2_MODEL_RUNNER=0
    (``blend_engine_env``): on a GPU vLLM would pick its Model Runner V2, which
    the connector refuses (``vllm_limits``); on a CPU V1 is vLLM's default too."""
    [worker] = vllm_engine.llm.collective_rpc("blend_model_runner")
    assert worker["env"] == "0"
    # V1: vllm/v1/worker/{cpu,gpu}_model_runner.py; V2: vllm/v1/worker/{cpu,gpu}/model_runner.py
    assert worker["runner"] in (
        "vllm.v1.worker.cpu_model_runner.CPUModelRunner",
        "vllm.v1.worker.gpu_model_runner.GPUModelRunner",
    )


def test_serve_passes_the_redis_url_in_the_environment(tmp_path, monkeypatch, capsys):
    from blend_integrations import serve

    monkeypatch.delenv("BLEND_STORE_REMOTE", raising=False)
    url = "redis://:hunter2@cache-host:6379/0"
    serve.main(["some/model", "--store", str(tmp_path), "--store-remote", url, "--print", "--port", "8000"])
    words = shlex.split(capsys.readouterr().out)
    assert f"BLEND_STORE_REMOTE={url}" in words  # the environment to run it with
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in words[: words.index("-m")]  # vLLM's V1 model runner (vllm_limits)
    cmd = words[words.index("-m") - 1 :]
    assert "hunter2" not in " ".join(cmd) and cmd[-2:] == ["--port", "8000"]
    extra = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra["store_remote"] == "redis://:***@cache-host:6379/0" and extra["store_remote_in_env"] is True

    monkeypatch.setenv("BLEND_STORE_REMOTE", "redis://cache-host:6379/1")  # the default of --store-remote
    serve.main(["some/model", "--store", str(tmp_path), "--print"])
    out = capsys.readouterr().out
    assert "BLEND_STORE_REMOTE" not in out.split(" -m ")[0] and '"store_remote": "redis://cache-host:6379/1"' in out
    serve.main(["some/model", "--store", str(tmp_path), "--store-remote", "", "--print"])
    assert '"store_remote": null' in capsys.readouterr().out


def test_serve_checks_requests_and_keeps_its_key_off_the_command_line(tmp_path, monkeypatch, capsys):
    from blend_integrations import serve

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    serve.main(["some/model", "--store", str(tmp_path), "--api-key", "s3cret", "--print", "--port", "8000"])
    words = shlex.split(capsys.readouterr().out)
    cmd = words[words.index("-m") - 1 :]
    assert "VLLM_API_KEY=s3cret" in words[: words.index("-m") - 1] and "s3cret" not in " ".join(cmd)
    middlewares = [cmd[i + 1] for i, word in enumerate(cmd) if word == "--middleware"]
    assert middlewares == ["blend_integrations.serve.CheckBlendParams", "blend_integrations.serve.CalibrationRoute"]
    transfer = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert transfer["kv_load_failure_policy"] == "recompute"  # a failed blend pass is recomputed, not fatal
    with pytest.raises(SystemExit):
        serve.main(["some/model", "--api-key", "", "--print"])
    assert "--api-key must not be empty" in capsys.readouterr().err


# -- no request can take the engine down -----------------------------------------


def raw_request(engine, token_ids: list[int], kv_transfer_params, max_tokens: int = 6):
    """A request straight into the embedded engine's vLLM with the given
    ``kv_transfer_params``, past the package's own checks (as any other caller
    of vLLM could send it): (generated token ids, the connector's answer)."""
    import queue
    import uuid

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0,
        output_kind=RequestOutputKind.FINAL_ONLY,
        extra_args={"kv_transfer_params": kv_transfer_params},
    )
    rid = f"raw-{uuid.uuid4().hex[:8]}"
    outputs: queue.Queue = queue.Queue()
    engine._requests[rid] = outputs
    with engine._lock:
        engine.llm.llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=token_ids), params)
    engine._wake.set()
    out = outputs.get(timeout=300)
    while not out.finished:
        out = outputs.get(timeout=300)
    return list(out.outputs[0].token_ids), out.kv_transfer_params


def test_bad_params_that_reach_the_connector_are_computed_in_full(vllm_engine, docs):
    """Defence in depth: parameters that break a rule and reach the scheduler
    (no HTTP edge in between) never raise there: the request is computed in
    full, says why, and the engine goes on."""
    vllm_engine.warm(docs)
    tp = vllm_engine.tokenize(BlendPrompt("Read.", docs, QUESTION))
    n, spans = len(tp), [list(s) for s in tp.chunk_spans]
    full = vllm_engine.generate(tp, max_tokens=6, mode="full").token_ids
    bad = [
        ({"mode": "blend", "chunk_spans": "abc", "num_tokens": 5}, "chunk_spans must be a list"),
        ({"mode": "blend", "chunk_spans": [["a", "b"]], "num_tokens": 5}, r"chunk_spans\[0\] must hold integers"),
        ({"mode": "blend", "chunk_spans": [[9, 4]], "num_tokens": 10}, r"chunk_spans\[0\] is \[9, 4\]"),
        ({"mode": "blend", "chunk_spans": [[-3, 4]], "num_tokens": 10}, "starts at -3"),
        ({"mode": "blend", "chunk_spans": [[2, n + 50]]}, f"ends at {n + 50}, past {n - 1}"),
        ({"mode": "blend", "chunk_spans": [[10, 10]], "num_tokens": 12}, r"is \[10, 10\]"),
        ({"mode": "blend", "chunk_spans": spans, "num_tokens": n}, f"num_tokens is {n} but the prompt has {n} tokens"),
        ({"mode": "blend", "chunk_spans": spans, "ratio": "high"}, "ratio must be a number in"),
        (
            {"mode": "blend", "chunk_spans": spans, "num_tokens": str(spans[-1][1])},
            "num_tokens must be a positive integer",
        ),
        ({"mode": "blend", "chunk_spans": [spans[1], spans[0]]}, "must be sorted and must not overlap"),
        ({"mode": "blend", "chunk_spans": spans, "num_tokens": spans[-1][1] - 1}, "past num_tokens"),
        ({"mode": "blend", "chunk_spans": spans, "ratio": 5}, "got 5"),
        ({"mode": "blend", "separator": "\u2603"}, "no chunk between two separators"),
        ("blend", "must be an object"),
    ]
    for params, why in bad:
        tokens, answer = raw_request(vllm_engine, tp.token_ids, {"blend": params})
        assert tokens == full, params
        assert answer["blend"]["chunks_hit"] == 0 and re.search(why, answer["blend_fallback"]), (params, answer)
    good = vllm_engine.generate(tp, max_tokens=6, recompute_ratio=1.0)
    assert good.token_ids == full and good.usage.chunks_hit == len(docs) and good.fallback is None


def test_explicit_spans_follow_the_rules_on_the_embedded_engine(vllm_engine, docs):
    tp = vllm_engine.tokenize(BlendPrompt("Read.", docs[:2], QUESTION))
    ids = tp.token_ids
    with pytest.raises(PromptError, match=r"TokenizedPrompt\.chunk_spans\[1\] starts at 3, before the end 5"):
        vllm_engine.generate(TokenizedPrompt(ids, [(1, 5), (3, 8)]), max_tokens=2)
    with pytest.raises(PromptError, match=r"TokenizedPrompt\.chunk_spans\[0\] ends at \d+, past the prompt end"):
        vllm_engine.generate(TokenizedPrompt(ids, [(1, len(ids) + 1)]), max_tokens=2)
    # the vLLM engine computes the prompt's last token itself: a chunk cannot end the prompt
    with pytest.raises(PromptError, match="the prompt ends with chunk 0: vLLM computes the prompt's last token itself"):
        vllm_engine.generate(TokenizedPrompt(ids, [(2, len(ids))]), max_tokens=2)
    assert vllm_engine.generate(TokenizedPrompt(ids, [(2, len(ids) - 1)]), max_tokens=2).usage.chunks_missed == 1


@pytest.mark.timeout(300)  # without the fallback, the engine dies and the requests wait forever
def test_a_failing_plan_costs_one_request_not_the_engine(model_dirs, tmp_path, monkeypatch, caplog, docs):
    """The scheduler fails to plan one request's blend pass (here its chunk
    lookup raises). That request is computed in full and says why, once in the
    log; the requests beside it are blended; the engine goes on serving. The
    engine runs vLLM's scheduler in this process, so that the fault can be put
    into it."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    engine = load_engine(
        model_dirs("llama"),
        backend="vllm",
        store=ChunkStore(tmp_path / "store"),
        max_model_len=2048,
        kv_cache_gib=1,
        distributed_executor_backend="uni",
        **vllm_gpu_args(),  # beside the session's engine, both within one GPU
    )
    try:
        connector = engine.llm.llm_engine.engine_core.engine_core.scheduler.connector
        planner = connector.planner
        poison = engine.tokenizer.encode(docs[3], add_special_tokens=False)

        class FailingPlanner(Planner):
            def plan(self, token_ids, *args, **kwargs):
                if any(list(token_ids[i : i + len(poison)]) == poison for i in range(len(token_ids))):
                    raise OSError("injected fault: the chunk store could not be read")
                return super().plan(token_ids, *args, **kwargs)

        engine.warm(docs)
        prompts = [BlendPrompt("Read.", [docs[i % 3], docs[(i + 1) % 3]], QUESTION) for i in range(3)]
        prompts.insert(1, BlendPrompt("Read.", [docs[3], docs[0]], QUESTION))
        full = [engine.generate(p, max_tokens=8, mode="full").token_ids for p in prompts]
        connector.planner = FailingPlanner(planner.config, planner.keys, planner.num_layers)
        with caplog.at_level(logging.WARNING, logger="blend_integrations.engines.vllm_connector"):
            gens = engine.generate_many(prompts, max_tokens=8, recompute_ratio=1.0)
        connector.planner = planner
        assert [g.token_ids for g in gens] == full
        failed = gens.pop(1)
        assert all(g.fallback is None and (g.usage.chunks_hit, g.usage.chunks_missed) == (2, 0) for g in gens)
        assert failed.fallback == (
            "planning the blend pass failed: OSError('injected fault: the chunk store could not be read')"
        )
        assert (failed.usage.cached_tokens, failed.usage.chunks_hit) == (0, 0)
        logged = [r.getMessage() for r in caplog.records if r.name == "blend_integrations.engines.vllm_connector"]
        assert len(logged) == 1 and "planning the blend pass failed" in logged[0], logged
        again = engine.generate(prompts[1], max_tokens=8, recompute_ratio=1.0)
        assert again.fallback is None and again.usage.chunks_hit == 2 and again.token_ids == full[1]
    finally:
        engine.close()


def test_a_failing_blend_pass_costs_one_request_not_the_engine(vllm_engine, docs):
    """With several requests in flight, the blend pass of one fails for real in the
    worker (it leaves wrong KV in the request's blocks, then runs out of memory).
    vLLM recomputes that request in full; the others are blended as usual; the
    failure is logged once, with the request id; the engine goes on serving."""
    vllm_engine.warm(docs)
    poison = vllm_engine.tokenizer.encode(docs[3], add_special_tokens=False)
    prompts = [BlendPrompt("Read.", [docs[i % 3], docs[(i + 1) % 3]], QUESTION) for i in range(5)]
    prompts.insert(2, BlendPrompt("Read.", [docs[0], docs[3], docs[1]], QUESTION))
    full = [vllm_engine.generate(p, max_tokens=8, mode="full").token_ids for p in prompts]
    vllm_engine.llm.collective_rpc("blend_fail_on", args=(poison,))
    try:
        gens = vllm_engine.generate_many(prompts, max_tokens=8, recompute_ratio=1.0)
        log = vllm_engine.llm.collective_rpc("blend_fault_log")[0]
    finally:
        vllm_engine.llm.collective_rpc("blend_fail_on", args=(None,))
    assert [g.token_ids for g in gens] == full  # at r=1, blended or recomputed, all equal full prefill
    failed = gens.pop(2)
    assert all(g.fallback is None and (g.usage.chunks_hit, g.usage.chunks_missed) == (2, 0) for g in gens)
    assert failed.fallback == (
        "the blend pass failed: OutOfMemoryError: injected fault: out of memory in the blend pass"
    )
    assert (failed.usage.cached_tokens, failed.usage.chunks_hit) == (0, 0)
    assert failed.stats()["fallback"] == failed.fallback
    assert len(log) == 1 and log[0].startswith("ERROR request ") and "OutOfMemoryError" in log[0], log
    again = vllm_engine.generate(prompts[2], max_tokens=8, recompute_ratio=1.0)
    assert again.fallback is None and again.usage.chunks_hit == 3 and again.token_ids == full[2]


def test_a_round_that_fell_back_is_never_timed_as_a_blend(vllm_engine, docs):
    """The benchmarks' timer (``benchmarks.time_cases``) on a blend pass that fails for real in the
    worker on every prompt that holds one document: those rounds are counted apart, not timed."""
    import itertools

    from benchmarks import served_as, time_cases

    vllm_engine.warm(docs)
    poison = vllm_engine.tokenizer.encode(docs[3], add_special_tokens=False)
    failing, blending = BlendPrompt("Read.", [docs[0], docs[3]], QUESTION), BlendPrompt("Read.", docs[:2], QUESTION)
    # one call a case, in turn: round 0 (warm-up) full, blend; round 1 full, blend; ... so the timed blend rounds
    # get failing, failing, blending
    prompts = itertools.cycle([failing, failing, blending, failing, failing, failing, failing, blending])
    cases = [("full", "full", None), ("blend", "blend", 0.5)]
    vllm_engine.llm.collective_rpc("blend_fail_on", args=(poison,))
    try:
        times, usage, apart = time_cases(vllm_engine, lambda: next(prompts), cases, repeats=3)
        assert (len(times["full"]), len(times["blend"]), apart) == (3, 1, {"full": 0, "blend": 2})
        assert usage["blend"].cached_tokens > 0  # the round that blended
        fell_back = vllm_engine.generate(failing, max_tokens=1, recompute_ratio=0.5)
        assert fell_back.fallback is not None and served_as(fell_back) == "fallback"
        with pytest.raises(RuntimeError, match="no round of blend was blended"):
            time_cases(vllm_engine, lambda: failing, cases, repeats=1)
    finally:
        vllm_engine.llm.collective_rpc("blend_fail_on", args=(None,))
    assert served_as(vllm_engine.generate(failing, max_tokens=1, recompute_ratio=0.5)) == "blend"


def test_a_blend_pass_short_of_memory_falls_back_before_it_starts(vllm_engine, docs):
    """The worker checks what a blend pass would allocate beyond vLLM's budget
    against free memory and ``blend_memory_limit_bytes`` before it starts;
    short of it (a limit of 1 byte here) the request is computed in full, with
    reason "blend_memory", the answer is full prefill's, and the engine goes on."""
    vllm_engine.warm(docs)
    prompt = BlendPrompt("Read.", docs[::-1], QUESTION)
    full = vllm_engine.generate(prompt, max_tokens=8, mode="full")
    before = vllm_engine.stats()
    vllm_engine.llm.collective_rpc("blend_memory_limit", args=(1,))
    try:
        short = vllm_engine.generate(prompt, max_tokens=8, recompute_ratio=1.0)
    finally:
        vllm_engine.llm.collective_rpc("blend_memory_limit", args=(None,))
    assert short.fallback.startswith("not enough memory for the blend pass: it needs about ")
    assert "over blend_memory_limit_bytes=1" in short.fallback and "the dense KV copy" in short.fallback
    assert (short.usage.cached_tokens, short.usage.chunks_hit) == (0, 0)
    assert short.token_ids == full.token_ids
    after = vllm_engine.stats()
    assert after.get("requests_full_blend_memory", 0) - before.get("requests_full_blend_memory", 0) == 1
    again = vllm_engine.generate(prompt, max_tokens=8, recompute_ratio=1.0)
    assert (again.fallback, again.usage.chunks_hit) == (None, len(docs))
    assert again.token_ids == full.token_ids


def test_stats_count_what_the_generations_reported(vllm_engine, docs):
    """The embedded engine's stats() counts each finished request once, as the
    server's /metrics does: by outcome, with the reused and recomputed tokens."""
    vllm_engine.warm(docs)
    before = vllm_engine.stats()
    prompts = [BlendPrompt("Read.", docs[::-1], QUESTION), BlendPrompt("Read.", docs, QUESTION)]
    gens = vllm_engine.generate_many(prompts, max_tokens=2, recompute_ratio=0.15)
    full = vllm_engine.generate(prompts[0], max_tokens=2, mode="full")
    after = vllm_engine.stats()

    def moved(name):
        return after.get(name, 0) - before.get(name, 0)

    assert moved("requests_blend") == 2
    assert moved("requests_full_not_requested") == 1 and full.usage.cached_tokens == 0
    assert moved("cached_tokens") == sum(g.usage.cached_tokens for g in gens) > 0
    assert moved("recomputed_tokens") == sum(g.usage.recomputed_tokens for g in gens) > 0
    assert moved("chunks_hit") == 2 * len(docs)
