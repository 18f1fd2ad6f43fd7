"""Models layer: ``LayerModel`` over Hugging Face decoder modules.

Every supported family is a pre-norm (or post-norm) decoder with rotate-half
RoPE, and the adapter calls the model's own modules, so weights, norms,
activations and rope scaling are exactly the model's. What differs between
families is read from the modules and the config, not written per family:

- q/k/v as three projections or one fused ``qkv_proj`` (Phi-3);
- q/k norms per head (Qwen3, Gemma 3) or over all heads (OLMo 2);
- where the norms sit: Llama's two pre-norms; Gemma's four (the attention
  and MLP outputs normed too); OLMo 2's post-norms only;
- a rope per layer type (Gemma 3: local and global bases), partial rotary
  (Phi-4-mini), sliding windows per layer (Gemma 2/3, Mistral);
- scalars: embedding (Granite; Gemma's is in its embedding module), residual
  (Granite), attention scale (the module's ``scaling``: Gemma's query
  pre-attention scalar, Granite's attention multiplier), attention-logit and
  final-logit soft-capping (Gemma 2), logit scaling (Granite).
"""

from __future__ import annotations

import inspect

import torch

from ..fusion.attention import DenseAttention
from ..fusion.layers import TableRotary, TensorParallel

# model types with an adapter, on both engines
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "olmo2", "granite")


class UnsupportedModelError(ValueError):
    """The model's architecture has no blend adapter."""


# config attributes of designs the walk does not implement, and what they are
UNSUPPORTED_DESIGNS = {
    "num_local_experts": "mixture-of-experts",
    "num_experts": "mixture-of-experts",
    "n_routed_experts": "mixture-of-experts",
    "kv_lora_rank": "multi-head latent attention (MLA)",
}


def check_supported(config) -> None:
    """Refuse, naming it, a model no adapter handles."""
    model_type = getattr(config, "model_type", None)
    archs = ", ".join(getattr(config, "architectures", None) or [str(model_type)])
    if model_type not in SUPPORTED_MODEL_TYPES:
        designs = sorted({d for attr, d in UNSUPPORTED_DESIGNS.items() if getattr(config, attr, None)})
        why = f" (blending does not support {' or '.join(designs)})" if designs else ""
        raise UnsupportedModelError(
            f"model architecture {archs} (model_type {model_type!r}) is not supported{why}; "
            f"blend_integrations has adapters for model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def heads_first(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, qk_norm: bool):
    """``[T, heads, D]`` projections as the walk takes them, ``[heads, T, D]``,
    after per-head q/k norms (Qwen3, Gemma 3) where the model has them; q may
    be None (not asked for)."""
    if qk_norm:
        q, k = (None if q is None else attn.q_norm(q)), attn.k_norm(k)
    return (None if q is None else q.transpose(0, 1)), k.transpose(0, 1), v.transpose(0, 1)


def layer_windows(config) -> tuple[int | None, ...]:
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        return tuple(window if t == "sliding_attention" else None for t in types)
    return (window,) * n


def table_rotary(rope, config, positions: torch.Tensor, dtype: torch.dtype, num_layers: int) -> TableRotary:
    """RoPE from a Hugging Face model's rotary module (one for the model): its
    cos, sin tables at ``positions``, with a rope per layer type (Gemma 3)."""
    probe = torch.empty(0, dtype=dtype, device=positions.device)
    types = getattr(config, "layer_types", None)
    if types and "layer_type" in inspect.signature(rope.forward).parameters:
        tables = {t: rope(probe, positions[None, :], layer_type=t) for t in set(types)}
        return TableRotary([(tables[t][0][0], tables[t][1][0]) for t in types])
    cos, sin = rope(probe, positions[None, :])
    return TableRotary([(cos[0], sin[0])] * num_layers)


def qk_norm_kind(attn, head_dim: int) -> str | None:
    """How the attention norms q and k: per head ("head": Qwen3, Gemma 3),
    over the whole projection ("all": OLMo 2), or not at all (None)."""
    norm = getattr(attn, "q_norm", None)
    return None if norm is None else ("head" if norm.weight.shape[-1] == head_dim else "all")


def post_norm_finish(block, hidden: torch.Tensor, out: torch.Tensor, post_norms: bool) -> torch.Tensor:
    """The rest of a decoder layer after the attention's output projection
    ``out``, with the block's own norms and MLP, in either engine's modules:
    Llama's pre-norm MLP, or Gemma's and OLMo 2's normed outputs (``post_norms``),
    and Granite's residual multiplier."""
    scale = getattr(block, "residual_multiplier", None)
    if post_norms:
        out = block.post_attention_layernorm(out)
        hidden = hidden + (out if scale is None else out * scale)
        pre = getattr(block, "pre_feedforward_layernorm", None)  # Gemma; OLMo 2 has none
        out = block.post_feedforward_layernorm(block.mlp(hidden if pre is None else pre(hidden)))
    else:
        hidden = hidden + (out if scale is None else out * scale)
        out = block.mlp(block.post_attention_layernorm(hidden))
    return hidden + (out if scale is None else out * scale)


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
        self.softcaps = tuple(getattr(b.self_attn, "attn_logit_softcapping", None) for b in self.layers)
        self.windows = layer_windows(config)
        self.tp: TensorParallel | None = None  # one process computes every head
        self.qk_norm = qk_norm_kind(attn, self.head_dim)
        self._split = [self.num_heads * self.head_dim, *[self.num_kv_heads * self.head_dim] * 2]
        block = self.layers[0]
        # Gemma norms the attention output, OLMo 2 has only post-norms; Llama's
        # post_attention_layernorm is the MLP's pre-norm.
        self.post_norms = hasattr(block, "post_feedforward_layernorm")
        self.embedding_multiplier = getattr(config, "embedding_multiplier", None)  # Granite
        self.logits_scaling = getattr(config, "logits_scaling", None)  # Granite
        self.final_softcap = getattr(config, "final_logit_softcapping", None)  # Gemma 2
        self.dtype = self.lm_head.weight.dtype
        self.device = self.lm_head.weight.device

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.inner.embed_tokens(ids)
        return h if self.embedding_multiplier is None else h * self.embedding_multiplier

    def rotary(self, positions: torch.Tensor) -> TableRotary:
        return table_rotary(self.inner.rotary_emb, self.config, positions, self.dtype, self.num_layers)

    def qkv(self, layer: int, hidden: torch.Tensor, queries: bool = True):
        block = self.layers[layer]
        attn = block.self_attn
        x = block.input_layernorm(hidden) if hasattr(block, "input_layernorm") else hidden
        if hasattr(attn, "qkv_proj"):  # Phi-3
            q, k, v = attn.qkv_proj(x).split(self._split, dim=-1)
        else:
            q = attn.q_proj(x) if queries else None
            k, v = attn.k_proj(x), attn.v_proj(x)
        if self.qk_norm == "all":
            q, k = (None if q is None else attn.q_norm(q)), attn.k_norm(k)
        T = x.shape[0]
        q, k, v = (None if t is None else t.view(T, -1, self.head_dim) for t in (q, k, v))
        return heads_first(attn, q, k, v, qk_norm=self.qk_norm == "head")

    def finish(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        block = self.layers[layer]
        T = attn_out.shape[1]
        out = block.self_attn.o_proj(attn_out.transpose(0, 1).reshape(T, -1))
        return post_norm_finish(block, hidden, out, self.post_norms)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.inner.norm(hidden)).float()
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def attention(self, positions: torch.Tensor, start: int, end: int, target: object | None) -> DenseAttention:
        assert target is None, "the transformers engine's walk attends its own dense cache"
        return DenseAttention(
            positions,
            start,
            end,
            windows=self.windows,
            scaling=self.scaling,
            dtype=self.dtype,
            softcaps=self.softcaps,
        )
