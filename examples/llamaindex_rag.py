"""A real LlamaIndex query engine with blending, nothing from the network.

Documents (SimpleDirectoryReader) -> IngestionPipeline (sentence splitter, local
embedding model all-MiniLM-L6-v2, BlendCacheWarmer) -> VectorStoreIndex -> the
blend query engine. Prints the answers, time to first token and cache
statistics for full prefill against blend. The options, the default model and
the data are in shared.py.
"""

from __future__ import annotations

from llama_index.core import SimpleDirectoryReader, VectorStoreIndex
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.node_parser import SentenceSplitter
from local_embeddings import LlamaIndexMiniLM  # siblings: this folder is on sys.path
from shared import blend_modes, compare, default_model, describe_ratio, parse_args, starting

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
    try:
        embed_model = LlamaIndexMiniLM()
        # Ingestion: split, embed, and compute every node's chunk KV once (and, with --calibrate,
        # calibrate the model on these nodes unless the store holds your calibration of it).
        pipeline = IngestionPipeline(
            transformations=[
                SentenceSplitter(chunk_size=1024, chunk_overlap=0),
                embed_model,
                BlendCacheWarmer(llm, calibrate=args.calibrate),
            ]
        )
        documents = SimpleDirectoryReader(str(args.documents), required_exts=[".txt"]).load_data()
        index = VectorStoreIndex(pipeline.run(documents=documents, show_progress=True), embed_model=embed_model)
        describe_ratio(llm.engine)

        def query(options: dict):
            settings = {"max_tokens": args.max_tokens, "recompute_ratio": args.recompute_ratio, **options}
            return as_blend_query_engine(index, BlendLLM(engine=llm.engine, **settings), similarity_top_k=4).query

        compare(
            blend_modes(llm.engine, args.recompute_ratio, query),
            args.question,
            retrieved=lambda r: [n.node.metadata["file_name"] for n in r.source_nodes],
            answer=lambda r: r.response,
            stats=lambda r: r.metadata["blend"],
        )
    finally:
        llm.engine.close()  # vLLM's processes end here, not in the interpreter's exit


if __name__ == "__main__":
    main()
