"""A real LlamaIndex query engine with blending, nothing from the network.

Documents (SimpleDirectoryReader) -> IngestionPipeline (sentence splitter, local
embedding model all-MiniLM-L6-v2, BlendCacheWarmer) -> VectorStoreIndex -> the
blend query engine. Prints the answer, time to first token and cache
statistics for full prefill against blend. The options, the default model and
the data are in shared.py.
"""

from __future__ import annotations

from llama_index.core import SimpleDirectoryReader, VectorStoreIndex
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.node_parser import SentenceSplitter
from local_embeddings import LlamaIndexMiniLM  # siblings: this folder is on sys.path
from shared import DATA, compare, default_model, parse_args, starting

from blend_integrations.llama_index import BlendCacheWarmer, BlendLLM, as_blend_query_engine


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])

    with starting(args.backend):
        llm = BlendLLM(
            args.model or default_model(),
            backend=args.backend,
            store_path=args.store,
            max_tokens=args.max_tokens,
            recompute_ratio=args.recompute_ratio,
        )
    embed_model = LlamaIndexMiniLM()
    # Ingestion: split, embed, compute every node's chunk KV once, and calibrate the model on
    # these nodes if the store has no calibration of it yet.
    warmer = BlendCacheWarmer(llm, calibrate=True)
    pipeline = IngestionPipeline(
        transformations=[SentenceSplitter(chunk_size=1024, chunk_overlap=0), embed_model, warmer]
    )
    nodes = pipeline.run(documents=SimpleDirectoryReader(str(DATA)).load_data(), show_progress=True)
    index = VectorStoreIndex(nodes, embed_model=embed_model)

    full = BlendLLM(engine=llm.engine, max_tokens=args.max_tokens, mode="full")
    compare(
        as_blend_query_engine(index, full, similarity_top_k=4).query,
        as_blend_query_engine(index, llm, similarity_top_k=4).query,
        retrieved=lambda r: [n.node.metadata["file_name"] for n in r.source_nodes],
        answer=lambda r: r.response,
        stats=lambda r: r.metadata["blend"],
        calibration=llm.engine.calibration(),
    )


if __name__ == "__main__":
    main()
