"""The engine API in one page: warm chunks, blend them in any order, compare with full prefill.

    python examples/quickstart.py [--model PATH_OR_HUB_ID] [--store DIR]

Without --model a small random-weight model is built locally (no hub): the
text it writes is noise, the numbers are real.
"""

import argparse
import tempfile

from blend_integrations import BlendConfig, BlendPrompt, ChunkStore, load_engine
from blend_integrations.local_models import build_model, sample_text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--store", help="chunk store directory (default: a temporary one)")
    args = parser.parse_args()
    model = args.model or build_model(tempfile.mkdtemp(prefix="blend-model-"), num_layers=4)

    store = ChunkStore(args.store or tempfile.mkdtemp(prefix="blend-store-"))
    engine = load_engine(model, store=store, config=BlendConfig(recompute_ratio=0.15))

    documents = [" ".join(sample_text(8, seed=i)) for i in range(5)]
    print("computed at warm-up:", engine.warm(documents), "chunks")

    prompt = BlendPrompt("Answer from the documents.", documents[::-1], "Question: what was built? Answer:")
    full = engine.generate(prompt, max_tokens=16, mode="full")
    blend = engine.generate(prompt, max_tokens=16)
    exact = engine.generate(prompt, max_tokens=16, recompute_ratio=1.0)
    print("blend:", repr(blend.text), blend.usage)
    print("ratio 1.0 reproduces full prefill:", exact.token_ids == full.token_ids)
    print(f"TTFT full {full.ttft_s * 1000:.1f} ms, blend {blend.ttft_s * 1000:.1f} ms")

    print("streamed:", "".join(engine.stream(prompt, max_tokens=8)))


if __name__ == "__main__":
    main()
