"""Chunk store tiers: read bandwidth per tier, and time to first token of blend
with chunks in memory, on disk and in Redis, against full prefill; and what
the loading controller chose.

The model and prompt are those of the TTFT benchmark (a 16-layer random
Llama-style model, 6 chunks of 512 tokens in a new order every round). Redis
is a redis-server this benchmark starts on a free loopback port (skipped,
with a note, when none is installed): loopback is a fast network, so Redis
numbers here are a floor for real ones. Every case reads its chunks from the
tier it names: a store without a memory tier for disk, and a new directory
for every Redis read (a Redis hit is copied to the local disk).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from blend_integrations.config import BlendConfig
from blend_integrations.engines import load_engine
from blend_integrations.store import ChunkStore
from blend_integrations.store.layered import LayerReader
from tests.fixtures.redis_server import RedisServer

from . import add_model_arguments, bench_model, machine, model_options, setup_line, shuffled_prompts, write_results
from .ttft import make_chunks

RATIO = 0.15


class Tiers:
    """Stores that read the warmed chunks from one tier each."""

    def __init__(self, work: Path, remote: str | None) -> None:
        self.work, self.remote = work, remote
        self.warm = ChunkStore(work / "warm", remote=remote)  # memory, disk and Redis
        self._fresh = 0

    def names(self) -> list[str]:
        return ["memory", "disk"] + (["redis"] if self.remote else [])

    def store(self, tier: str) -> ChunkStore:
        if tier == "memory":
            return self.warm
        if tier == "disk":
            return ChunkStore(self.work / "warm", memory_limit_bytes=0)
        self._fresh += 1  # another machine: only Redis has the chunks
        return ChunkStore(self.work / f"fresh-{self._fresh}", remote=self.remote, memory_limit_bytes=0)

    def done(self, store: ChunkStore) -> None:
        if store.path.name.startswith("fresh-"):
            store.close()
            shutil.rmtree(store.path, ignore_errors=True)


def bandwidth(tiers: Tiers, keys: list[str], repeats: int) -> dict:
    """Read every chunk ``repeats`` times from each tier, whole (``get``) and
    layer by layer (``open_layers``, as pipelined loading does)."""
    rows = {}
    for tier in tiers.names():
        for way in ("whole", "layers") if tier != "memory" else ("whole",):
            seconds, nbytes = [], 0
            rate = None
            for _ in range(repeats):
                store = tiers.store(tier)
                for key in keys:
                    started = time.perf_counter()
                    if way == "whole":
                        entry = store.get(key)
                    else:
                        entry = reader = store.open_layers(key)
                        if isinstance(reader, LayerReader):  # else small enough to be read whole
                            for _ in range(reader.num_layers):
                                reader.read_layer()
                            reader.verify()
                            entry = store.finish_layers(reader)
                    seconds.append(time.perf_counter() - started)
                    nbytes += entry.nbytes
                rate = store.read_rates["remote" if tier == "redis" else tier]
                tiers.done(store)
            rows[f"{tier} ({way})" if tier != "memory" else tier] = {
                "chunk_mb": nbytes / len(seconds) / 1e6,
                "read_ms_median": 1000 * statistics.median(seconds),
                "mb_per_s": nbytes / sum(seconds) / 1e6,  # per call: read, checks, copies to upper tiers
                "store_estimate_mb_per_s": rate.value / 1e6,  # what the controller uses
            }
    return rows


def run(args) -> dict:
    torch.manual_seed(0)
    model_dir, label, _ = bench_model(None, **model_options(args))
    work = Path(tempfile.mkdtemp(prefix="blend-bench-store-"))
    redis = None
    try:
        if shutil.which("redis-server"):
            redis = RedisServer(work / "redis").start()
        else:
            print("redis-server is not installed: the Redis tier is skipped")
        tiers = Tiers(work, redis.url() if redis else None)
        return measure(args, model_dir, label, tiers)
    finally:
        if redis is not None:
            redis.stop()
        shutil.rmtree(work, ignore_errors=True)


def measure(args, model_dir: str, label: str, tiers: Tiers) -> dict:
    base = BlendConfig(check_layers=(1,), recompute_ratio=RATIO)
    configs = {
        "whole": base,
        "pipelined": base.replace(pipelined_loading=True),
        "controller": base.replace(pipelined_loading=True, loading_controller=True),
    }
    engines = {
        name: load_engine(model_dir, store=tiers.warm, dtype=args.dtype, device=args.device, config=config)
        for name, config in configs.items()
    }
    whole = engines["whole"]
    chunks = make_chunks(whole.tokenizer, args.chunks, args.chunk_tokens)
    whole.warm(chunks, progress=not args.quick)
    keys = [whole.chunk_key(c) for c in chunks]
    prompt = shuffled_prompts(chunks)

    cases = [("full", "whole", "memory", "full")]
    for tier in tiers.names():
        cases.append((f"blend@{RATIO:.2f}, {tier}", "whole", tier, "blend"))
        if tier != "memory":
            cases.append((f"blend@{RATIO:.2f}, {tier}, pipelined", "pipelined", tier, "blend"))
        cases.append((f"controller, {tier}", "controller", tier, "blend"))
    gens = {name: [] for name, *_ in cases}
    # Cases take turns within every round, so drift in machine speed hits all alike.
    for round_ in range(args.repeats + 1):
        for name, engine_name, tier, mode in cases:
            engine = engines[engine_name]
            engine.store = tiers.store(tier)
            g = engine.generate(prompt(), max_tokens=1, mode=mode)
            tiers.done(engine.store)
            if round_:  # round 0 warms up (and lets the stores and engines measure)
                gens[name].append(g)
    results = {}
    for name, *_ in cases:
        runs = gens[name]
        last = runs[-1]
        row = {
            "ttft_ms": 1000 * statistics.median(g.ttft_s for g in runs),
            "ttft_min_ms": 1000 * min(g.ttft_s for g in runs),
            "ttft_max_ms": 1000 * max(g.ttft_s for g in runs),
            "speedup": statistics.median(f.ttft_s / g.ttft_s for f, g in zip(gens["full"], runs)),
            "cached_tokens": last.usage.cached_tokens,
            "recomputed_tokens": last.usage.recomputed_tokens,
        }
        if last.loading is not None:
            row["controller"] = {
                "ratio": [g.loading.recompute_ratio for g in runs],
                "chunks_computed": [g.usage.chunks_computed for g in runs],
                "est_load_ms": statistics.median(g.loading.est_load_ms for g in runs),
                "est_compute_ms": statistics.median(g.loading.est_compute_ms or 0.0 for g in runs),
            }
        results[name] = row
    return {
        "config": {
            "model": label,
            "dtype": whole.dtype_name,
            "machine": machine(),
            "device": str(whole.device),
            "chunks": f"{args.chunks} x {args.chunk_tokens} tokens",
            "prompt_tokens": gens["full"][-1].usage.prompt_tokens,
            "ratio": RATIO,
            "repeats": args.repeats,
            "redis": "redis-server on loopback" if tiers.remote else "not installed: skipped",
            "torch_threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(),
            "date": time.strftime("%Y-%m-%d"),
        },
        "bandwidth": bandwidth(tiers, keys, max(1, args.repeats)),
        "ttft": results,
    }


def render(report: dict) -> str:
    cfg = report["config"]
    lines = [
        setup_line(cfg) + f"Redis: {cfg['redis']}; {cfg['repeats']} rounds; {cfg['date']}.",
        "",
        "Reading one chunk's KV:",
        "",
        "| tier | chunk (MB) | read median (ms) | MB/s | store's estimate (MB/s) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in report["bandwidth"].items():
        lines.append(
            f"| {name} | {r['chunk_mb']:.1f} | {r['read_ms_median']:.2f} | {r['mb_per_s']:.0f} | "
            f"{r['store_estimate_mb_per_s']:.0f} |"
        )
    lines += [
        "",
        f"Time to first token (the ratio is {cfg['ratio']} unless the controller chose another):",
        "",
        "| case | TTFT median (ms) | min-max (ms) | full / case | cached | recomputed | controller: ratio | chunks computed | est. load / compute (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in report["ttft"].items():
        c = r.get("controller")
        chosen = (
            ""
            if c is None
            else (
                f"{min(c['ratio']):.3f}-{max(c['ratio']):.3f} | {min(c['chunks_computed'])}-{max(c['chunks_computed'])} | "
                f"{c['est_load_ms']:.0f} / {c['est_compute_ms']:.0f}"
            )
        )
        lines.append(
            f"| {name} | {r['ttft_ms']:.0f} | {r['ttft_min_ms']:.0f}-{r['ttft_max_ms']:.0f} | {r['speedup']:.2f}x | "
            f"{r['cached_tokens']} | {r['recomputed_tokens']} | " + (chosen or " | | ") + " |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks store", description=__doc__.splitlines()[0])
    add_model_arguments(p)
    p.add_argument("--chunks", type=int, default=6)
    p.add_argument(
        "--quick",
        action="store_true",
        help="a 4-layer model, 3 chunks of 64 tokens, 1 round; nothing written unless --out is given",
    )
    p.add_argument("--json", action="store_true", help="also print the report as one JSON line at the end")
    p.add_argument(
        "--out", default=None, help="directory for store.md and store.json ('' to skip; default docs/results)"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.heads, args.kv_heads = 4, 128, 4, 2
        args.chunks, args.chunk_tokens, args.repeats = 3, 64, 1
    out = args.out if args.out is not None else ("" if args.quick else "docs/results")
    report = run(args)
    table = render(report)
    print(table)
    if out:
        write_results(
            out,
            "store",
            "Chunk store tiers: read bandwidth, time to first token, the loading controller",
            table,
            report,
        )
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
