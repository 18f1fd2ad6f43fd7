"""vLLM blend pass by phase, beside vLLM's own forward on the same prompt.

One prompt (the TTFT benchmark's 6 chunks x 512 tokens on the 16-layer model,
or ``--model``), run through the embedded vLLM engine in this process (vLLM's
engine core in-process, so one profiler sees the worker), as full prefill,
blend at ``--ratio``, blend at 1.0 (every token through the walk) and reuse.

Every phase is exclusive time under ``torch.profiler``: the walk's own marks
(``walk.*`` in fusion/walk.py, ``blend.*`` in the connector) and marks this
script puts on vLLM's modules (projections, norms, rotary, attention, MLP), which
both vLLM's forward and the walk call. So the same rows compare the walk's ops
with vLLM's for the same tokens and context. Wall times are measured without
the profiler; times under it are a little longer.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from blend_integrations.engines import load_engine
from blend_integrations.engines.vllm_contract import WALK_ATTENTION
from blend_integrations.store import ChunkStore

from . import (
    MODEL_HELP,
    bench_model,
    compute_ceiling,
    machine,
    scratch_dir,
    shuffled_prompts,
    time_cases,
    walk_attention,
    write_results,
)
from .ttft import make_chunks

# vLLM module attribute -> phase
MODULE_PHASES = {
    "embed_tokens": "embed",
    "input_layernorm": "norms",
    "post_attention_layernorm": "norms",
    "norm": "norms",
    "qkv_proj": "q/k/v projection",
    "o_proj": "o projection",
    "rotary_emb": "RoPE",
    "attn": "attention (vLLM kernel, writes KV)",
    "mlp": "MLP",
}
# walk / connector mark -> phase
MARK_PHASES = {
    "walk.qkv": "layout and glue",
    "walk.finish": "layout and glue",
    "walk.rope": "RoPE",
    "walk.load_kv": "load reused KV",
    "walk.rerotate": "re-rotate reused keys",
    "walk.check": "check layer (deviation, selection)",
    "walk.kv_write": "write KV (dense cache)",
    "walk.query_scoring": "query scoring",
    "walk.attention": "attention (walk)",
    "walk.paged_write": "write KV (paged cache)",
    "blend.pass": "store, plan, Python",
    "vllm.layer": "layout and glue",
    "vllm.model": "layout and glue",
}
PHASE_ORDER = [
    "embed",
    "norms",
    "q/k/v projection",
    "RoPE",
    "load reused KV",
    "re-rotate reused keys",
    "check layer (deviation, selection)",
    "query scoring",
    "attention (walk)",
    "attention (vLLM kernel, writes KV)",
    "write KV (dense cache)",
    "write KV (paged cache)",
    "o projection",
    "MLP",
    "layout and glue",
    "store, plan, Python",
]


def _mark(module: torch.nn.Module, name: str) -> None:
    forward = module.forward

    def marked(*args, **kwargs):
        with record_function(name):
            return forward(*args, **kwargs)

    module.forward = marked


def mark_modules(model) -> None:
    """Profiler marks on vLLM's modules, which its forward and the walk both call."""
    _mark(model.model, "vllm.model")
    for name in ("embed_tokens", "norm"):
        _mark(getattr(model.model, name), f"vllm.{name}")
    for layer in model.model.layers:
        _mark(layer, "vllm.layer")
        for name in ("input_layernorm", "post_attention_layernorm", "mlp"):
            _mark(getattr(layer, name), f"vllm.{name}")
        for name in ("qkv_proj", "o_proj", "rotary_emb", "attn"):
            _mark(getattr(layer.self_attn, name), f"vllm.{name}")


def phase_of(name: str) -> str | None:
    if name.startswith("vllm."):
        return MODULE_PHASES.get(name[5:]) or MARK_PHASES.get(name)
    return MARK_PHASES.get(name)


def phases(prof) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Exclusive milliseconds per phase, by scope: "blend pass" (inside the
    connector's pass) or "vLLM forward" (the model's own forward); and each
    scope's total."""
    marks = [e for e in prof.events() if phase_of(e.name) is not None]
    ids = {id(e) for e in marks}

    def mark_parent(e):
        p = e.cpu_parent
        while p is not None and id(p) not in ids:
            p = p.cpu_parent
        return p

    def scope(e):
        top, p = e, mark_parent(e)
        while p is not None:
            top, p = p, mark_parent(p)
        return "blend pass" if top.name == "blend.pass" else "vLLM forward"

    child_time: dict[int, float] = defaultdict(float)
    for e in marks:
        p = mark_parent(e)
        if p is not None:
            child_time[id(p)] += e.time_range.elapsed_us()
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    totals: dict[str, float] = defaultdict(float)
    for e in marks:
        ms = e.time_range.elapsed_us() / 1000
        s = scope(e)
        out[s][phase_of(e.name)] += ms - child_time[id(e)] / 1000
        if mark_parent(e) is None:
            totals[s] += ms
    return out, totals


def profiled_run(engine, prompt, **options):
    """One request, stepped on this thread (the profiler sees only the thread
    that starts it) while the engine's stepping thread waits for its lock."""
    from vllm.inputs import TokensPrompt

    request = engine._request(prompt, max_tokens=1, **options)
    params = engine._sampling_params(request)
    with engine._lock, profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.llm.generate([TokensPrompt(prompt_token_ids=request.prompt.token_ids)], params, use_tqdm=False)
    return phases(prof)


def run(args) -> dict:
    model_dir, label, suffix = bench_model(args.model, layers=args.layers)
    # vLLM's engine core in this process: one profiler sees the blend pass and vLLM's forward.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    engine = load_engine(
        model_dir,
        backend="vllm",
        dtype=args.dtype,
        store=ChunkStore(scratch_dir("blend-profile-")),
        max_model_len=args.chunks * args.chunk_tokens + 512,
        kv_cache_gib=args.kv_cache_gib,
        walk_attention=args.walk_attention,
    )
    from blend_integrations.engines import vllm_plugin

    model = vllm_plugin.loaded_model()
    mark_modules(model)
    chunks = make_chunks(engine.tokenizer, args.chunks, args.chunk_tokens)
    engine.warm(chunks)
    prompt = shuffled_prompts(chunks)
    cases = [
        ("full", "full", None),
        (f"blend@{args.ratio}", "blend", args.ratio),
        ("blend@1.0", "blend", 1.0),
        ("reuse", "reuse", None),
    ]
    wall, usage, apart = time_cases(engine, prompt, cases, args.repeats)
    for name, count in apart.items():
        if count:  # not timed: the medians are of the rounds that blended
            print(f"{name}: {count} of {args.repeats} rounds fell back or ran as full prefill, not timed")
    profiled = {}
    for name, mode, ratio in cases:
        by_scope, totals = profiled_run(engine, prompt(), mode=mode, recompute_ratio=ratio)
        profiled[name] = {"scopes": {s: dict(v) for s, v in by_scope.items()}, "totals_ms": dict(totals)}
    layer = model.model.layers[0].self_attn.attn
    attention = walk_attention(engine) + (f", ISA {layer.isa}" if hasattr(layer, "isa") else "")
    measured_on = machine(engine)  # while its workers run
    dtype = str(engine.llm.llm_engine.model_config.dtype).replace("torch.", "")
    prompt_tokens = usage["full"].prompt_tokens
    engine.close()

    full, reuse = (statistics.median(wall[n]) for n in ("full", "reuse"))
    layers = model.config.num_hidden_layers
    u = usage[f"blend@{args.ratio}"]
    check = engine.config.check_layers[0]
    ceiling = compute_ceiling("blend", u, layers, check)
    predicted = reuse + (full - reuse) / ceiling
    import vllm

    return {
        "config": {
            "model": label,
            "results": "profile"
            + suffix
            + ("" if args.dtype == "float32" else f"-{args.dtype}")
            + ("" if args.walk_attention == "auto" else f"-{args.walk_attention}"),
            "machine": measured_on,
            "vllm": vllm.__version__,
            "attention": attention,
            "dtype": dtype,
            "torch_threads": torch.get_num_threads(),
            "prompt_tokens": prompt_tokens,
            "chunks": f"{args.chunks} x {args.chunk_tokens} tokens",
            "repeats": args.repeats,
            "date": time.strftime("%Y-%m-%d"),
        },
        "wall_ms": {n: 1000 * statistics.median(v) for n, v in wall.items()},
        "predicted": {
            "share": 1 / ceiling,
            "ms": 1000 * predicted,
            "blend_over_predicted": statistics.median(wall[f"blend@{args.ratio}"]) / predicted,
            "full_over_blend": full / statistics.median(wall[f"blend@{args.ratio}"]),
            "walk_at_1_over_full": statistics.median(wall["blend@1.0"]) / full,
        },
        "profiled": profiled,
    }


def render(report: dict) -> str:
    c, p = report["config"], report["predicted"]
    names = list(report["wall_ms"])
    lines = [
        f"Model: {c['model']}; {c['dtype']}; vLLM {c['vllm']}, attention {c['attention']}; {c['machine']}, "
        f"{c['torch_threads']} threads; {c['chunks']}, {c['prompt_tokens']} prompt tokens; {c['date']}.",
        "",
        f"Wall time to first token, median of {c['repeats']} (no profiler):",
        "",
        "| " + " | ".join(names) + " |",
        "|" + "---:|" * len(names),
        "| " + " | ".join(f"{report['wall_ms'][n]:.0f} ms" for n in names) + " |",
        "",
        f"Predicted blend = reuse + share x (full - reuse), share {p['share']:.3f} (the token-layers computed, "
        f"1 / compute ceiling): {p['ms']:.0f} ms; "
        f"blend / predicted **{p['blend_over_predicted']:.2f}x**; full / blend **{p['full_over_blend']:.2f}x**; "
        f"the walk at 1.0 / vLLM's full prefill: **{p['walk_at_1_over_full']:.2f}x**.",
        "",
        'Exclusive time per phase under the profiler (ms; one run each). "blend pass" is the connector\'s '
        "pass before vLLM's forward; \"vLLM forward\" is vLLM's own model forward (all tokens in full prefill, "
        "the last token after a blend pass):",
        "",
    ]
    columns = [(n, s) for n in names for s in ("blend pass", "vLLM forward") if s in report["profiled"][n]["scopes"]]
    lines += [
        "| phase | " + " | ".join(f"{n}: {s}" for n, s in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for phase in PHASE_ORDER:
        cells = [report["profiled"][n]["scopes"][s].get(phase) for n, s in columns]
        if any(cells):
            lines.append(f"| {phase} | " + " | ".join("" if v is None else f"{v:.0f}" for v in cells) + " |")
    lines.append(
        "| **total** | "
        + " | ".join(f"**{report['profiled'][n]['totals_ms'].get(s, 0):.0f}**" for n, s in columns)
        + " |"
    )
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks profile", description=__doc__.splitlines()[0])
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--chunks", type=int, default=6)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kv-cache-gib", type=int, default=2)
    p.add_argument("--walk-attention", choices=WALK_ATTENTION, default="auto", help="how the blend pass attends")
    p.add_argument("--out", default="docs/results")
    args = p.parse_args(argv)
    report = run(args)
    text = render(report)
    print(text)
    if args.out:
        model = f" --model {args.model}" if args.model else ""
        dtype = "" if args.dtype == "float32" else f" --dtype {args.dtype}"
        dtype += "" if args.walk_attention == "auto" else f" --walk-attention {args.walk_attention}"
        write_results(
            args.out,
            report["config"]["results"],
            "vLLM blend pass by phase, beside vLLM's own forward",
            text,
            report,
            command=f"`python -m benchmarks profile{model}{dtype}`.",
        )
