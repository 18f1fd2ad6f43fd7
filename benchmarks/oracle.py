"""How far each selection is from the deviation bound, and why the default falls short.

For each held-out prompt, full prefill runs on the reference (the transformers
engine's walk, every layer's K and V recorded), and then, per recompute ratio r:

- (a) blend: the package's blend under each selection setting, on the engine
  of ``--backend``, timed side by side with that engine's full prefill;
- (b) recompute given the oracle set: the walk blends with the oracle's token
  set handed to it at the check layer (``forward(ranking=...)``) instead of
  choosing one: the package's recompute, apart from its selection. It runs on
  the reference; vLLM's connector runs the same walk;
- (c) oracle patch: every chunk token keeps its reused KV but those of the
  oracle set, which get full prefill's K and V at every layer (one set for all
  layers), or at each layer its own set; every other token (prefix,
  separators) has full prefill's KV, and the question is computed on top;
- (d) reuse: nothing recomputed.

The oracle set at ratio r: the r share of the chunk tokens whose reused V
deviates most from full prefill's, summed over layers (each layer's squared
deviation over the mean squared norm of its values, so every layer counts
alike); the per-layer set takes each layer's own top r. It is what a perfect
deviation-based selection (CacheBlend's) with a perfect recompute gives.
Recall: the share of the oracle set (at the same ratio) that a selection
recomputed. Deviation by layer: the reused chunk tokens' relative V and K
deviation from full prefill, per layer, averaged over prompts: where the
deviation a check layer must predict sits. Agreement: the first 4 generated
tokens equal full prefill's (on (b) and (c) the reference's full prefill).

    python -m benchmarks oracle --model qwen2.5-coder-1.5b --backend vllm [--questions 12]
        [--ratios 0.05 0.1 0.15 0.3] [--settings deviation query ...] [--dtype auto]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from blend_integrations.config import BlendConfig
from blend_integrations.engines import load_engine
from blend_integrations.fusion.walk import KVCache, ReusedSpan, forward
from blend_integrations.store import ChunkStore

from . import machine, scratch_dir, write_results
from .oracle_report import PREDICTION, RENAMED, markdown
from .quality import BASE, DEVELOPMENT_SEED, model_and_task, results_name

AGREE_TOKENS = 4  # agreement: the first tokens equal full prefill's, as calibration counts it
RATIOS = (0.05, 0.1, 0.15, 0.3)


def gradual_layers(num_layers: int) -> list[int]:
    """Six check layers from layer 1 to about 70% of the depth (1, 4, 8, 12,
    16, 20 on 28 layers): gradual filtering as CacheBlend describes it."""
    return sorted({1, *(round(num_layers * i / 7) for i in range(1, 6))})


def selection_settings(num_layers: int) -> dict[str, dict]:
    """The selection settings measured, each one change from the plain
    algorithm (``quality.BASE``: value deviation at check layer 1)."""
    return {
        "deviation": {},
        "k-deviation": {"deviation": "k"},
        "query": {"selection": "query"},
        "mixed": {"selection": "mixed"},
        "gradual": {"check_layers": gradual_layers(num_layers)},
        # EPIC's LegoLink: every chunk's first tokens recomputed, besides the selection
        "sink4": {"sink_tokens": 4},
        # query selection at check layer 0, as calibration tries it (ProphetKV's idea): the query's
        # attention over every layer of a reuse pass picks the tokens, which are then recomputed at
        # every layer; no layer is computed for every token (check layer 0 projects every token's K
        # and V, which no context changes there, and attends for the kept)
        "query-layer0": {"selection": "query", "check_layers": [0]},
        # the same pass, scored by what the query's last tokens read (attention times the value's norm)
        "query-tail": {"selection": "query-tail", "check_layers": [0]},
    }


@dataclass
class Reference:
    """One prompt's full prefill on the reference walk: every layer's K (before
    RoPE) and V, and its greedy tokens; the reused KV of its chunk tokens."""

    record: torch.Tensor  # [layers, 2, kv_heads, T, head_dim]
    reused: torch.Tensor  # the same shape; the chunk tokens' stored KV, zeros elsewhere
    chunk_rows: torch.Tensor  # [T] bool: the tokens of a chunk
    tokens: list[int]


def greedy(model, cache: KVCache, logits: torch.Tensor, n: int, eos: set[int]) -> list[int]:
    """``n`` greedy tokens after ``logits``, decoding on ``cache`` (stops at an end token)."""
    out: list[int] = []
    while True:
        token = int(logits.argmax())
        out.append(token)
        if token in eos or len(out) >= n:
            return out
        logits, _ = forward(model, cache, torch.tensor([token], device=model.device))


class Oracle:
    """The reference's walk, run by hand: full prefill recorded, the oracle
    patch, and the recompute given a token set."""

    def __init__(self, engine, tokens: int) -> None:
        self.engine, self.model, self.tokens = engine, engine.layers, tokens
        eos = engine.hf_model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos]) | {engine.tokenizer.eos_token_id}

    def _cache(self, n: int) -> KVCache:
        return KVCache.allocate(self.model, n + self.tokens)

    def reference(self, tp) -> Reference:
        m, T = self.model, len(tp)
        ids = torch.tensor(tp.token_ids, device=m.device)
        record = torch.empty((m.num_layers, 2, m.num_kv_heads, T, m.head_dim), dtype=m.dtype, device=m.device)
        cache = self._cache(T)
        logits, _ = forward(m, cache, ids, record=record)
        tokens = greedy(m, cache, logits, self.tokens, self.eos)
        reused = torch.zeros_like(record)
        rows = torch.zeros(T, dtype=torch.bool)
        blender = self.engine.blender
        for a, b in tp.chunk_spans:
            chunk = tp.token_ids[a:b]
            entry = blender.store.get(blender.keys(chunk), expect=blender._expect(b - a))
            if entry is None:
                raise RuntimeError("a chunk of the prompt is not in the store: warm the documents first")
            reused[:, :, :, a:b] = entry.values().to(m.device)
            rows[a:b] = True
        return Reference(record, reused, rows, tokens)

    def patched(self, tp, ref: Reference, keep: torch.Tensor) -> list[int]:
        """(c): the chunk tokens keep their reused KV but where ``keep``
        (``[layers, T]`` bool) says full prefill's; then the question."""
        m, T = self.model, len(tp)
        cache = self._cache(T)
        rotary = m.rotary(torch.arange(T, device=m.device))
        for layer in range(m.num_layers):
            kv = ref.record[layer].clone()
            use = (ref.chunk_rows & ~keep[layer]).to(m.device)
            kv[:, :, use] = ref.reused[layer][:, :, use]
            cache.k[layer][:, :T] = rotary(layer, kv[0])
            cache.v[layer][:, :T] = kv[1]
        start = tp.chunk_spans[-1][1]  # the question on, computed on the patched cache
        cache.length = start
        ids = torch.tensor(tp.token_ids[start:], device=m.device)
        logits, _ = forward(m, cache, ids)
        return greedy(m, cache, logits, self.tokens, self.eos)

    def recomputed(self, tp, ref: Reference, ranking: torch.Tensor, ratio: float, check_layer: int) -> list[int]:
        """(b): the package's blend walk with the check layer's choice given by ``ranking``."""
        m, T = self.model, len(tp)
        cache = self._cache(T)
        spans = [ReusedSpan(a, ref.reused[:, :, :, a:b]) for a, b in tp.chunk_spans]
        ids = torch.tensor(tp.token_ids, device=m.device)
        logits, _ = forward(m, cache, ids, reused=spans, schedule=[(check_layer, ratio)], ranking=ranking)
        return greedy(m, cache, logits, self.tokens, self.eos)


def deviations(ref: Reference) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunk tokens' relative V and K deviation from full prefill,
    ``[layers, chunk tokens]`` each (squared, over the layer's mean squared
    norm), and their row indices in the prompt."""
    rows = torch.nonzero(ref.chunk_rows).flatten()
    out = []
    for which in (1, 0):
        full = ref.record[:, which][:, :, rows].float()
        reused = ref.reused[:, which][:, :, rows].float()
        squared = (full - reused).pow(2).sum(dim=(1, 3))
        out.append(squared / full.pow(2).sum(dim=(1, 3)).mean(dim=1, keepdim=True).clamp(min=1e-30))
    return out[0], out[1], rows


def top_rows(scores: torch.Tensor, rows: torch.Tensor, ratio: float, n: int) -> torch.Tensor:
    """``[T]`` bool: the ``ratio`` share of ``rows`` with the highest ``scores``."""
    keep = torch.zeros(n, dtype=torch.bool)
    count = round(ratio * rows.numel())
    keep[rows[scores.topk(count).indices.cpu()]] = True
    return keep


def reused_tokens(tp) -> int:
    """The prompt's chunk tokens: those whose KV comes from the store."""
    return sum(b - a for a, b in tp.chunk_spans)


def median_speedup(full: list[float], other: list[float]) -> float:
    """The median over prompts of full prefill's time over the mode's, each
    pair measured on the same prompt minutes apart at most."""
    return round(statistics.median(f / o for f, o in zip(full, other, strict=True)), 2)


def run(args) -> dict:
    torch.manual_seed(0)
    model_dir, task, label = model_and_task(args.model)
    store = ChunkStore(scratch_dir("blend-oracle-store-"), remote="")
    config = BlendConfig(**BASE)
    reference = load_engine(str(model_dir), store=store, config=config, dtype=args.dtype, device="cpu")
    engine = reference
    if args.backend == "vllm":
        engine = load_engine(
            str(model_dir), backend="vllm", store=store, config=config, dtype=args.dtype, max_model_len=4096
        )
    layers = reference.num_layers
    check_layer = config.check_layers[0]
    settings = {k: v for k, v in selection_settings(layers).items() if not args.settings or k in args.settings}
    oracle = Oracle(reference, AGREE_TOKENS)
    examples = task.examples(args.questions, DEVELOPMENT_SEED)
    prompts = [task.prompt(e, reference.tokenizer, config.separator) for e in examples]
    reference.warm([d for e in examples for d in e.documents], progress=True)
    # a walk pass of a reuse pass's size (the fresh tokens) timed on the engine, plain and with the
    # query's tokens scoring their attention: the fixed costs the predicted times add for a query
    # selection's reuse pass
    context = round(statistics.fmean(len(tp) for tp in prompts))
    fresh = round(statistics.fmean(len(tp) - reused_tokens(tp) for tp in prompts))
    query = round(statistics.fmean(len(tp) - tp.chunk_spans[-1][1] - 1 for tp in prompts))  # the walk's query
    if args.backend == "vllm":
        timed = (
            engine.llm.collective_rpc("blend_pass_seconds", args=(context - fresh, fresh, q))[0] for q in (0, query)
        )
    else:
        timed = (engine.blender.pass_seconds(context - fresh, tokens=fresh, scored=q) for q in (0, query))
    pass_s, scored_s = timed

    def agree(tokens: list[int], full: list[int]) -> float:
        return float(tokens[:AGREE_TOKENS] == full[:AGREE_TOKENS])

    rows: dict[str, dict] = {}  # name -> {"agree": [...], "ttft": [...], "recall": [...]}

    def add(name: str, **values) -> None:
        row = rows.setdefault(name, {})
        for key, value in values.items():
            row.setdefault(key, []).append(value)

    v_profile, k_profile, exact, right = [], [], [], []
    started = time.time()
    for i, (example, tp) in enumerate(zip(examples, prompts)):
        full = engine.generate(tp, mode="full", max_tokens=task.max_tokens)
        right.append(float(example.answer.lower() in full.text.lower()))
        add("full", ttft=full.ttft_s)
        if i < args.exact:  # ratio 1 must give full prefill's tokens, every one of them
            whole = engine.generate(tp, mode="blend", recompute_ratio=1.0, max_tokens=task.max_tokens)
            exact.append(whole.token_ids == full.token_ids and whole.usage.chunks_hit == len(tp.chunk_spans))
        reuse = engine.generate(tp, mode="reuse", max_tokens=AGREE_TOKENS)
        add("reuse", agree=agree(reuse.token_ids, full.token_ids), ttft=reuse.ttft_s)
        with torch.inference_mode():
            ref = oracle.reference(tp)
        dv, dk, chunk_rows = deviations(ref)
        v_profile.append(dv.mean(dim=1).tolist())
        k_profile.append(dk.mean(dim=1).tolist())
        one_set = dv.sum(dim=0)
        ranking = torch.zeros(len(tp), device=one_set.device)
        ranking[chunk_rows] = one_set + 1.0  # every chunk token above the rest
        for r in args.ratios:
            tag = f"@{r:.2f}"
            oracle_set = top_rows(one_set, chunk_rows, r, len(tp))
            for name, changes in settings.items():
                gen = engine.generate(tp, mode="blend", recompute_ratio=r, max_tokens=AGREE_TOKENS, **(BASE | changes))
                found = oracle_set[list(gen.recomputed_positions or ())].sum().item()
                add(
                    name + tag,
                    agree=agree(gen.token_ids, full.token_ids),
                    ttft=gen.ttft_s,
                    recall=found / max(1, int(oracle_set.sum())),
                )
            with torch.inference_mode():
                one = oracle.patched(tp, ref, oracle_set.expand(layers, -1))
                per_layer = torch.stack([top_rows(dv[layer], chunk_rows, r, len(tp)) for layer in range(layers)])
                each = oracle.patched(tp, ref, per_layer)
                given = oracle.recomputed(tp, ref, ranking, r, check_layer)
            add("(b) recompute, oracle set" + tag, agree=agree(given, ref.tokens))
            add("(c) oracle patch, one set" + tag, agree=agree(one, ref.tokens))
            add("(c) oracle patch, set per layer" + tag, agree=agree(each, ref.tokens))
        print(f"  {i + 1}/{len(prompts)} prompts, {time.time() - started:.0f} s", file=sys.stderr, flush=True)

    full_ttft = rows["full"]["ttft"]
    table = {}
    for name, row in rows.items():
        if name == "full":
            continue
        out = {"agree": round(statistics.fmean(row["agree"]), 3)}
        if "ttft" in row:
            out["ttft_ms"] = round(1000 * statistics.median(row["ttft"]), 1)
            out["speedup"] = median_speedup(full_ttft, row["ttft"])
        if "recall" in row:
            out["recall"] = round(statistics.fmean(row["recall"]), 3)
        table[name] = out
    mean_by_layer = lambda profile: [round(statistics.fmean(p[layer] for p in profile), 4) for layer in range(layers)]  # noqa: E731
    return {
        "config": {
            "model": label,
            "backend": args.backend,
            "dtype": reference.dtype_name,
            "machine": machine(engine if args.backend == "vllm" else None),
            "layers": layers,
            "check_layer": check_layer,
            "questions": len(prompts),
            "mean_prompt_tokens": round(statistics.fmean(len(tp) for tp in prompts)),
            "mean_reused_tokens": round(statistics.fmean(reused_tokens(tp) for tp in prompts)),
            "mean_prefix_tokens": round(statistics.fmean(tp.chunk_spans[0][0] for tp in prompts)),
            "mean_chunks": round(statistics.fmean(len(tp.chunk_spans) for tp in prompts), 2),
            "pass_tokens": fresh,
            "scored_tokens": query,
            "pass_ms": round(1000 * pass_s, 1),
            "scoring_ms": round(1000 * max(0.0, scored_s - pass_s), 1),
            "documents_per_question": list(task.n_docs),
            "two_hop_share": task.two_hop_share,
            "ratios": list(args.ratios),
            "settings": {name: config.with_settings(changes).settings() for name, changes in settings.items()},
            "agree_tokens": AGREE_TOKENS,
            "seed": DEVELOPMENT_SEED,
            "minutes": round((time.time() - started) / 60, 1),
            "date": time.strftime("%Y-%m-%d"),
            "prediction": PREDICTION,
        },
        "full": {
            "ttft_ms": round(1000 * statistics.median(full_ttft), 1),
            "right": round(statistics.fmean(right), 3),
            "exact_at_ratio_one": exact,
        },
        "modes": table,
        # each question's hops, and per mode whether it agreed (in question order)
        "per_question": {
            "hops": [e.hops for e in examples],
            "agree": {n: r["agree"] for n, r in rows.items() if "agree" in r},
        },
        "deviation_by_layer": {"v": mean_by_layer(v_profile), "k": mean_by_layer(k_profile)},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks oracle", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="qwen2.5-coder-1.5b", help="a packaged model, reader, or a checkpoint directory"
    )
    parser.add_argument("--backend", default="transformers", choices=("transformers", "vllm"))
    parser.add_argument("--questions", type=int, default=12)
    parser.add_argument("--ratios", type=float, nargs="+", default=list(RATIOS))
    parser.add_argument("--settings", nargs="*", help="a subset of the selection settings (default: all)")
    parser.add_argument("--dtype", default="auto", help="auto (as the engines resolve it), float32 or bfloat16")
    parser.add_argument("--exact", type=int, default=2, help="prompts on which blend at ratio 1 is checked")
    parser.add_argument("--out", default="docs/results", help="directory for the results ('' to skip)")
    parser.add_argument("--render", nargs="+", metavar="JSON", help="rewrite these results' pages from their JSON")
    args = parser.parse_args(argv)
    if args.render:
        for path in map(Path, args.render):
            page = path.with_suffix(".md")
            title, command = page.read_text().split("\n\n", 2)[:2]
            page.write_text(f"{title}\n\n{command}\n\n{markdown(json.loads(path.read_text()))}\n")
        return
    if any(not 0.0 < r < 1.0 for r in args.ratios):
        parser.error("--ratios must lie strictly between 0 and 1")
    known = selection_settings(28)
    args.settings = args.settings and [RENAMED.get(name, name) for name in args.settings]  # older commands still run
    if args.settings and (unknown := set(args.settings) - set(known)):
        parser.error(f"unknown settings {', '.join(sorted(unknown))}; they are {', '.join(known)}")
    report = run(args)
    text = markdown(report)
    print(text)
    if args.out:
        # a subset of the settings has a page of its own: the whole run's page stays
        stem = "-".join(["oracle", results_name(args.model), args.backend, *(args.settings or ())])
        options = f" --model {args.model} --backend {args.backend} --questions {args.questions}"
        options += f" --ratios {' '.join(map(str, args.ratios))} --dtype {args.dtype}"
        options += f" --settings {' '.join(args.settings)}" if args.settings else ""
        write_results(
            args.out,
            stem,
            f"Selection against the oracle: {report['config']['model']}",
            text,
            report,
            command=f"`python -m benchmarks oracle{options}`.",
        )


if __name__ == "__main__":
    main()
