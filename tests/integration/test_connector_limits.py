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
}


@pytest.mark.parametrize("setting", REFUSED)
def test_the_connector_refuses_each_setting_by_name(model_dirs, tmp_path, setting):
    """Each side of the connector refuses to start in a vLLM configured so
    (as a hand-started ``vllm serve`` could be), naming the setting."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from blend_integrations.engines.vllm_connector import BlendConnector

    config = vllm_config(model_dirs("llama"), tmp_path, **REFUSED[setting])
    if setting == "async_scheduling":
        config.scheduler_config.async_scheduling = True
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(UnsupportedSetting, match=f"the blend connector refuses {setting}: ") as refused:
            BlendConnector(config, role)
        assert refused.value.settings == [setting]
        assert "docs/limits.md" in str(refused.value)
    # and what blending needs, untouched, starts
    BlendConnector(vllm_config(model_dirs("llama"), tmp_path), KVConnectorRole.SCHEDULER)


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
