"""Engines layer: the vLLM settings the blend connector refuses, and why.

vLLM lets a user combine a KV connector with settings that break what the
blend connector relies on: that a blended block stays with the request that
asked for it, that the worker's blend pass fills every KV layer the model
reads, that it has the model to walk. Any of them would make the connector
hand out wrong KV without a word, so the connector refuses to start with
them (both of its sides, in every vLLM process), and the embedded engine
says which one before anything else (``VLLMEngine``). docs/limits.md lists
them, with the settings shown safe instead.

Some are refused only until a GPU run shows them safe: they are vLLM's
defaults or common choices on a GPU (asynchronous scheduling, Model Runner
V2, an fp8 KV cache, context parallelism), and this connector has only run
on vLLM's CPU backend, which has none of them.
"""

from __future__ import annotations

from typing import Any


class UnsupportedSetting(ValueError):
    """A vLLM setting the blend connector cannot run with; ``settings`` names each by vLLM's engine argument."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.settings = [name for name, _ in problems]
        reasons = "; ".join(why for _, why in problems)
        super().__init__(f"the blend connector refuses {', '.join(self.settings)}: {reasons} (see docs/limits.md)")


def refused_settings(vllm_config: Any) -> list[tuple[str, str]]:
    """``(setting, why)`` for each setting of a ``VllmConfig`` the connector refuses."""
    role = vllm_config.kv_transfer_config.kv_role
    load_format = vllm_config.load_config.load_format
    parallel = vllm_config.parallel_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    model_dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
    checks = [
        (
            vllm_config.cache_config.enable_prefix_caching,
            "enable_prefix_caching",
            "vLLM's prefix cache would keep blocks of blended, approximate KV under the plain tokens' hash and "
            "hand them to later requests, blended or not; start vLLM with --no-enable-prefix-caching "
            "(enable_prefix_caching=False)",
        ),
        (
            role != "kv_both",
            "kv_role",
            f"kv_role is {role!r}: the connector both reads and writes the chunk store in one engine, "
            "so kv_transfer_config needs kv_role='kv_both'",
        ),
        (
            vllm_config.speculative_config is not None,
            "speculative_config",
            "the blend pass fills the target model's KV layers only, so a draft model or head would read "
            "no KV for the blended tokens; start vLLM without --speculative-config",
        ),
        (
            load_format != "blend",
            "load_format",
            f"load_format is {load_format!r}: the blend pass runs in the worker with the model the 'blend' "
            "loader hands it; start vLLM with --load-format blend",
        ),
        (
            vllm_config.lora_config is not None,
            "enable_lora",
            "chunk KV is keyed by the base model, and the blend pass runs the layers outside vLLM's forward, "
            "where vLLM's LoRA layers are not set up for its tokens; start vLLM without --enable-lora",
        ),
        (
            vllm_config.scheduler_config.async_scheduling,
            "async_scheduling",
            "with asynchronous scheduling vLLM schedules a request's next step before it learns that its "
            "blend pass failed, and a token sampled from the failed pass's KV could be delivered (not yet "
            "checked on a GPU); start vLLM with --no-async-scheduling",
        ),
        (
            vllm_config.parallel_config.pipeline_parallel_size > 1,
            "pipeline_parallel_size",
            "the blend pass walks every layer in one worker; split the model with tensor_parallel_size instead",
        ),
        (
            parallel.decode_context_parallel_size > 1,
            "decode_context_parallel_size",
            "decode context parallelism shards a request's KV by token over the ranks, and the blend pass "
            "writes every token's KV into its own rank's blocks (its slots assume the whole sequence is local); "
            "start vLLM without --decode-context-parallel-size",
        ),
        (
            parallel.prefill_context_parallel_size > 1,
            "prefill_context_parallel_size",
            "prefill context parallelism shards a request's KV by token over the ranks, and the blend pass "
            "writes every token's KV into its own rank's blocks (its slots assume the whole sequence is local); "
            "start vLLM without --prefill-context-parallel-size",
        ),
        (
            cache_dtype not in ("auto", model_dtype),
            "kv_cache_dtype",
            f"kv_cache_dtype is {cache_dtype!r} and the model's dtype {model_dtype}: a KV cache in another "
            "dtype (fp8 and the other quantized ones above all) holds KV the blend pass's attention, over "
            "its own dense copy, never read, and quantized with scales its writes are not shown to share "
            "(not yet checked on a GPU); start vLLM with --kv-cache-dtype auto",
        ),
        (
            vllm_config.use_v2_model_runner,
            "use_v2_model_runner",
            "vLLM's Model Runner V2 (its default on a GPU) runs KV connectors on a path this connector has "
            "never been run on; start vLLM with VLLM_USE_V2_MODEL_RUNNER=0 in its environment (the embedded "
            "engine and python -m blend_integrations.serve set it)",
        ),
    ]
    return [(name, why) for refused, name, why in checks if refused]


def check_vllm_config(vllm_config: Any) -> None:
    """Raise ``UnsupportedSetting`` naming every refused setting of ``vllm_config``."""
    problems = refused_settings(vllm_config)
    if problems:
        raise UnsupportedSetting(problems)


def kv_block_size(vllm_config: Any, kv_cache_config: Any) -> int:
    """Tokens per block of the KV cache the blend pass writes: the block
    size of its KV cache group's spec, what vLLM's own slot mapping uses (an
    attention backend may set it apart from ``cache_config.block_size``).
    The connector writes the blocks of group 0 (``block_ids[0]``), so every
    attention layer must be in that one group: vLLM turns its hybrid KV cache
    manager off for this connector (it does not declare ``SupportsHMA``), and
    then puts a model's sliding-window and full layers (Gemma 2 and 3) in one
    group of full-attention specs. Several groups, or a group of something
    else than attention KV (a Mamba state), are refused by name."""
    if kv_cache_config is None:
        # No spec to read: vLLM 0.32 and 0.33 give both sides one, but a caller may not (the
        # scheduler side never uses the block size). The setting is then the best there is.
        return int(vllm_config.cache_config.block_size)
    from vllm.v1.kv_cache_interface import AttentionSpec, UniformTypeKVCacheSpecs

    groups = kv_cache_config.kv_cache_groups
    spec = groups[0].kv_cache_spec if groups else None
    layers = spec.kv_cache_specs.values() if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
    if len(groups) != 1 or not all(isinstance(s, AttentionSpec) for s in layers):
        kinds = ", ".join(f"{type(g.kv_cache_spec).__name__} ({len(g.layer_names)} layers)" for g in groups)
        raise UnsupportedSetting(
            [
                (
                    "kv_cache_groups",
                    f"vLLM made {len(groups)} KV cache group(s) for this model: {kinds or 'none'}; the blend "
                    "pass writes attention KV into one group's blocks, so every layer must be in one group of "
                    "attention KV (start vLLM with --disable-hybrid-kv-cache-manager, and serve a model with "
                    "attention layers only)",
                )
            ]
        )
    assert spec is not None  # one group
    return int(spec.block_size)
