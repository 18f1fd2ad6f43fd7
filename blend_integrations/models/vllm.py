"""Models layer: ``LayerModel`` over vLLM's decoder modules (``VLLM_MODEL_TYPES``).

vLLM fuses q/k/v into one projection; the adapter splits it, and rotates
with each layer's vLLM rotary module (its fused kernel, ``FusedRotary``), so
the walk sees exactly the same interface as with Hugging Face modules. The
families' differences (norm placement, multipliers, soft-capping, windows)
are read the same way as in ``hf.py``. Runs inside a vLLM worker process.

In a connector job the walk's KV goes into the request's blocks of vLLM's
paged cache, layer by layer, through the attention backend's own
``do_kv_cache_update``; the active tokens then attend there with the
backend's own kernel, as vLLM's forward does (``PagedAttention``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.profiler import record_function

from ..fusion.attention import DenseAttention
from ..fusion.layers import Attention, TensorParallel
from .hf import check_supported, heads_first, layer_windows, post_norm_finish

# Attention backends whose kernel the blend pass drives (tested here); on any
# other the walk writes the paged cache the same way and attends with SDPA.
KERNEL_BACKENDS = ("CPU_ATTN",)


@dataclass(frozen=True)
class PagedCache:
    """One request's blocks in vLLM's paged KV cache: where a connector job's
    walk writes every layer and attends it."""

    kv_caches: list[torch.Tensor]  # per layer, as vLLM registered them
    block_ids: list[int]  # the request's blocks, in order
    block_size: int

    def slots(self, end: int, device: torch.device) -> torch.Tensor:
        """The cache slots of positions ``0..end``."""
        positions = torch.arange(end, device=device)
        blocks = torch.tensor(self.block_ids, device=device, dtype=torch.long)
        return blocks[positions // self.block_size] * self.block_size + positions % self.block_size


class VLLMTensorParallel:
    """``TensorParallel`` over vLLM's tensor-parallel group (its own
    communicator, as the model's layers use it).

    vLLM gives rank r the KV heads ``r * n / size`` up to the next rank's when
    the model has n >= size KV heads; with fewer, each head is copied to
    ``size / n`` neighbouring ranks, so rank r holds head ``r // (size / n)``.
    """

    def __init__(self, local_kv_heads: int, total_kv_heads: int) -> None:
        from vllm.distributed.parallel_state import get_tp_group

        self.group = get_tp_group()
        self.size, rank = self.group.world_size, self.group.rank_in_group
        self.total_kv_heads = total_kv_heads
        self.replicas = max(1, self.size // total_kv_heads)  # ranks holding each KV head
        first = rank // self.replicas * local_kv_heads
        self.kv_heads = slice(first, first + local_kv_heads)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(x)

    def gather_kv_heads(self, x: torch.Tensor) -> torch.Tensor:
        every = self.group.all_gather(x.contiguous(), dim=2)
        return every[:, :, :: self.replicas] if self.replicas > 1 else every


class VLLMDecoder:
    """Adapts a vLLM ``*ForCausalLM`` of a supported family to ``LayerModel``."""

    def __init__(self, model, vllm_config=None) -> None:
        config = model.config
        self.vllm_config = vllm_config  # for the attention metadata builder; None: attention with SDPA only
        check_supported(config, engine="vllm")
        self.inner = model.model
        self.layers = list(self.inner.layers)
        from vllm.distributed.parallel_state import get_pp_group

        if get_pp_group().world_size > 1:
            raise NotImplementedError(
                "blending with pipeline parallelism is not supported: the blend pass walks every layer in one "
                "worker; use tensor parallelism (tensor_parallel_size) instead"
            )
        attn = self.layers[0].self_attn
        # Under tensor parallelism the modules hold this rank's heads only.
        tp = VLLMTensorParallel(attn.num_kv_heads, config.num_key_value_heads or config.num_attention_heads)
        self.tp: TensorParallel | None = tp if tp.size > 1 else None
        if not all(block.self_attn.rotary_emb.is_neox_style for block in self.layers):
            raise NotImplementedError(
                "blending needs neox-style (rotate-half) RoPE, the layout of the supported families"
            )
        self.num_layers = len(self.layers)
        self.num_heads = attn.num_heads
        self.num_kv_heads = attn.num_kv_heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.windows = layer_windows(config)
        self.softcaps = (getattr(config, "attn_logit_softcapping", None),) * self.num_layers  # Gemma 2: every layer
        self.has_qk_norm = hasattr(attn, "q_norm")
        self.post_norms = hasattr(self.layers[0], "post_feedforward_layernorm")
        self.embedding_multiplier = getattr(
            config, "embedding_multiplier", None
        )  # Granite; Gemma's is in embed_input_ids
        self._split = [attn.q_size, attn.kv_size, attn.kv_size]
        weight = self.inner.embed_tokens.weight
        self.dtype = weight.dtype
        self.device = weight.device
        self.attn_modules = [block.self_attn.attn for block in self.layers]
        self._builder = None  # the backend's metadata builder for the full-attention layers, made at first use

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.inner.embed_input_ids(ids)
        return h if self.embedding_multiplier is None else h * self.embedding_multiplier

    def rotary(self, positions: torch.Tensor) -> FusedRotary:
        return FusedRotary([block.self_attn.rotary_emb for block in self.layers], positions)

    def qkv(self, layer: int, hidden: torch.Tensor):
        block = self.layers[layer]
        attn = block.self_attn
        qkv, _ = attn.qkv_proj(block.input_layernorm(hidden))
        T = qkv.shape[0]
        q, k, v = (t.reshape(T, -1, self.head_dim) for t in qkv.split(self._split, dim=-1))
        return heads_first(attn, q, k, v, qk_norm=self.has_qk_norm)

    def finish(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        block = self.layers[layer]
        T = attn_out.shape[1]
        out, _ = block.self_attn.o_proj(attn_out.transpose(0, 1).reshape(T, -1))
        return post_norm_finish(block, hidden, out, self.post_norms)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # vLLM samples from its own forward; the blend pass never needs logits.
        raise NotImplementedError("logits are computed by vLLM itself")

    def attention_layer_names(self) -> list[str]:
        return [module.layer_name for module in self.attn_modules]

    def attention(self, positions: torch.Tensor, start: int, end: int, target: object | None) -> Attention:
        dense = DenseAttention(
            positions, start, end, windows=self.windows, scaling=self.scaling, dtype=self.dtype, softcaps=self.softcaps
        )
        if target is None:
            return dense
        assert isinstance(target, PagedCache), "a connector job's walk writes into a PagedCache"
        return PagedAttention(self, target, positions, start, end, dense)

    def metadata_builder(self):
        """vLLM's attention metadata builder for the layers without a sliding
        window, as the model runner makes it; None where the backend's kernel
        is not driven here (``KERNEL_BACKENDS``)."""
        if self._builder is None and self.vllm_config is not None:
            full = [m for m, w in zip(self.attn_modules, self.windows) if w is None]
            backend = full[0].attn_backend if full else None
            if backend is not None and backend.get_name() in KERNEL_BACKENDS:
                spec = full[0].get_kv_cache_spec(self.vllm_config)
                names = [m.layer_name for m in full]
                self._builder = backend.get_builder_cls()(spec, names, self.vllm_config, self.device)
        return self._builder


class FusedRotary:
    """RoPE with each layer's vLLM rotary module (its fused kernel, in
    place), which takes token-major rows ``[n, heads * D]``: the walk's
    heads-first tensors are views of such rows (the projections' output) or,
    for the reused keys of the dense cache, one row block per head."""

    def __init__(self, ropes: list, positions: torch.Tensor) -> None:
        self.ropes, self.positions = ropes, positions
        self._rows: torch.Tensor | None = None
        self._at = positions

    def _apply(self, rope, positions: torch.Tensor, rows: torch.Tensor) -> None:
        out, _ = rope(positions, rows)
        if out.data_ptr() != rows.data_ptr():  # an out-of-place implementation
            rows.copy_(out)

    def __call__(self, layer: int, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        if rows is not self._rows:  # the walk passes one rows tensor per active set
            self._rows, self._at = rows, (self.positions if rows is None else self.positions[rows])
        rope = self.ropes[layer]
        heads, n, d = x.shape
        tokens = x.transpose(0, 1)
        if tokens.stride(1) == d and tokens.stride(2) == 1:  # token-major memory: every head at once
            self._apply(rope, self._at, tokens.view(n, heads * d))
        elif x.stride(1) == d and x.stride(2) == 1:  # heads-first memory: a call per head
            for head in x:
                self._apply(rope, self._at, head)
        else:
            return self(layer, x.contiguous(), rows)
        return x


class PagedAttention:
    """The walk's attention in a connector job. Each layer's complete KV (the
    new tokens' rows) is written into the request's blocks with the backend's
    ``do_kv_cache_update``, as vLLM writes it. Then the active queries attend
    those blocks with the backend's kernel: each run of consecutive positions
    is one sequence of the kernel's batch, whose bottom-right causal mask is
    then exact by absolute position. Layers with a sliding window, and
    backends not in ``KERNEL_BACKENDS``, attend with ``dense`` instead."""

    def __init__(self, decoder: VLLMDecoder, target: PagedCache, positions, start, end, dense) -> None:
        self.decoder, self.target, self.start, self.end, self.dense = decoder, target, start, end, dense
        self.slots = target.slots(end, decoder.device)
        builder = decoder.metadata_builder()
        self.metadata = None if builder is None else builder.build(0, self._runs(positions))

    def _runs(self, positions: torch.Tensor):
        from vllm.v1.attention.backend import CommonAttentionMetadata

        pos = positions.to(device="cpu", dtype=torch.int32)
        breaks = torch.nonzero(pos[1:] != pos[:-1] + 1).flatten() + 1
        ends = torch.cat([breaks, torch.tensor([pos.numel()])]).to(torch.int32)
        starts = torch.cat([torch.zeros(1, dtype=torch.int32), ends])
        seq_lens = pos[ends.long() - 1] + 1
        device = self.decoder.device
        blocks = torch.tensor(self.target.block_ids, dtype=torch.int32, device=device)
        return CommonAttentionMetadata(
            query_start_loc=starts.to(device),
            query_start_loc_cpu=starts,
            seq_lens=seq_lens.to(device),
            num_reqs=ends.numel(),
            num_actual_tokens=pos.numel(),
            max_query_len=int((ends - starts[:-1]).max()),
            max_seq_len=int(seq_lens.max()),
            block_table_tensor=blocks.expand(ends.numel(), -1).contiguous(),
            slot_mapping=self.slots[positions.long()].to(torch.int64),
            causal=True,
        )

    def __call__(self, layer: int, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
        module = self.decoder.attn_modules[layer]
        cache = self.target.kv_caches[layer]
        rows = slice(self.start, self.end)
        with record_function("walk.paged_write"):
            key = K[:, rows].transpose(0, 1).contiguous()  # [n, kv_heads, head_dim], as vLLM writes it
            value = V[:, rows].transpose(0, 1).contiguous()
            module.impl.do_kv_cache_update(module, key, value, cache, self.slots[rows])
        if self.metadata is None or self.decoder.windows[layer] is not None:
            return self.dense(layer, q, K, V)
        query = q.transpose(0, 1).contiguous()  # [A, heads, head_dim]
        out = torch.empty_like(query)
        module.impl.forward(module, query, None, None, cache, self.metadata, out)
        return out.transpose(0, 1)
