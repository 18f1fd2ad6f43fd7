"""Look inside a reader model: do its heads attend where training steers them,
where does the last layer look from the answering position, and how large is
what each layer writes there.

    python -m training.diagnose MODEL_DIR [--shape short|mid|full] [--examples 8]

The shapes are the training curriculum's stages (``full`` is the benchmark's).
Works on a finished reader and on a run's output directory (it saves weights
every 100 steps).
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

import torch

from .data import Example, make_examples
from .looks import attention_rows, forward_capturing, look_targets
from .train import STAGES, encode

SHAPES = {
    name: {k: stage[k] for k in ("n_docs", "doc_tokens")}
    for name, stage in zip(("short", "mid", "full"), STAGES, strict=True)
}
HELD_OUT_SEED = 10_000  # training's held-out examples


@torch.no_grad()
def inspect_example(model, tokenizer, example: Example, top: int = 4) -> dict:
    """For one example (its first question): the attention mass each look puts
    on its sources (``looks.look_targets``), the positions the last layer
    attends to most from the answering position (with the text before them),
    and the norms of what every attention and MLP block writes at the answering
    position and at the fact's value."""
    ids, mask = encode(example, tokenizer)
    looks = {name: look for name, look in look_targets(example, tokenizer, ids, mask).items() if look.rows}
    num_layers = len(model.model.layers)
    writes: dict[str, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        hooks.append(
            layer.self_attn.register_forward_hook(lambda _m, _a, out, i=i: writes.__setitem__(f"attn{i}", out[0][0]))
        )
        hooks.append(layer.mlp.register_forward_hook(lambda _m, _a, out, i=i: writes.__setitem__(f"mlp{i}", out[0])))
    try:
        _, inputs = forward_capturing(
            model,
            torch.tensor([ids], device=model.device),
            {look.layer % num_layers for look in looks.values()} | {num_layers - 1},
        )
    finally:
        for hook in hooks:
            hook.remove()

    def rows(layer: int, queries: list[int]) -> torch.Tensor:
        seen = inputs[layer % num_layers]
        return attention_rows(
            model.model.layers[layer].self_attn, seen["hidden_states"], seen["position_embeddings"], queries
        )

    masses = {}
    for name, look in looks.items():
        attention = rows(look.layer, [query for query, _ in look.rows])
        heads = attention if look.heads is None else attention[list(look.heads)]
        masses[name] = statistics.fmean(
            float(heads[:, i, sources].sum(-1).mean()) for i, (_, sources) in enumerate(look.rows)
        )
    query, sources = looks["answer"].rows[0]  # the first question's answering position, the fact's value
    last = rows(-1, [query])[:, 0].mean(0)
    attended = [
        (float(last[p]), tokenizer.decode(ids[max(0, p - 6) : p]), tokenizer.decode([ids[p]]))
        for p in last.topk(min(top, len(ids))).indices.tolist()
    ]
    norms = {
        where: {block: round(float(out[p].norm()), 1) for block, out in writes.items()}
        for where, p in (("answering", query), ("value", sources[0]))
    }
    return {"masses": masses, "on_fact": float(last[sources].sum()), "attended": attended, "write_norms": norms}


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(prog="python -m training.diagnose", description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--shape", choices=SHAPES, default="full")
    parser.add_argument("--examples", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not (args.model / "config.json").exists():
        parser.error(f"{args.model} holds no model (config.json is missing)")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()

    masses, norms = defaultdict(list), defaultdict(list)
    for example in make_examples(args.examples, seed=HELD_OUT_SEED, **SHAPES[args.shape]):
        found = inspect_example(model, tokenizer, example)
        for name, mass in found["masses"].items():
            masses[name].append(mass)
        for where, blocks in found["write_norms"].items():
            for block, norm in blocks.items():
                norms[where, block].append(norm)
        print(f"{example.question} (expected {example.answer!r}): last layer's mass on the fact {found['on_fact']:.2f}")
        for weight, before, token in found["attended"]:
            print(f"   {weight:.2f}  ...{before!r} [{token!r}]")
    print(f"\nmean attention mass on each look's sources ({args.examples} {args.shape} examples):")
    for name, values in masses.items():
        print(f"  {name:16s} {statistics.fmean(values):.3f}")
    print("\nmedian norm of what each block writes:")
    for where in ("answering", "value"):
        blocks = sorted({block for w, block in norms if w == where}, key=lambda b: (int(b.lstrip("atnmlp")), b))
        print(
            f"  at the {where} position: " + ", ".join(f"{b} {statistics.median(norms[where, b]):.1f}" for b in blocks)
        )


if __name__ == "__main__":
    main()
