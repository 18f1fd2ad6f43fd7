"""The blend pass's memory beyond vLLM's budget (``engines/vllm_memory.py``):
what it counts, and the check that makes a pass short of memory fall back
before it allocates anything. The engines' tests run the fallback in vLLM
(test_vllm_engine.py, and under tensor parallelism test_tensor_parallel.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from blend_integrations.engines.vllm_memory import (
    NotEnoughMemory,
    PassMemory,
    check_memory_limit,
    check_pass_memory,
    host_available,
    pass_memory,
    pooled_tokens,
)
from blend_integrations.fusion import PrefillPlan
from blend_integrations.fusion.plan import LOAD, MISS, ChunkPlan
from blend_integrations.fusion.walk import ScratchCache

CPU = torch.device("cpu")


@dataclass
class Shape:
    """The ``LayerModel`` attributes the estimate reads (4 layers, 4 query heads over 2 KV heads of 32)."""

    device: torch.device = CPU
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    dtype: torch.dtype = torch.float32
    tp: None = None
    windows: tuple = (None,) * 4


# 300 tokens: two chunks of 100 loaded, one of 50 missed; blend at 0.25
PLAN = PrefillPlan(
    "blend", 0.25, (ChunkPlan(0, 100, "a", LOAD), ChunkPlan(100, 200, "b", LOAD), ChunkPlan(200, 250, "c", MISS)), 0
)
KV_ROW = 2 * 4 * 32 * 4  # K and V of one token, one KV head, every layer, float32


def test_a_pass_counts_its_dense_copy_its_chunks_and_its_attention():
    need = pass_memory(Shape(), PLAN, 300)
    assert need.dense_kv == 300 * 2 * KV_ROW
    assert (need.chunk_kv, need.chunk_layer) == (200 * 2 * KV_ROW, 0)  # entries hold every KV head, on the host
    # 100 fresh tokens and 50 of the 200 reused recomputed attend with a mask; a CPU attends 32 at a time
    scores, expanded, mask = 2 * 4 * 32 * 300 * 4, 2 * 4 * 300 * 32 * 4, 150 * 300 * 4
    assert need.attention == scores + expanded + mask
    assert need.total == need.dense_kv + need.chunk_kv + need.attention
    # a CPU's kept dense cache that holds the prompt costs nothing new
    assert pass_memory(Shape(), PLAN, 300, pooled_tokens=512).dense_kv == 0
    # a GPU attends every query in one call, and holds one layer of the loaded chunks at a time
    gpu = pass_memory(Shape(device=torch.device("cuda")), PLAN, 300, pooled_tokens=512)
    assert gpu.dense_kv == need.dense_kv and gpu.chunk_layer == 200 * 2 * 2 * 32 * 4
    assert gpu.attention == 2 * 4 * 150 * 300 * 4 + expanded + mask
    # the backend's kernel reads vLLM's cache and keeps no scores: the queries' copy and the output
    kernel = pass_memory(Shape(device=torch.device("cuda")), PLAN, 300, pooled_tokens=512, kernel=True)
    assert kernel.attention == 2 * 4 * 150 * 32 * 4 and kernel.dense_kv == gpu.dense_kv
    # reuse recomputes none of the reused tokens
    reuse = pass_memory(Shape(), PrefillPlan("reuse", 0.25, PLAN.chunks, 0), 300)
    assert reuse.attention == 2 * 4 * 32 * 300 * 4 + expanded + 100 * 300 * 4


def test_a_pass_over_the_limit_or_the_free_memory_is_refused_before_it_starts():
    need = pass_memory(Shape(), PLAN, 300)
    check_pass_memory(need, torch.device("cpu"), limit=need.total)  # fits
    check_pass_memory(need, torch.device("cpu"))  # a few MiB: the host has them
    with pytest.raises(NotEnoughMemory, match=rf"over blend_memory_limit_bytes={need.total - 1}$"):
        check_pass_memory(need, torch.device("cpu"), limit=need.total - 1)
    host = host_available()
    assert host is not None and host > 0
    huge = PassMemory(dense_kv=2 * host, chunk_kv=0, chunk_layer=0, attention=0)
    with pytest.raises(NotEnoughMemory, match="MiB of host memory beyond vLLM's budget .* the host has"):
        check_pass_memory(huge, torch.device("cpu"))
    # every tensor-parallel rank on the host runs its pass at once (margins: other processes' use moves)
    share = PassMemory(dense_kv=host * 2 // 5, chunk_kv=0, chunk_layer=0, attention=0)
    check_pass_memory(share, torch.device("cpu"))
    with pytest.raises(NotEnoughMemory, match="on each of 4 rank"):
        check_pass_memory(share, torch.device("cpu"), ranks=4)


def test_a_cpus_kept_dense_cache_is_free_to_reuse_unless_leased():
    caches = ScratchCache(Shape())
    assert pooled_tokens(caches) == 0
    with caches.lease(300):
        assert pooled_tokens(caches) == 0  # a request holds it
    assert pooled_tokens(caches) == ScratchCache.STEP


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1024", [1]])
def test_the_memory_limit_is_a_non_negative_integer(bad):
    assert check_memory_limit(None) is None and check_memory_limit(0) == 0 and check_memory_limit(2**30) == 2**30
    with pytest.raises(ValueError, match="kv_connector_extra_config.blend_memory_limit_bytes must be a non-negative"):
        check_memory_limit(bad)
