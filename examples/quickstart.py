"""The engine API in one page: warm chunks, blend them in any order, compare with full prefill.

    python examples/quickstart.py [--model PATH_OR_HUB_ID] [--store DIR]

Without --model it runs SmolLM2-135M-Instruct, taken from the package index and
converted once (blend_integrations.models.smollm2), on five of the documents in
examples/data.
"""

import argparse
import tempfile

from shared import DATA, default_model  # a sibling: this folder is on sys.path

from blend_integrations import BlendConfig, ChunkStore, load_engine, rag_prompt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--store", help="chunk store directory (default: a temporary one)")
    args = parser.parse_args()

    store = ChunkStore(args.store or tempfile.mkdtemp(prefix="blend-store-"))
    engine = load_engine(args.model or default_model(), store=store, config=BlendConfig())

    names = ["ada_okafor", "irene_tamm", "milan_yilmaz", "karl_dahl", "kestrel_glassworks"]
    documents = [(DATA / f"{name}.txt").read_text() for name in names]
    question, expected = "In which city was Ada Okafor born?", "Brimford"
    print("computed at warm-up:", engine.warm(documents), "chunks")

    # the documents in another order than at warm-up: their KV is moved, and a few tokens recomputed
    prompt = rag_prompt(documents[::-1], question, engine.tokenizer, engine.config.separator)
    full = engine.generate(prompt, max_tokens=24, mode="full")
    blend = engine.generate(prompt, max_tokens=24)
    exact = engine.generate(prompt, max_tokens=24, recompute_ratio=1.0)
    print(f"question: {question} (expected: {expected})")
    print("blend:", repr(blend.text), blend.usage)
    # recompute_ratio="auto": your calibration in the store, else the one the package ships for this model
    why = {"calibrated": "your calibration in the store", "packaged": "the calibration shipped for this model"}
    print(f"ratio used: {blend.usage.recompute_ratio} ({why.get(blend.usage.ratio_source, blend.usage.ratio_source)})")
    meaning = engine.calibration_meaning()
    if meaning:
        print("what it means:", meaning)
    print("full: ", repr(full.text))
    print("ratio 1.0 reproduces full prefill:", exact.token_ids == full.token_ids)
    print(f"TTFT full {full.ttft_s * 1000:.1f} ms, blend {blend.ttft_s * 1000:.1f} ms")

    print("streamed:", "".join(engine.stream(prompt, max_tokens=8)))


if __name__ == "__main__":
    main()
