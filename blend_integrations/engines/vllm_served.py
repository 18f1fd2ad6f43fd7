"""Engines layer: the model vLLM serves, as the connector's two sides and the
server's calibration route know it: its name, fingerprint, BOS, dtype and
layers, the blend settings and the store arguments from vLLM's config."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..calibration import Calibrations
from ..config import BlendConfig
from ..models.loading import resolve_model_dir
from ..prompt import bos_id_added
from ..store import ChunkStore, model_fingerprint
from .vllm_contract import check_walk_attention, connector_store_args
from .vllm_memory import MEMORY_LIMIT_KEY, check_memory_limit


@functools.lru_cache(maxsize=4)
def served_tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


@functools.lru_cache(maxsize=4)
def _model_identity(model: str, tokenizer: str) -> tuple[str, int | None]:
    """(checkpoint fingerprint, BOS id the tokenizer adds) for a served model."""
    return model_fingerprint(resolve_model_dir(model)), bos_id_added(served_tokenizer(tokenizer))


@dataclass(frozen=True)
class ServedModel:
    """What the connector's two sides, and the server's calibration route
    (``serve.CalibrationRoute``), know of the model vLLM serves: one source,
    so a record the route stores is the one the scheduler reads."""

    name: str
    fingerprint: str
    bos: int | None  # the BOS id the tokenizer adds
    dtype: torch.dtype
    num_layers: int
    config: BlendConfig
    store_args: dict  # ``ChunkStore`` arguments
    walk_attention: str  # how the blend pass attends on a kernel backend (``vllm_contract.WALK_ATTENTION``)
    memory_limit_bytes: int | None = None  # the most a blend pass may allocate beyond vLLM's (``vllm_memory``)

    @classmethod
    def of(cls, vllm_config) -> ServedModel:
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        model_config = vllm_config.model_config
        fingerprint, bos = _model_identity(model_config.model, model_config.tokenizer)
        return cls(
            model_config.model,
            fingerprint,
            bos,
            model_config.dtype,
            int(model_config.hf_text_config.num_hidden_layers),
            BlendConfig(**extra.get("blend_config", {})),
            connector_store_args(extra),
            check_walk_attention(extra.get("walk_attention", "auto")),
            check_memory_limit(extra.get(MEMORY_LIMIT_KEY)),
        )

    def calibrations(self, store: ChunkStore) -> Calibrations:
        return Calibrations(
            store, self.fingerprint, self.dtype, engine="vllm", num_layers=self.num_layers, label=self.name
        )
