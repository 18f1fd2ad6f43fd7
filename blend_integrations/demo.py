"""The main job: a retrieval question answered with blending, TTFT against full prefill.

``python -m blend_integrations.demo [--model PATH_OR_HUB_ID]``. Without
``--model`` it builds a 16-layer Llama-style model locally (no hub); its
weights are random, so its answer text is noise, but its timings are real.
"""

from __future__ import annotations

import argparse
import re

from . import BlendPrompt, ChunkStore, load_engine
from .local_models import cached_model_dir, sample_text

FACTS = [
    "Harbor Iron Works was founded in 1871 by the engineer Mara Okafor in the river city of Lenholm.",
    "Mara Okafor was born in 1840 in the mountain village of Tessel and studied bridge design.",
    "Lenholm lies on the east bank of the Vell river; its old market sells salt, copper and tea.",
    "The Lenholm public library opened in 1902 and keeps a map collection of the Vell valley.",
    "Harbor Iron Works built the Vell river bridge in 1889 and later made ship engines.",
    "Tessel is known for its glass workshops and a quiet forest school founded in 1790.",
    "The museum of Lenholm shows paintings by local sailors and letters from the early traders.",
    "In 1931 Harbor Iron Works moved its foundry north to the island of Skarre.",
]
# Retrieved passages are a few hundred tokens in practice: each fact comes with filler text.
CORPUS = [fact + " " + " ".join(sample_text(24, seed=100 + i)) for i, fact in enumerate(FACTS)]


def retrieve(question: str, k: int) -> list[str]:
    """Word-overlap retrieval: enough to put documents in a question-dependent order."""
    words = set(re.findall(r"\w+", question.lower()))
    def score(i: int) -> int:
        return len(words & set(re.findall(r"\w+", FACTS[i].lower())))

    return [CORPUS[i] for i in sorted(range(len(FACTS)), key=lambda i: -score(i))[:k]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="local checkpoint or hub id (Llama, Mistral, Qwen2, Qwen3)")
    parser.add_argument("--store", help="chunk store directory (default: the user cache)")
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args(argv)

    model = args.model or cached_model_dir()
    engine = load_engine(model, store=ChunkStore(args.store))
    print(f"engine: {engine!r}; store: {engine.store.path}")
    # Ingestion: every document's KV computed once, standalone, and stored.
    engine.warm(CORPUS, progress=True)

    question = "Who founded Harbor Iron Works, and where was the founder born?"
    docs = retrieve(question, k=4)
    prompt = BlendPrompt(
        "You answer questions using only the documents below.",
        docs,
        f"Question: {question}\nAnswer:",
    )
    full = engine.generate(prompt, max_tokens=args.max_tokens, mode="full")
    blend = engine.generate(prompt, max_tokens=args.max_tokens, mode="blend")
    print(f"\nquestion: {question}")
    print(f"retrieved, in this order: {[d[:40] + '...' for d in docs]}")
    print(f"answer (blend): {blend.text.strip()!r}")
    print(f"answer (full):  {full.text.strip()!r}")
    print(
        f"\nprompt tokens {blend.usage.prompt_tokens}: {blend.usage.cached_tokens} reused from the store "
        f"({blend.usage.chunks_hit}/{blend.usage.chunks_hit + blend.usage.chunks_missed} chunks), "
        f"{blend.usage.recomputed_tokens} of them recomputed"
    )
    print(f"time to first token: full {1000 * full.ttft_s:.0f} ms, blend {1000 * blend.ttft_s:.0f} ms "
          f"({full.ttft_s / blend.ttft_s:.2f}x sooner)")
    if args.model is None:
        print("(the default model has random weights: its answer text is noise; its timings are real)")


if __name__ == "__main__":
    main()
