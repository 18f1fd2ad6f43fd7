"""The blend pass's memory beyond vLLM's budget (``engines/vllm_memory.py``):
what it counts, and the check that makes a pass short of memory fall back
before it allocates anything. The engines' tests run the fallback in vLLM
(test_vllm_engine.py, and under tensor parallelism test_tensor_parallel.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import pytest
import torch

from blend_integrations.calibration import Guard
from blend_integrations.engines.vllm_memory import (
    MiB,
    NotEnoughMemory,
    PassMemory,
    check_fits,
    check_memory_limit,
    check_pass_memory,
    gpu_free,
    highest_ratio,
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
    softcaps: tuple = (None,) * 4


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
    # a GPU attends these few queries in one block, and holds one layer of the loaded chunks at a time
    gpu = pass_memory(Shape(device=torch.device("cuda")), PLAN, 300, pooled_tokens=512)
    assert gpu.dense_kv == need.dense_kv and gpu.chunk_layer == 200 * 2 * 2 * 32 * 4
    assert gpu.attention == 2 * 4 * 150 * 300 * 4 + expanded + mask
    # the backend's kernel reads vLLM's cache and keeps no scores: the queries' copy and the output, for
    # every token before the check layer
    kernel = pass_memory(Shape(device=torch.device("cuda")), PLAN, 300, pooled_tokens=512, kernel=True)
    assert kernel.attention == 2 * 4 * 300 * 32 * 4 and kernel.dense_kv == gpu.dense_kv
    # reuse recomputes none of the reused tokens
    reuse = pass_memory(Shape(), PrefillPlan("reuse", 0.25, PLAN.chunks, 0), 300)
    assert reuse.attention == 2 * 4 * 32 * 300 * 4 + expanded + 100 * 300 * 4


def test_layers_before_the_check_layer_count_every_token_where_they_attend_with_a_mask():
    """Before the first check layer every token attends: causally, without
    scores, unless the layer has a sliding window (or a soft-cap), or a
    query-aware selection's walk starts at the first reused token."""
    expanded = 2 * 4 * 300 * 32 * 4
    # layer 0 has a window: 300 queries and their mask there, more than the 150 after it
    windowed = pass_memory(Shape(windows=(64, None, None, None)), PLAN, 300)
    assert windowed.attention == 2 * 4 * 32 * 300 * 4 + expanded + 300 * 300 * 4
    on_gpu = pass_memory(Shape(device=torch.device("cuda"), windows=(64, None, None, None)), PLAN, 300)
    assert on_gpu.attention == 2 * 4 * 300 * 300 * 4 + expanded + 300 * 300 * 4
    capped = pass_memory(Shape(softcaps=(30.0, None, None, None)), PLAN, 300)
    assert capped.attention == windowed.attention
    query = pass_memory(Shape(), replace(PLAN, selection="query"), 300)
    assert query.attention == windowed.attention


def test_the_estimate_takes_the_highest_ratio_the_walk_may_reach():
    """A guard may raise the ratio to 1.0 (the top of its ladder), and
    gradual filtering keeps more at its first check layer than the ratio."""
    guarded = replace(PLAN, guard=Guard(base=0.25, threshold=0.9))
    assert highest_ratio(PLAN) == 0.25 and highest_ratio(guarded) == 1.0
    assert highest_ratio(replace(PLAN, check_layers=(1, 2))) == pytest.approx(0.25 + 0.75 / 2)
    expanded = 2 * 4 * 300 * 32 * 4
    # 100 fresh and all 200 reused tokens attend after the check layer
    assert pass_memory(Shape(), guarded, 300).attention == 2 * 4 * 32 * 300 * 4 + expanded + 300 * 300 * 4


GiB = 2**30
H200 = 139 * GiB  # what torch.cuda.mem_get_info reports as an H200's total
# Llama-3-8B's shape on one GPU: 32 layers, 32 query heads over 8 KV heads of 128, bfloat16
LLAMA3_8B = Shape(
    device=torch.device("cuda"),
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    dtype=torch.bfloat16,
    windows=(None,) * 32,
    softcaps=(None,) * 32,
)
# 32,768 tokens: a 128-token head, 63 chunks of 512 loaded, a 384-token tail
BLEND_32K = PrefillPlan(
    "blend", 0.15, tuple(ChunkPlan(128 + 512 * i, 128 + 512 * (i + 1), f"c{i}", LOAD) for i in range(63)), 0
)


def test_a_32k_token_blend_of_llama3_8b_fits_beside_vllm_on_an_h200():
    need = pass_memory(LLAMA3_8B, BLEND_32K, 32768)
    # the dense copy: K and V of 32 layers x 8 KV heads x 32,768 tokens x 128 dims x 2 bytes = 4 GiB
    assert need.dense_kv == 2 * 32 * 8 * 32768 * 128 * 2 == 4 * GiB
    # one layer of the 32,256 loaded tokens on the GPU at a time: 126 MiB
    assert need.chunk_layer == 2 * 8 * 32256 * 128 * 2 == 126 * MiB
    # 512 fresh and ceil(0.15 x 32,256) = 4,839 reused queries, 5,351, in blocks of 2**30 / (32 heads x
    # 8 bytes) = 4,194,304 query-key pairs: a block's scores 1 GiB; K and V expanded to 32 heads 512 MiB;
    # the mask 5,351 x 32,768 x 2 bytes = 334 MiB
    assert need.attention == GiB + 2 * 32 * 32768 * 128 * 2 + 5351 * 32768 * 2
    # 6,092 MiB (5.95 GiB) on the GPU, within the 10% of 139 GiB (14,234 MiB) vLLM leaves at
    # gpu_memory_utilization=0.9. In one call the scores and their softmax alone were counted at
    # 2 x 32 heads x 5,351 x 32,768 x 4 bytes = 41.8 GiB: 46.8 GiB in all, and every such blend fell back.
    assert round(need.device / MiB) == 6092 and need.device <= 0.1 * H200
    # a guard may raise the ratio to 1.0: every token's mask, 32,768^2 x 2 bytes = 2 GiB more than the
    # 5,351 queries' 334 MiB; 7.6 GiB still fits
    guarded = pass_memory(LLAMA3_8B, replace(BLEND_32K, guard=Guard(base=0.15, threshold=0.9)), 32768)
    assert guarded.attention == GiB + 512 * MiB + 2 * GiB and guarded.device <= 0.1 * H200
    check_fits(guarded, gpu=("cuda:0", int(0.1 * H200)), host=None)


def test_a_blend_that_does_not_fit_falls_back_naming_why_and_its_numbers():
    """At gpu_memory_utilization=0.95 vLLM leaves 6.95 GiB of an H200: the
    32k-token blend fits at 0.15, not where a guard may raise it to 1.0."""
    free = H200 - int(0.95 * H200)
    check_fits(pass_memory(LLAMA3_8B, BLEND_32K, 32768), gpu=("cuda:0", free), host=None)
    guarded = pass_memory(LLAMA3_8B, replace(BLEND_32K, guard=Guard(base=0.15, threshold=0.9)), 32768)
    expected = (
        "not enough memory for the blend pass: it needs about 7806.0 MiB of GPU memory beyond vLLM's budget "
        "(the dense KV copy 4096.0 MiB, the loaded chunks' KV 4158.0 MiB, attention temporaries 3584.0 MiB), "
        "and cuda:0 has 7116.8 MiB free"
    )
    with pytest.raises(NotEnoughMemory, match=f"^{re.escape(expected)}$"):
        check_fits(guarded, gpu=("cuda:0", free), host=None)
    # what stays on the host, the loaded chunks' every layer, is checked against the host's memory
    with pytest.raises(NotEnoughMemory, match=r"needs about 4032\.0 MiB of host memory .* has 4000\.0 MiB available"):
        check_fits(guarded, gpu=("cuda:0", 8 * GiB), host=4000 * MiB)


def test_free_gpu_memory_counts_the_blocks_torch_holds_unused(monkeypatch):
    """torch's caching allocator reuses the blocks it holds before asking
    CUDA for more: they are free to the pass too."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (5 * GiB, H200))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 10 * GiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 7 * GiB)
    assert gpu_free(torch.device("cuda:0")) == 8 * GiB
    need = PassMemory(dense_kv=9 * GiB, chunk_kv=0, chunk_layer=0, attention=0)
    with pytest.raises(NotEnoughMemory, match="and cuda:0 has 8192.0 MiB free$"):
        check_pass_memory(need, torch.device("cuda:0"))
    check_pass_memory(replace(need, dense_kv=7 * GiB), torch.device("cuda:0"))


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
