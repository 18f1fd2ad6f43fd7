"""Models layer: ``LayerModel`` over Hugging Face decoder modules (Llama, Mistral, Qwen2, Qwen3).

The four families share one layer shape: RMSNorm, q/k/v/o projections (Qwen2
with biases, Qwen3 with per-head q/k norms), rotate-half RoPE, gated MLP. The
adapter calls the model's own modules, so weights, norms and rope scaling are
exactly the model's.
"""

from __future__ import annotations

import torch

from ..fusion.attention import DenseAttention
from ..fusion.layers import TableRotary, TensorParallel

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedModelError(ValueError):
    """The model's architecture has no blend adapter."""


def check_supported(config) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = ", ".join(getattr(config, "architectures", None) or [str(model_type)])
        raise UnsupportedModelError(
            f"model architecture {archs} (model_type {model_type!r}) is not supported; "
            f"blend_integrations has adapters for model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def heads_first(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, qk_norm: bool):
    """``[T, heads, D]`` projections as the walk takes them, ``[heads, T, D]``,
    after Qwen3's per-head q/k norms where the model has them."""
    if qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)


def layer_windows(config) -> tuple[int | None, ...]:
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        return tuple(window if t == "sliding_attention" else None for t in types)
    return (window,) * n


class HFDecoder:
    """Adapts a ``*ForCausalLM`` of a supported family to ``LayerModel``."""

    def __init__(self, model) -> None:
        config = model.config
        check_supported(config)
        self.config = config
        self.inner = model.model
        self.lm_head = model.lm_head
        self.layers = list(self.inner.layers)
        attn = self.layers[0].self_attn
        self.num_layers = len(self.layers)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or config.num_attention_heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.windows = layer_windows(config)
        self.tp: TensorParallel | None = None  # one process computes every head
        self.has_qk_norm = hasattr(attn, "q_norm")
        self.dtype = self.lm_head.weight.dtype
        self.device = self.lm_head.weight.device

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner.embed_tokens(ids)

    def rotary(self, positions: torch.Tensor) -> TableRotary:
        probe = torch.empty(0, dtype=self.dtype, device=self.device)
        cos, sin = self.inner.rotary_emb(probe, positions[None, :])
        return TableRotary(cos[0], sin[0])

    def qkv(self, layer: int, hidden: torch.Tensor):
        block = self.layers[layer]
        attn = block.self_attn
        x = block.input_layernorm(hidden)
        T = x.shape[0]
        q = attn.q_proj(x).view(T, -1, self.head_dim)
        k = attn.k_proj(x).view(T, -1, self.head_dim)
        v = attn.v_proj(x).view(T, -1, self.head_dim)
        return heads_first(attn, q, k, v, qk_norm=self.has_qk_norm)

    def finish(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        block = self.layers[layer]
        T = attn_out.shape[1]
        hidden = hidden + block.self_attn.o_proj(attn_out.transpose(0, 1).reshape(T, -1))
        return hidden + block.mlp(block.post_attention_layernorm(hidden))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.inner.norm(hidden)).float()

    def attention(self, positions: torch.Tensor, start: int, end: int, target: object | None) -> DenseAttention:
        assert target is None, "the transformers engine's walk attends its own dense cache"
        return DenseAttention(positions, start, end, windows=self.windows, scaling=self.scaling, dtype=self.dtype)
