"""Store layer: KV codecs, how a store keeps a chunk's KV in fewer bytes.

A store's ``kv_codec`` (``ChunkStore(kv_codec=...)``) is one of:

- ``None``: raw, the KV dtype's own bytes (4 a value in float32, 2 in bfloat16);
- ``"fp8"``: float8 e4m3 codes (1 byte a value), with keys scaled per
  channel (one scale per layer, head and channel over the chunk's tokens)
  and values per head (one per layer and head). On the bundled reader, one
  scale per head for keys too cost 1.3 points of blend@0.15 agreement with
  full prefill (0.947 against the raw store's 0.960), keys per channel 0.3
  (0.957): the keys' error is what moves attention;
- ``"int8"``: int8 codes, symmetric, with keys scaled per channel (one scale
  per layer, head and channel over the chunk's tokens: pre-RoPE keys have a
  few channels far larger than the rest) and values per token (one scale per
  layer, head and token), as KIVI groups them.

A coded payload is laid out layer after layer, every layer the same number
of bytes, so that a reader can read and decode one layer at a time while the
walk computes (``layered.LayerReader``)::

    scales   float32   K [heads, head_dim], then V: fp8 [heads]; int8 [heads, tokens]
    codes    1 byte    [2, heads, tokens, head_dim]: K, then V
    padding            to a multiple of 4 bytes, so the next layer's scales are aligned

Encoding and decoding are torch operations over every layer at once (or
over one layer): no Python loop over layers or tokens, and the same code
runs on a GPU tensor. A coded entry stays coded in every tier, memory
included (``CodedKV``): the walk decodes each layer where it computes, on
the GPU for a GPU engine, so only the codes cross the bus and the host's
cores never decode. A scale that is not a finite, non-negative number can
only come from damage or a foreign writer: ``check_scales`` finds it when
the entry is read, and the store recomputes the chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import KV_CODECS, check_kv_codec
from .errors import CorruptEntryError

__all__ = ["KV_CODECS", "CodedKV", "check_kv_codec", "check_scales", "decode_kv", "encode_kv", "layer_bytes"]
_FP8_MAX = 448.0  # the largest finite float8_e4m3fn
_INT8_MAX = 127.0


def _scale_count(codec: str, heads: int, tokens: int, head_dim: int) -> int:
    """float32 scales in one layer's record."""
    return heads * (head_dim + (1 if codec == "fp8" else tokens))


def layer_bytes(codec: str, heads: int, tokens: int, head_dim: int) -> int:
    """Bytes of one layer of a ``codec`` payload (layout in the module docstring)."""
    n = 4 * _scale_count(codec, heads, tokens, head_dim) + 2 * heads * tokens * head_dim
    return n + (-n % 4)


def encode_kv(kv: torch.Tensor, codec: str) -> torch.Tensor:
    """The payload of ``kv`` (``[layers, 2, heads, tokens, head_dim]``, any
    float dtype) in ``codec``: uint8, ``[layers, layer_bytes]``, on ``kv``'s device."""
    layers, _, heads, tokens, head_dim = kv.shape
    x = kv.to(torch.float32)
    k_scales = _amax(x[:, 0], (2,))  # [L, H, D]: per channel
    if codec == "fp8":
        v_scales, top = _amax(x[:, 1], (2, 3)), _FP8_MAX  # [L, H]: per head
    else:  # int8 (the store checks a codec's name before it gets here)
        v_scales, top = _amax(x[:, 1], (3,)), _INT8_MAX  # [L, H, T]: per token
    k_scales, v_scales = k_scales / top, v_scales / top
    k = x[:, 0] / torch.where(k_scales > 0, k_scales, 1.0)[:, :, None, :]
    v_divisor = torch.where(v_scales > 0, v_scales, 1.0)
    v = x[:, 1] / (v_divisor[..., None, None] if codec == "fp8" else v_divisor[..., None])
    codes = torch.stack((k, v), dim=1)
    if codec == "fp8":
        codes = codes.clamp_(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        codes = codes.round_().clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8).view(torch.uint8)
    scales = torch.cat((k_scales.reshape(layers, -1), v_scales.reshape(layers, -1)), dim=1)
    out = torch.zeros((layers, layer_bytes(codec, heads, tokens, head_dim)), dtype=torch.uint8, device=kv.device)
    scale_bytes = scales.reshape(layers, -1).contiguous().view(torch.uint8)
    out[:, : scale_bytes.shape[1]] = scale_bytes
    out[:, scale_bytes.shape[1] : scale_bytes.shape[1] + codes[0].numel()] = codes.reshape(layers, -1)
    return out


def check_scales(payload: torch.Tensor, codec: str, heads: int, tokens: int, head_dim: int) -> None:
    """Raise CorruptEntryError unless every scale in ``payload`` (uint8
    ``[layers, layer_bytes]``, one layer or many) is finite and non-negative."""
    n_scales = _scale_count(codec, heads, tokens, head_dim)
    scales = payload[:, : 4 * n_scales].contiguous().view(torch.float32)
    bad = ~torch.isfinite(scales) | (scales < 0)
    if bool(bad.any()):
        raise CorruptEntryError(f"damaged {codec} scales: {int(bad.sum())} are negative or not finite")


def decode_kv(
    payload: torch.Tensor, codec: str, heads: int, tokens: int, head_dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """``[layers, 2, heads, tokens, head_dim]`` of ``dtype`` from ``payload``
    (uint8 ``[layers, layer_bytes]``, one layer or many, on any device, its
    scales checked by ``check_scales``), on ``payload``'s device."""
    layers = payload.shape[0]
    n_scales = _scale_count(codec, heads, tokens, head_dim)
    scales = payload[:, : 4 * n_scales].contiguous().view(torch.float32)  # [L, n_scales]
    codes = payload[:, 4 * n_scales : 4 * n_scales + 2 * heads * tokens * head_dim]
    codes = codes.reshape(layers, 2, heads, tokens, head_dim)
    x = codes.view(torch.float8_e4m3fn if codec == "fp8" else torch.int8).to(torch.float32)
    x[:, 0] *= scales[:, : heads * head_dim].view(layers, heads, 1, head_dim)
    x[:, 1] *= scales[:, heads * head_dim :].view(layers, heads, 1 if codec == "fp8" else tokens, 1)
    return x.to(dtype)


# eq=False, as ChunkKV: identity, not an elementwise comparison of tensors.
@dataclass(frozen=True, eq=False)
class CodedKV:
    """A chunk's KV as a coded store keeps it, in every tier: ``payload``,
    uint8 ``[layers, layer_bytes]`` on the CPU (the layout above), decoding to
    ``shape`` (``[layers, 2, heads, tokens, head_dim]``) of ``dtype``. It
    stands where a ``ChunkKV`` holds a tensor; ``layer`` decodes one layer
    on the device that computes with it. Its scales are checked
    (``check_scales``) before one is built from bytes read from a store."""

    payload: torch.Tensor
    codec: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if check_kv_codec(self.codec) is None:
            raise ValueError("CodedKV.codec must be one of " + ", ".join(KV_CODECS))
        object.__setattr__(self, "shape", tuple(self.shape))
        layers, _, heads, tokens, head_dim = self.shape
        expected = (layers, layer_bytes(self.codec, heads, tokens, head_dim))
        p = self.payload
        if p.dtype != torch.uint8 or tuple(p.shape) != expected or p.device.type != "cpu" or not p.is_contiguous():
            raise ValueError(
                f"CodedKV.payload must be a contiguous CPU uint8 tensor of shape {expected}, "
                f"got {p.dtype} {tuple(p.shape)} on {p.device}"
            )

    @property
    def nbytes(self) -> int:
        return self.payload.numel()

    def layer(self, layer: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Layer ``layer``'s K and V, ``[2, heads, tokens, head_dim]`` of
        ``dtype``, decoded on ``device`` (None: the CPU). From page-locked
        codes, the copy to a GPU is asynchronous (on the current stream)."""
        codes = self.payload[layer : layer + 1]
        if device is not None:
            codes = codes.to(device, non_blocking=True)
        _, _, heads, tokens, head_dim = self.shape
        return decode_kv(codes, self.codec, heads, tokens, head_dim, self.dtype)[0]

    def decode(self) -> torch.Tensor:
        """Every layer, decoded on the CPU: ``shape`` of ``dtype``."""
        _, _, heads, tokens, head_dim = self.shape
        return decode_kv(self.payload, self.codec, heads, tokens, head_dim, self.dtype)

    def pin_memory(self) -> CodedKV:
        return CodedKV(self.payload.pin_memory(), self.codec, self.shape, self.dtype)

    def is_pinned(self) -> bool:
        return self.payload.is_pinned()


def _amax(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """``|x|``'s largest value over ``dims`` (0 over an empty chunk, where amax would raise)."""
    if x.numel() == 0:
        shape = [d for i, d in enumerate(x.shape) if i not in dims]
        return torch.zeros(shape, dtype=x.dtype, device=x.device)
    return x.abs().amax(dim=dims)
