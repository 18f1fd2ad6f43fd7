"""Never silently wrong: the vLLM settings the blend connector refuses by
name, the ones shown safe, and the faults it survives with no state left
behind (docs/limits.md). The tensor-parallel faults are in
test_tensor_parallel.py, prompt logprobs and the server's refusal in test_server.py."""

from __future__ import annotations

import json
import os

import pytest

from blend_integrations import BlendConfig, ChunkStore, load_engine
from blend_integrations.engines.vllm_contract import blend_engine_args
from blend_integrations.engines.vllm_limits import UnsupportedSetting
from tests.fixtures.commands import ROOT, run_python


def vllm_config(model_dir: str, store_path, *, kv_role: str = "kv_both", **overrides):
    """vLLM's own ``VllmConfig`` for the engine arguments blending needs, with ``overrides``."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    args = blend_engine_args(store=ChunkStore(store_path), config=BlendConfig(), max_model_len=2048, on_gpu=False)
    args["kv_transfer_config"] = KVTransferConfig(**(args["kv_transfer_config"] | {"kv_role": kv_role}))
    return EngineArgs(model=model_dir, **(args | overrides)).create_engine_config()


REFUSED = {
    "enable_prefix_caching": {"enable_prefix_caching": True},
    "kv_role": {"kv_role": "kv_consumer"},
    "speculative_config": {
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    },
    "load_format": {"load_format": "auto"},
    "enable_lora": {"enable_lora": True},
    "pipeline_parallel_size": {"pipeline_parallel_size": 2},
    "async_scheduling": {},  # vLLM's CPU backend never schedules asynchronously: set below as a GPU's config has it
    # vLLM's CPU config refuses both context parallelisms itself (DCP must divide tensor_parallel_size=1,
    # and its V1 model runner has no PCP): set below on the built config, as a GPU's with them has them.
    "decode_context_parallel_size": {},
    "prefill_context_parallel_size": {},
    "kv_cache_dtype": {"kv_cache_dtype": "fp8"},
    # Model Runner V2, vLLM's default on a GPU: building it on a CPU fails (it needs Triton), so the
    # config is built with V1 and VLLM_USE_V2_MODEL_RUNNER=1 is set below, read when the connector checks.
    "use_v2_model_runner": {},
}
SET_AFTER_BUILD = {
    "async_scheduling": ("scheduler_config", True),
    "decode_context_parallel_size": ("parallel_config", 2),
    "prefill_context_parallel_size": ("parallel_config", 2),
}


@pytest.fixture
def v2_model_runner(monkeypatch):
    """VLLM_USE_V2_MODEL_RUNNER=1 for the rest of the test, read by vLLM's
    config when asked (vLLM reads its environment lazily, unless an engine
    started in this process cached it: uncached for this test)."""
    import vllm.envs as envs

    monkeypatch.setattr(envs, "__getattr__", getattr(envs.__getattr__, "__wrapped__", envs.__getattr__))

    def switch(on: bool) -> None:
        if on:
            monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
        else:
            monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)

    return switch


@pytest.mark.parametrize("setting", REFUSED)
def test_the_connector_refuses_each_setting_by_name(model_dirs, tmp_path, setting, v2_model_runner):
    """Each side of the connector refuses to start in a vLLM configured so
    (as a hand-started ``vllm serve`` could be), naming the setting."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from blend_integrations.engines.vllm_connector import BlendConnector

    v2_model_runner(False)
    config = vllm_config(model_dirs("llama"), tmp_path, **REFUSED[setting])
    if setting in SET_AFTER_BUILD:
        part, value = SET_AFTER_BUILD[setting]
        setattr(getattr(config, part), setting, value)
    if setting == "use_v2_model_runner":
        assert config.use_v2_model_runner is False
        v2_model_runner(True)
        assert config.use_v2_model_runner is True  # read from the environment when asked
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(UnsupportedSetting, match=f"the blend connector refuses {setting}: ") as refused:
            BlendConnector(config, role)
        assert refused.value.settings == [setting]
        assert "docs/limits.md" in str(refused.value)
    if setting == "use_v2_model_runner":
        assert "VLLM_USE_V2_MODEL_RUNNER=0" in str(refused.value)
        v2_model_runner(False)
    # and what blending needs, untouched, starts
    BlendConnector(vllm_config(model_dirs("llama"), tmp_path), KVConnectorRole.SCHEDULER)


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2", "bfloat16"])
def test_a_kv_cache_in_another_dtype_than_the_models_is_refused(model_dirs, tmp_path, dtype):
    """Every fp8 KV cache, and one in another plain dtype than the model's
    (this model is float32), until a GPU run shows it safe."""
    from blend_integrations.engines.vllm_limits import refused_settings

    config = vllm_config(model_dirs("llama"), tmp_path, kv_cache_dtype=dtype)
    [(name, why)] = refused_settings(config)
    assert name == "kv_cache_dtype" and f"kv_cache_dtype is {dtype!r} and the model's dtype float32" in why


def kv_cache_config(*groups):
    """vLLM's own ``KVCacheConfig`` with these ``(layer names, spec)`` groups."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec) for names, spec in groups],
    )


def test_the_worker_reads_its_block_size_from_the_kv_cache_spec(model_dirs, tmp_path):
    """The blend pass's cache slots use the block size of the KV cache group
    it writes, as vLLM's own slot mapping does, not ``cache_config.block_size``
    (an attention backend may set it apart). Several groups, or one that
    holds no attention KV, are refused by name on both sides."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    from blend_integrations.engines.vllm_connector import BlendConnector

    config = vllm_config(model_dirs("llama"), tmp_path)
    assert config.cache_config.block_size == 32
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    worker = BlendConnector(config, KVConnectorRole.WORKER, kv_cache_config((layers, full)))
    assert worker.block_size == 16
    # without a KV cache config (vLLM 0.32 gives both sides one; a caller may not): the setting
    assert BlendConnector(config, KVConnectorRole.SCHEDULER).block_size == 32

    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=64)
    mamba = MambaSpec(block_size=16, shapes=((4,),), dtypes=(torch.float32,))
    for groups in [((layers[:2], full), (layers[2:], window)), ((layers, mamba),)]:
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            with pytest.raises(UnsupportedSetting, match="refuses kv_cache_groups: vLLM made") as refused:
                BlendConnector(config, role, kv_cache_config(*groups))
            assert refused.value.settings == ["kv_cache_groups"]


def test_the_blend_memory_limit_is_read_and_checked_on_both_sides(model_dirs, tmp_path):
    """``kv_connector_extra_config.blend_memory_limit_bytes`` (vllm_memory):
    a non-negative integer, or the connector does not start, naming it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from blend_integrations.engines.vllm_connector import BlendConnector

    config = vllm_config(model_dirs("llama"), tmp_path)
    extra = config.kv_transfer_config.kv_connector_extra_config
    assert "blend_memory_limit_bytes" not in extra  # no limit but free memory, by default
    assert BlendConnector(config, KVConnectorRole.SCHEDULER).memory_limit_bytes is None
    extra["blend_memory_limit_bytes"] = 2**30
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        assert BlendConnector(config, role).memory_limit_bytes == 2**30
    extra["blend_memory_limit_bytes"] = "1GiB"
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match="blend_memory_limit_bytes must be a non-negative integer .* got '1GiB'"):
            BlendConnector(config, role)


def test_the_embedded_engine_refuses_prefix_caching_by_name(model_dirs, tmp_path):
    """The reported bug: with vLLM's prefix cache on, a full-prefill request
    after a blended one got the blended answer. Now the engine does not start,
    and its error names the setting and the way out."""
    with pytest.raises(UnsupportedSetting, match="refuses enable_prefix_caching") as refused:
        load_engine(
            model_dirs("llama"),
            backend="vllm",
            store=ChunkStore(tmp_path),
            max_model_len=2048,
            kv_cache_gib=1,
            enable_prefix_caching=True,
        )
    assert "--no-enable-prefix-caching" in str(refused.value)


@pytest.fixture(scope="module")
def probe(model_dirs, tmp_path_factory):
    """tests/fixtures/connector_probe.py's report: a hand-started ``vllm.LLM``
    with chunked prefill at 16 tokens, its engine core and worker in one process."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    store = tmp_path_factory.mktemp("probe-store")
    done = run_python("-m", "tests.fixtures.connector_probe", model_dirs("llama"), str(store), timeout=600, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_chunked_prefill_far_below_a_prompt_blends_exactly(probe):
    """The blend pass is outside vLLM's token budget (it runs before the
    step's forward): with 16 tokens a step, what vLLM computes after it, one
    token or the whole question in steps, reads the blended KV. At r=1 that
    is full prefill, token for token."""
    assert probe["budget"] == 16 < probe["prompt_tokens"]
    full = probe["full"]["tokens"]
    for name in ("blend_last", "blend_question"):
        run = probe[name]
        assert run["reason"] is None and run["usage"]["chunks_hit"] == 3, name
        assert run["usage"]["recomputed_tokens"] == run["usage"]["cached_tokens"] > 0, name
        assert run["tokens"] == full, name
    partial = probe["blend_015"]["usage"]
    assert partial["recomputed_tokens"] == round(0.15 * partial["cached_tokens"])


def test_failing_passes_and_aborts_leave_no_state(probe):
    """Requests whose blend pass fails, aborted before, during and after
    their step, and late reports of failed passes for aborted requests: both
    sides of the connector hold nothing once no request is in flight."""
    assert probe["finished"] > 0 and probe["aborted"] > 10
    assert probe["finished_reasons"] == ["blend_pass_failed"]
    idle = sorted(
        [
            ["scheduler", {"to_load": 0, "planned": 0, "reports": 0, "fallbacks": 0, "in_full": 0, "finishing": 0}],
            ["worker", {"failed": 0, "reports": 0, "invalid_blocks": 0, "unsaved": 0}],
        ]
    )
    assert probe["pending"] == idle
    assert sorted(probe["pending_rpc"], key=lambda p: p["side"]) == [{"side": side, **maps} for side, maps in idle]


def test_a_plan_that_fails_is_counted_as_planning_failed(probe):
    """The scheduler could not plan the pass (the store's lookups raised):
    the worker's report of the job it failed does not rename the reason."""
    planning = probe["planning"]
    assert planning["reason"] == "planning_failed"
    assert planning["usage"]["cached_tokens"] == 0
    assert planning["tokens"] == probe["full"]["tokens"]
