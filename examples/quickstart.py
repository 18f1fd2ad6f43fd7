"""The engine API in one page: warm chunks, blend them in any order, compare with full prefill.

    python examples/quickstart.py [--model PATH_OR_HUB_ID] [--store DIR]

Without --model it runs the bundled reader model (blend_integrations.quality),
trained in this repository to answer questions from the documents in its prompt.
The documents and the question are generated (blend_integrations.quality.data).
"""

import argparse
import random
import tempfile

from blend_integrations import BlendConfig, ChunkStore, load_engine, rag_prompt
from blend_integrations.quality import reader_model_dir
from blend_integrations.quality.data import make_example


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--store", help="chunk store directory (default: a temporary one)")
    args = parser.parse_args()

    store = ChunkStore(args.store or tempfile.mkdtemp(prefix="blend-store-"))
    engine = load_engine(args.model or str(reader_model_dir()), store=store, config=BlendConfig())

    example = make_example(random.Random(7), hops=1, n_docs=(5, 5))  # five documents, one question
    print("computed at warm-up:", engine.warm(example.documents), "chunks")

    # the documents in another order than at warm-up: their KV is moved, and a few tokens recomputed
    prompt = rag_prompt(example.documents[::-1], example.question, engine.tokenizer, engine.config.separator)
    full = engine.generate(prompt, max_tokens=16, mode="full")
    blend = engine.generate(prompt, max_tokens=16)
    exact = engine.generate(prompt, max_tokens=16, recompute_ratio=1.0)
    print(f"question: {example.question} (expected: {example.answer})")
    print("blend:", repr(blend.text), blend.usage)
    print("full: ", repr(full.text))
    print("ratio 1.0 reproduces full prefill:", exact.token_ids == full.token_ids)
    print(f"TTFT full {full.ttft_s * 1000:.1f} ms, blend {blend.ttft_s * 1000:.1f} ms")

    print("streamed:", "".join(engine.stream(prompt, max_tokens=8)))


if __name__ == "__main__":
    main()
