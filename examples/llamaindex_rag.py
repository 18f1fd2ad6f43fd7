"""A real LlamaIndex query engine with blending, nothing from the network.

Documents (SimpleDirectoryReader) -> IngestionPipeline (sentence splitter, local
embedding model all-MiniLM-L6-v2, BlendKVWarmup) -> VectorStoreIndex -> the
blend query engine. Prints the answer, time to first token and cache
statistics for full prefill against blend.

    python examples/llamaindex_rag.py [--model PATH_OR_HUB_ID] [--backend transformers|vllm] [--store DIR]

Without --model it runs SmolLM2-135M-Instruct (Apache-2.0), taken from the
package index and converted once (blend_integrations.models.smollm2). The eight
short documents in examples/data are made up for these examples: companies,
their founders, and where each was born.
"""

from __future__ import annotations

from pathlib import Path

from llama_index.core import SimpleDirectoryReader, VectorStoreIndex
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.node_parser import SentenceSplitter
from local_embeddings import LlamaIndexMiniLM  # siblings: this folder is on sys.path
from shared import default_model, parse_args, print_comparison

from blend_integrations.llama_index import BlendKVWarmup, BlendLLM, as_blend_query_engine

DATA = Path(__file__).parent / "data"


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])

    llm = BlendLLM(args.model or default_model(), backend=args.backend, store_path=args.store,
                   max_tokens=args.max_tokens)
    embed_model = LlamaIndexMiniLM()
    # Ingestion: split, embed, and compute every node's chunk KV once.
    pipeline = IngestionPipeline(transformations=[SentenceSplitter(chunk_size=1024, chunk_overlap=0), embed_model,
                                                  BlendKVWarmup(llm=llm)])
    nodes = pipeline.run(documents=SimpleDirectoryReader(str(DATA)).load_data(), show_progress=True)
    index = VectorStoreIndex(nodes, embed_model=embed_model)

    question, expected = "In which city was Ada Okafor born?", "Brimford"
    full_engine = as_blend_query_engine(index, BlendLLM(engine=llm.engine, max_tokens=args.max_tokens, mode="full"),
                                        similarity_top_k=4)
    blend_engine = as_blend_query_engine(index, llm, similarity_top_k=4)
    # four rounds taking turns; the first warms up, TTFT is the median of the others
    rounds = [(full_engine.query(question), blend_engine.query(question)) for _ in range(4)]
    full, blend = rounds[-1]
    print_comparison(
        question=question, expected=expected, retrieved=[n.node.metadata["file_name"] for n in blend.source_nodes],
        answer_blend=blend.response, answer_full=full.response, stats=blend.metadata["blend"],
        ttft_pairs=[(f.metadata["blend"]["ttft_s"], b.metadata["blend"]["ttft_s"]) for f, b in rounds[1:]],
    )

if __name__ == "__main__":
    main()
