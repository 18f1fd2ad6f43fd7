"""Chunk store tiers: read bandwidth per tier, and time to first token of blend
with chunks in memory, on disk and in Redis, against full prefill; and what
the loading controller chose. Then the KV codecs: bytes, encode and decode
time and prompt read time per codec and tier, at the bench model's KV shape
and at Llama-3-8B's, and time to first token where a rate-limited read path
(Redis behind a throttling proxy) bounds it, raw against coded.

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
from blend_integrations.fusion import blender
from blend_integrations.fusion.pipeline import LayerLoader
from blend_integrations.store import KV_CODECS, ChunkKV, ChunkStore, coded_key
from blend_integrations.store.format import _decode, encode
from blend_integrations.store.layered import LayerReader
from tests.fixtures.redis_server import RedisServer

from . import add_model_arguments, bench_model, machine, model_options, setup_line, shuffled_prompts, write_results
from .throttle import ThrottledProxy
from .ttft import make_chunks

RATIO = 0.15
THREADS = dict(blender.LAYER_READ_THREADS)  # the package's own choice, restored after each case
CODECS: tuple[str | None, ...] = (None, *KV_CODECS)
LLAMA3_8B = (32, 8, 128, torch.bfloat16)  # layers, KV heads, head size, and the dtype a GPU keeps its KV in
THROTTLED_MB_S = 25.0  # the rate-limited read path: 200 Mbit/s


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


def codec_name(codec: str | None) -> str:
    return codec or "raw"


def codec_costs(
    work: Path, remote: str | None, shapes: dict[str, tuple], tokens: int, chunks: int, repeats: int
) -> dict:
    """Per KV shape and codec: bytes per token, encode and decode time per
    chunk (the format's, checksum included; decoding every layer on the CPU,
    as a CPU walk does), on a machine with a GPU the time to put a chunk's
    KV on it from page-locked memory (copy, and decoding there), and seconds
    to read a prompt's ``chunks`` chunks of ``tokens`` tokens whole from each
    tier (the bytes, as the store holds them: coded stores stay coded)."""
    rows = {}
    for shape, (layers, heads, head_dim, dtype) in shapes.items():
        g = torch.Generator().manual_seed(0)
        kvs = [torch.randn(layers, 2, heads, tokens, head_dim, generator=g).to(dtype) for _ in range(chunks)]
        keys = [f"{i:02x}" * 32 for i in range(chunks)]
        for codec in CODECS:
            encode_s, decode_s, gpu_s = [], [], []
            for _ in range(max(1, repeats // 2)):
                for key, kv in zip(keys, kvs):
                    entry = ChunkKV(coded_key(key, codec), kv)
                    started = time.perf_counter()
                    data = encode(entry)
                    encode_s.append(time.perf_counter() - started)
                    started = time.perf_counter()
                    _decode(data, expected_key=entry.key, adopt=False).values()
                    decode_s.append(time.perf_counter() - started)
                    if torch.cuda.is_available():
                        gpu_s.append(_to_gpu_s(_decode(data, expected_key=entry.key, adopt=False)))
            path = work / f"codec-{shape}-{codec_name(codec)}"
            options = {"kv_codec": codec, "remote_timeout_s": 120.0, "memory_limit_bytes": 2 * 2**30}
            warm = ChunkStore(path, remote=remote, **options)
            for key, kv in zip(keys, kvs):
                warm.put(ChunkKV(key, kv))
            tiers = ["memory", "disk"] + (["redis"] if remote else [])
            read_s = {}
            for tier in tiers:
                seconds = []
                for _ in range(max(1, repeats // 2)):
                    store = warm if tier == "memory" else _reader(tier, path, remote, options, work)
                    started = time.perf_counter()
                    assert all(store.get(key) is not None for key in keys)
                    seconds.append(time.perf_counter() - started)
                    if store is not warm:
                        store.close()
                        if tier == "redis":
                            shutil.rmtree(store.path, ignore_errors=True)
                read_s[tier] = statistics.median(seconds)
            rows[f"{shape}, {codec_name(codec)}"] = {
                "shape": [layers, heads, head_dim, str(dtype).removeprefix("torch.")],
                "bytes_per_token": len(data) / tokens,
                "encode_ms": 1000 * statistics.median(encode_s),
                "decode_ms": 1000 * statistics.median(decode_s),
                **({"to_gpu_ms": 1000 * statistics.median(gpu_s)} if gpu_s else {}),
                "prompt_read_s": read_s,
            }
            warm.clear()
            warm.close()
            shutil.rmtree(path, ignore_errors=True)
    return rows


def _to_gpu_s(entry: ChunkKV) -> float:
    """Seconds to put every layer of ``entry`` on the GPU from page-locked
    memory, as the walk does: a copy, and for a coded entry decoding there."""
    kv = entry.kv.pin_memory()
    device = torch.device("cuda")
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for layer in range(entry.num_layers):
        if isinstance(kv, torch.Tensor):
            kv[layer].to(device, non_blocking=True)
        else:
            kv.layer(layer, device)
    torch.cuda.synchronize(device)
    return time.perf_counter() - started


def _reader(tier: str, path: Path, remote: str | None, options: dict, work: Path) -> ChunkStore:
    """A store that reads ``path``'s entries from ``tier`` only: its disk, or
    Redis with a new directory (another machine)."""
    if tier == "disk":
        return ChunkStore(path, **options | {"memory_limit_bytes": 0})
    return ChunkStore(Path(tempfile.mkdtemp(dir=work)), remote=remote, **options | {"memory_limit_bytes": 0})


def throttled_ttft(
    args, model_dir: str, work: Path, redis: RedisServer, warm: ChunkStore, keys: list[str], prompt
) -> dict:
    """Time to first token of blend@0.15, loads pipelined, with the chunks in
    Redis behind a link of ``THROTTLED_MB_S`` (a new store every time, so
    every chunk is read through it), per codec, against full prefill."""
    config = BlendConfig(check_layers=(1,), recompute_ratio=RATIO, pipelined_loading=True)
    engine = load_engine(model_dir, store=warm, dtype=args.dtype, device=args.device, config=config)
    gens: dict[str, list] = {"full": []} | {codec_name(c): [] for c in CODECS}
    with ThrottledProxy(redis.port, THROTTLED_MB_S * 1e6) as proxy:
        for codec in CODECS:  # every chunk in Redis in this codec
            coded = ChunkStore(work / f"throttled-{codec_name(codec)}", remote=redis.url(), kv_codec=codec)
            for key in keys:
                coded.put(warm.get(key))
            coded.close()
        for round_ in range(args.repeats + 1):
            for case in gens:
                codec = None if case in ("full", "raw") else case
                store = ChunkStore(
                    Path(tempfile.mkdtemp(dir=work)),
                    remote=proxy.url(),
                    kv_codec=codec,
                    memory_limit_bytes=0,
                    remote_timeout_s=120.0,
                )
                engine.store = store
                g = engine.generate(prompt(), max_tokens=1, mode="full" if case == "full" else "blend")
                store.close()
                shutil.rmtree(store.path, ignore_errors=True)
                if round_:
                    gens[case].append((g, store.stats.remote_bytes_read))
    rows = {}
    for case, runs in gens.items():
        ttft = [g.ttft_s for g, _ in runs]
        rows[case] = {
            "ttft_ms": 1000 * statistics.median(ttft),
            "speedup": statistics.median(f.ttft_s / g.ttft_s for (f, _), (g, _) in zip(gens["full"], runs)),
            "mb_read": runs[-1][1] / 1e6,
            "chunks_hit": runs[-1][0].usage.chunks_hit,
        }
    return rows


def layered_threads(tiers: Tiers, keys: list[str], repeats: int) -> dict:
    """Pipelined loading's reads alone, without a walk: a prompt's chunks read
    layer by layer from the disk tier by ``LayerLoader`` with 1, 2 and 4 threads."""
    rows = {}
    for threads in (1, 2, 4):
        seconds, nbytes = [], 0
        for _ in range(repeats):
            store = tiers.store("disk")
            readers = [r for r in (store.open_layers(k) for k in keys) if isinstance(r, LayerReader)]
            started = time.perf_counter()
            with LayerLoader(readers, threads=threads) as loader:
                pass  # leaving waits for every layer of every reader
            seconds.append(time.perf_counter() - started)
            nbytes = sum(r.nbytes for r in readers)
            for reader in readers:
                store.finish_layers(reader, loader.errors.get(reader))
            store.close()
        rows[str(threads)] = {
            "ms": 1000 * statistics.median(seconds),
            "mb_per_s": nbytes / statistics.median(seconds) / 1e6,
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
        report = measure(args, model_dir, label, tiers)
        bench = report.pop("kv_shape")
        shapes = {"bench model": bench} if args.quick else {"bench model": bench, "Llama-3-8B": LLAMA3_8B}
        report["codecs"] = codec_costs(work, tiers.remote, shapes, args.chunk_tokens, args.chunks, max(2, args.repeats))
        if redis is not None:
            report["throttled"] = throttled_ttft(args, model_dir, work, redis, tiers.warm, *report.pop("prompt"))
            report["config"]["throttled_mb_s"] = THROTTLED_MB_S
        else:
            report.pop("prompt")
        return report
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
        if tier == "disk":  # the walk's time with one reading thread, beside the package's choice
            cases.append((f"blend@{RATIO:.2f}, {tier}, pipelined, 1 thread", "pipelined", tier, "blend"))
        cases.append((f"controller, {tier}", "controller", tier, "blend"))
    gens = {name: [] for name, *_ in cases}
    # Cases take turns within every round, so drift in machine speed hits all alike.
    for round_ in range(args.repeats + 1):
        for name, engine_name, tier, mode in cases:
            engine = engines[engine_name]
            engine.store = tiers.store(tier)
            device = engine.device.type
            blender.LAYER_READ_THREADS[device] = 1 if name.endswith("1 thread") else THREADS[device]
            g = engine.generate(prompt(), max_tokens=1, mode=mode)
            blender.LAYER_READ_THREADS[device] = THREADS[device]
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
        "layered_threads": layered_threads(tiers, keys, max(2, args.repeats)),
        "ttft": results,
        "kv_shape": (whole.layers.num_layers, whole.layers.num_kv_heads, whole.layers.head_dim, whole.dtype),
        "prompt": (keys, prompt),
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
    threads = report.get("layered_threads")
    if threads:
        lines += [
            "",
            f"Layered reads by thread count: the {cfg['chunks']} chunks read layer by layer from disk as "
            "pipelined loading reads them, without a walk (the package uses "
            f"{THREADS.get(cfg['device'].split(':')[0], 1)} on this device; the pipelined rows above show the walk with them):",
            "",
            "| threads | prompt read (ms) | MB/s |",
            "|---:|---:|---:|",
        ]
        lines += [f"| {n} | {r['ms']:.1f} | {r['mb_per_s']:.0f} |" for n, r in threads.items()]
    codecs = report.get("codecs")
    if codecs:
        gpu = all("to_gpu_ms" in r for r in codecs.values())
        lines += [
            "",
            f"KV codecs (`ChunkStore(kv_codec=...)`), a prompt of {cfg['chunks']} read whole (the bytes the "
            "store holds: a coded store's tiers, memory included, keep the codes, which the walk decodes layer "
            "by layer on the engine's device); encoding and decoding are the format's, its checksum included, "
            "decoding every layer on the CPU"
            + ("; to the GPU: every layer copied from page-locked memory and decoded there" if gpu else "")
            + ":",
            "",
            "| KV shape, codec | bytes / token | of raw | encode (ms / chunk) | decode on the CPU (ms / chunk) | "
            + ("to the GPU (ms / chunk) | " if gpu else "")
            + " | ".join(f"read from {t} (ms / prompt)" for t in next(iter(codecs.values()))["prompt_read_s"])
            + " |",
            "|---|---:|---:|---:|---:|"
            + ("---:|" if gpu else "")
            + "---:|" * len(next(iter(codecs.values()))["prompt_read_s"]),
        ]
        for name, r in codecs.items():
            raw = codecs[name.rsplit(", ", 1)[0] + ", raw"]
            reads = " | ".join(f"{1000 * s:.0f}" for s in r["prompt_read_s"].values())
            lines.append(
                f"| {name} | {r['bytes_per_token']:.0f} | {r['bytes_per_token'] / raw['bytes_per_token']:.3f} | "
                f"{r['encode_ms']:.1f} | {r['decode_ms']:.1f} | "
                + (f"{r['to_gpu_ms']:.2f} | " if gpu else "")
                + f"{reads} |"
            )
    throttled = report.get("throttled")
    if throttled:
        lines += [
            "",
            f"Where reads bound time to first token: blend@{cfg['ratio']}, loads pipelined, every chunk read from "
            f"Redis through a link of {cfg['throttled_mb_s']:.0f} MB/s:",
            "",
            "| case | TTFT median (ms) | full / case | MB read | chunks hit |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, r in throttled.items():
            lines.append(
                f"| {name} | {r['ttft_ms']:.0f} | {r['speedup']:.2f}x | {r['mb_read']:.1f} | {r['chunks_hit']} |"
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
