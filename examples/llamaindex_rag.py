"""A real LlamaIndex query engine with blending, nothing from the network.

Documents (SimpleDirectoryReader) -> IngestionPipeline (sentence splitter, local
embedding model all-MiniLM-L6-v2, BlendKVWarmup) -> VectorStoreIndex -> the
blend query engine. Prints the answer, time to first token and cache
statistics for full prefill against blend.

    python examples/llamaindex_rag.py [--model PATH_OR_HUB_ID] [--backend transformers|vllm] [--store DIR]

Without --model a 16-layer Llama-style model with random weights is built
locally: its answer text is noise, its timings are real.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from llama_index.core import SimpleDirectoryReader, VectorStoreIndex
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.node_parser import SentenceSplitter
from local_embeddings import LlamaIndexMiniLM  # sibling: this folder is on sys.path

from blend_integrations.llama_index import BlendKVWarmup, BlendLLM, as_blend_query_engine
from blend_integrations.local_models import cached_model_dir

DATA = Path(__file__).parent / "data"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="local checkpoint or hub id (Llama, Mistral, Qwen2, Qwen3 families)")
    parser.add_argument("--backend", default="transformers", choices=["transformers", "vllm"])
    parser.add_argument("--store", help="chunk store directory (default: the user cache)")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    llm = BlendLLM(args.model or str(cached_model_dir()), backend=args.backend, store_path=args.store,
                   max_tokens=args.max_tokens)
    embed_model = LlamaIndexMiniLM()
    # Ingestion: split, embed, and compute every node's chunk KV once.
    pipeline = IngestionPipeline(transformations=[SentenceSplitter(chunk_size=256, chunk_overlap=0), embed_model,
                                                  BlendKVWarmup(llm=llm)])
    nodes = pipeline.run(documents=SimpleDirectoryReader(str(DATA)).load_data(), show_progress=True)
    index = VectorStoreIndex(nodes, embed_model=embed_model)

    question = "Who founded Harbor Iron Works, and where was the founder born?"
    full = as_blend_query_engine(index, BlendLLM(engine=llm.engine, max_tokens=args.max_tokens, mode="full"),
                                 similarity_top_k=4).query(question)
    blend = as_blend_query_engine(index, llm, similarity_top_k=4).query(question)

    stats_full, stats = full.metadata["blend"], blend.metadata["blend"]
    print(f"question: {question}")
    print(f"retrieved: {[n.node.metadata['file_name'] for n in blend.source_nodes]}")
    print(f"answer (blend): {blend.response.strip()!r}")
    print(f"answer (full):  {full.response.strip()!r}")
    print(f"prompt tokens {stats['prompt_tokens']}, read from the chunk cache {stats['cached_tokens']} "
          f"({stats['chunks_hit']}/{stats['chunks_hit'] + stats['chunks_missed']} chunks), "
          f"recomputed {stats['recomputed_tokens']}")
    print(f"time to first token: full {1000 * stats_full['ttft_s']:.0f} ms, blend {1000 * stats['ttft_s']:.0f} ms "
          f"({stats_full['ttft_s'] / stats['ttft_s']:.2f}x sooner)")
    if args.model is None:
        print("(the default model has random weights: its answer text is noise; its timings are real)")


if __name__ == "__main__":
    main()
