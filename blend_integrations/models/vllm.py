"""Models layer: ``LayerModel`` over vLLM's decoder modules (Llama, Mistral, Qwen2, Qwen3).

vLLM fuses q/k/v into one projection and keeps RoPE as a cos/sin cache; the
adapter splits the projection and reads cos/sin from that cache, so the walk
sees exactly the same interface as with Hugging Face modules. Runs inside a
vLLM worker process.
"""

from __future__ import annotations

import torch

from ..fusion.layers import TensorParallel
from .hf import check_supported, heads_first, layer_windows


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

    def __init__(self, model) -> None:
        config = model.config
        check_supported(config)
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
        rope = attn.rotary_emb
        if not rope.is_neox_style or rope.rotary_dim != attn.head_dim:
            raise NotImplementedError("blending needs full-width neox-style RoPE (the Llama-family layout)")
        self.num_layers = len(self.layers)
        self.num_heads = attn.num_heads
        self.num_kv_heads = attn.num_kv_heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.windows = layer_windows(config)
        self.has_qk_norm = hasattr(attn, "q_norm")
        self._split = [attn.q_size, attn.kv_size, attn.kv_size]
        weight = self.inner.embed_tokens.weight
        self.dtype = weight.dtype
        self.device = weight.device

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner.embed_tokens(ids)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rope = self.layers[0].self_attn.rotary_emb
        cos, sin = rope.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        return torch.cat((cos, cos), -1).to(self.dtype), torch.cat((sin, sin), -1).to(self.dtype)

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
        hidden = hidden + out
        return hidden + block.mlp(block.post_attention_layernorm(hidden))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # vLLM samples from its own forward; the blend pass never needs logits.
        raise NotImplementedError("logits are computed by vLLM itself")

    def attention_layer_names(self) -> list[str]:
        return [block.self_attn.attn.layer_name for block in self.layers]
