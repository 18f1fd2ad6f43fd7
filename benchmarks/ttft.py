"""Time to first token: full prefill, full KV reuse and blend, side by side.

A randomly initialised Llama-style model of realistic depth (speed is a
property of the architecture, not of the weights), a prompt of 6 retrieved
chunks of 512 tokens each in a new order every run, chunks warmed in the
store beforehand. Prints each mode's median TTFT, the speedup over full
prefill, and the compute ceiling of DESIGN section 5 for the recompute set
actually used (``compute_ceiling``: token-layers of full prefill over the mode's).
With several ``--kv-codec`` values every codec's store is timed in the same
rounds, against one full prefill per round (``ttft-codecs.md``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from blend_integrations.config import BlendConfig
from blend_integrations.engines import load_engine
from blend_integrations.store import KV_CODECS, ChunkStore
from tests.fixtures.local_models import sample_text

from . import (
    MODEL_HELP,
    add_model_arguments,
    bench_model,
    compute_ceiling,
    machine,
    model_options,
    scratch_dir,
    setup_line,
    shuffled_prompts,
    write_results,
)
from .codecs import codec_name


def make_chunks(tokenizer, n_chunks: int, chunk_tokens: int, seed: int = 0) -> list[list[int]]:
    chunks = []
    for i in range(n_chunks):
        ids: list[int] = []
        j = 0
        while len(ids) < chunk_tokens:
            ids += tokenizer.encode(" ".join(sample_text(20, seed=seed * 1000 + i * 50 + j)), add_special_tokens=False)
            j += 1
        chunks.append(ids[:chunk_tokens])
    return chunks


def run(args) -> Iterator[dict]:
    """One report per prompt size in ``args.chunks`` (one engine, a store per
    codec in ``args.kv_codecs``), each as soon as it is measured."""
    torch.manual_seed(0)
    sizes = sorted(args.chunks)
    context = max(8192, 2 ** (max(sizes) * args.chunk_tokens + 256).bit_length())
    model_dir, label, suffix = bench_model(args.model, **model_options(args), context=context)
    check_layer = 1
    # Per codec, "memory": every chunk of the prompt held in this process (the
    # tier's limit is no limit here); "disk": the same store with no memory tier.
    stores = {}
    for codec in args.kv_codecs:
        store_dir = scratch_dir(f"blend-bench-store-{codec_name(codec)}-")
        options = {"size_limit_bytes": 2**40, "kv_codec": codec}
        stores[codec] = (
            ChunkStore(store_dir, memory_limit_bytes=2**40, **options),
            ChunkStore(store_dir, memory_limit_bytes=0, **options),
        )
    engine = load_engine(
        model_dir,
        store=stores[args.kv_codecs[0]][0],
        dtype=args.dtype,
        device=args.device,
        config=BlendConfig(check_layers=(check_layer,)),
    )
    chunks = make_chunks(engine.tokenizer, max(sizes), args.chunk_tokens)
    for memory, _ in stores.values():
        engine.store = memory
        engine.warm(chunks, progress=True)
    name = "-codecs" if len(stores) > 1 else f"-{args.kv_codecs[0]}" if args.kv_codecs[0] else ""
    for n_chunks in sizes:
        report = measure(args, engine, chunks[:n_chunks], stores, check_layer)
        report["config"] = {"model": label, "results": "ttft" + suffix + name, **report["config"]}
        yield report


def measure(args, engine, chunks, stores: dict[str | None, tuple[ChunkStore, ChunkStore]], check_layer: int) -> dict:
    """Every mode's TTFT on prompts of ``chunks`` in a new order each round,
    from each codec's (memory, disk) stores in ``stores``. One store: today's
    report; several: ``results`` by codec name, each beside the same full prefill."""
    L = engine.layers.num_layers
    prompt = shuffled_prompts(chunks)
    # (name, mode, ratio, selection)
    cases = [("full", "full", None, None), ("reuse", "reuse", None, None)]
    cases += [(f"blend@{r:.2f}", "blend", r, None) for r in args.ratios]
    # Query-aware selection beside HKVD at the same ratios: the cost of its scoring pass.
    cases += [(f"blend@{r:.2f} {s}", "blend", r, s) for s in args.selections for r in args.ratios]
    # The same reuse and blend with every chunk read from disk (no in-process memory tier).
    cases += [("reuse (disk)", "reuse", None, None), ("blend@0.15 (disk)", "blend", 0.15, None)]
    # Full prefill reads no store: one per round serves every codec. The codecs
    # take turns at each mode, so each codec's ratio pairs with that round's full.
    first = next(iter(stores))
    turns = [(first, cases[0])] + [(codec, case) for case in cases[1:] for codec in stores]
    gens: dict[tuple[str | None, str], list] = {(codec, case[0]): [] for codec, case in turns}
    for codec in stores:
        gens[codec, "full"] = gens[first, "full"]
    # Modes take turns within every round, so drift in machine speed hits all alike.
    for round_ in range(args.repeats + 1):
        for codec, (name, mode, ratio, selection) in turns:
            memory, disk = stores[codec]
            engine.store = disk if name.endswith("(disk)") else memory
            g = engine.generate(prompt(), max_tokens=1, mode=mode, recompute_ratio=ratio, selection=selection)
            if round_:  # round 0 warms up
                gens[codec, name].append(g)
    engine.store = stores[first][0]
    by_codec = {}
    for codec in stores:
        results = {
            name: summarize(gens[codec, name], L, check_layer, mode, selection or "deviation")
            for name, mode, _, selection in cases
        }
        # Speedup: the median over rounds of full / mode within the same round.
        # Paired ratios cancel the slow swings in machine speed that a shared VM
        # shows (seen here: the same prefill varying by 30% between minutes).
        for name, row in results.items():
            paired = [f.ttft_s / g.ttft_s for f, g in zip(gens[codec, "full"], gens[codec, name])]
            row["speedup"] = statistics.median(paired)
            # the middle half of the rounds' ratios: how far one round strays
            row["speedup_quartiles"] = _quartiles(paired)
            row["of_ceiling"] = row["speedup"] / row["ceiling"]
            # What the engine's own full and reuse times predict: reuse, plus the
            # computed share (1 / ceiling) of what full prefill adds to it.
            full, reuse = results["full"]["ttft_ms"], results["reuse"]["ttft_ms"]
            row["predicted_ms"] = reuse + (full - reuse) / row["ceiling"]
            row["of_predicted"] = row["ttft_ms"] / row["predicted_ms"]
        by_codec[codec_name(codec)] = results
    single = len(stores) == 1
    codecs = {"kv_codec": first} if single else {"kv_codecs": list(by_codec)}
    return {
        "config": {
            "dtype": engine.dtype_name,
            "machine": machine(),
            "device": str(engine.device),
            "chunks": f"{len(chunks)} x {args.chunk_tokens} tokens",
            "prompt_tokens": by_codec[codec_name(first)]["full"]["prompt_tokens"],
            "check_layer": check_layer,
            **codecs,
            "repeats": args.repeats,
            "torch_threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d"),
        },
        "results": by_codec[codec_name(first)] if single else by_codec,
    }


def _quartiles(values: list[float]) -> tuple[float, float]:
    """The first and third quartiles (both the value itself for one value)."""
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def summarize(gens, L: int, c: int, mode: str, selection: str) -> dict:
    g = gens[-1]
    N = g.usage.prompt_tokens
    computed = N - g.usage.cached_tokens + g.usage.recomputed_tokens  # |R|
    return {
        "ttft_ms": 1000 * statistics.median(x.ttft_s for x in gens),
        "ttft_min_ms": 1000 * min(x.ttft_s for x in gens),
        "ttft_max_ms": 1000 * max(x.ttft_s for x in gens),
        "prompt_tokens": N,
        "cached_tokens": g.usage.cached_tokens,
        "recomputed_tokens": g.usage.recomputed_tokens,
        "computed_share": computed / N,
        "ceiling": compute_ceiling(mode, g.usage, L, c, selection),
    }


def render(report: dict) -> str:
    cfg = report["config"]
    lines = [
        setup_line(cfg)
        + f"check layer {cfg['check_layer']}; "
        + (f"chunks stored coded, {cfg['kv_codec']}, decoded by the walk; " if cfg.get("kv_codec") else "")
        + f"{cfg['repeats']} rounds, every mode once per round; {cfg['date']}.",
        "",
        "| mode | TTFT median (ms) | TTFT min-max (ms) | full / mode: median of paired rounds (middle half) | computed share \\|R\\|/N | compute ceiling | share of ceiling | predicted (ms) | mode / predicted |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in report["results"].items():
        share = f"{100 * r['of_ceiling']:.0f}%"
        q1, q3 = r["speedup_quartiles"]
        speedup = f"{r['speedup']:.2f}x" + ("" if name == "full" else f" ({q1:.2f}-{q3:.2f})")
        predicted = f"{r['predicted_ms']:.0f} | {r['of_predicted']:.2f}x" if name.startswith("blend") else "- | -"
        lines.append(
            f"| {name} | {r['ttft_ms']:.0f} | {r['ttft_min_ms']:.0f}-{r['ttft_max_ms']:.0f} | {speedup} | {r['computed_share']:.3f} | {r['ceiling']:.2f}x | {share} | {predicted} |"
        )
    lines.append(
        "\npredicted = reuse + (full - reuse) / compute ceiling: the time this engine's own full prefill and "
        "reuse predict for the tokens a blend computes (1 / ceiling is the share of token-layers computed)."
    )
    return "\n".join(lines)


def render_codecs(report: dict) -> str:
    """Several codecs' stores side by side: each mode's median TTFT and full / mode per codec."""
    cfg = report["config"]
    codecs = cfg["kv_codecs"]
    lines = [
        setup_line(cfg)
        + f"check layer {cfg['check_layer']}; a store per codec ({', '.join(codecs)}), each warmed with the "
        "same chunks; in a coded store every tier, memory included, keeps the codes and the walk decodes every "
        f"layer on every reuse; {cfg['repeats']} rounds, each one full prefill (it reads no store) then every "
        f"codec's modes in turn; {cfg['date']}. full / mode: the median of the rounds' paired ratios "
        "(middle half), each codec's against the same full prefill.",
        "",
        "| mode | " + " | ".join(f"{c} (ms) | {c}: full / mode" for c in codecs) + " |",
        "|---|" + "---:|---:|" * len(codecs),
    ]
    for name in report["results"][codecs[0]]:
        cells = []
        for c in codecs:
            r = report["results"][c][name]
            q1, q3 = r["speedup_quartiles"]
            cells.append(
                f"{r['ttft_ms']:.0f} | {r['speedup']:.2f}x" + ("" if name == "full" else f" ({q1:.2f}-{q3:.2f})")
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """Left: median TTFT per mode (bars span min-max). Right: the measured
    speedup against the share of the prompt computed, next to the compute
    ceiling for that share."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    names = list(results)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    medians = [results[n]["ttft_ms"] for n in names]
    spans = [
        [m - results[n]["ttft_min_ms"] for n, m in zip(names, medians)],
        [results[n]["ttft_max_ms"] - m for n, m in zip(names, medians)],
    ]
    left.bar(
        range(len(names)),
        medians,
        yerr=spans,
        capsize=3,
        color=["tab:gray" if n == "full" else "tab:blue" for n in names],
    )
    left.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    left.set_ylabel("time to first token (ms)")
    left.set_title("TTFT per mode (median, min-max)")
    shares = [results[n]["computed_share"] for n in names]
    right.plot(shares, [results[n]["speedup"] for n in names], "o", color="tab:blue", label="measured")
    right.plot(shares, [results[n]["ceiling"] for n in names], "x", color="tab:red", label="compute ceiling")
    labelled = set()
    for n, x, y in zip(names, shares, (results[n]["speedup"] for n in names)):
        if round(x, 3) not in labelled:  # one label per share (blend from disk sits on blend)
            labelled.add(round(x, 3))
            right.annotate(n, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("computed share of the prompt |R|/N")
    right.set_ylabel("full / mode")
    right.set_title("Speedup against the share computed")
    right.legend(fontsize=8)
    fig.suptitle(report["config"]["model"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks ttft", description=__doc__.splitlines()[0])
    # 15 rounds: on a shared 2-CPU machine one round's full / blend strays by
    # up to 15% either way; the median of 7 moved by 5-10% from run to run.
    add_model_arguments(p, repeats=15)
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument(
        "--chunks",
        type=int,
        nargs="+",
        default=[6],
        help="chunks in the prompt; several values time each prompt size on one engine",
    )
    p.add_argument("--ratios", type=float, nargs="+", default=[0.05, 0.15, 0.30])
    p.add_argument(
        "--selections",
        nargs="*",
        default=["query"],
        help="query-aware selections timed beside HKVD at each ratio (mixed costs what query does)",
    )
    p.add_argument(
        "--kv-codec",
        nargs="+",
        choices=("raw", *KV_CODECS),
        default=["raw"],
        help="keep the chunks coded (the store's kv_codec; results named ttft-...-CODEC): reuse and blend then "
        "include decoding them, on the engine's device; several codecs are timed side by side in one run, a store "
        "each, against the same full prefill (results named ttft-...-codecs)",
    )
    p.add_argument(
        "--out", default="docs/results", help="directory for the results, ttft.md and ttft.json by default ('' to skip)"
    )
    args = p.parse_args(argv)
    if len(set(args.kv_codec)) < len(args.kv_codec):
        p.error(f"argument --kv-codec: a codec given twice: {' '.join(args.kv_codec)}")
    args.kv_codecs = [None if c == "raw" else c for c in args.kv_codec]
    show = render if len(args.kv_codecs) == 1 else render_codecs
    reports = []
    for report in run(args):
        reports.append(report)
        print(show(report) + "\n", flush=True)
    text = "\n\n".join(show(r) for r in reports)
    if args.out:
        stem = reports[0]["config"]["results"]
        if len(reports) > 1:
            stem += "-" + "-".join(f"{round(r['config']['prompt_tokens'] / 1024)}k" for r in reports)
        command = " ".join(["python -m benchmarks ttft", *(argv if argv is not None else sys.argv[1:])])
        single = len(args.kv_codecs) == 1
        out = write_results(
            args.out,
            stem,
            "Time to first token: full prefill vs reuse vs blend"
            + ("" if single else f", from stores kept {', '.join(args.kv_codec)}"),
            text,
            reports[0] if len(reports) == 1 else {"runs": reports},
            command=f"`{command}`" + (" (`make bench` runs it)." if command == "python -m benchmarks ttft" else "."),
            extra=f"\n![TTFT per mode, and speedup against the computed share]({stem}.png)\n" if single else "",
        )
        if single:
            plot(reports[-1], out / f"{stem}.png")


if __name__ == "__main__":
    main()
