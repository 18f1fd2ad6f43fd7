"""Benchmarks: ``python -m benchmarks <part>``."""

import argparse
import atexit
import json
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from blend_integrations.calibration.journal import cpu_name
from blend_integrations.config import BlendConfig
from blend_integrations.cost import Shape, full_token_layers, token_layers
from blend_integrations.engines.vllm_host import process_allocator
from blend_integrations.prompt import BlendPrompt

# Benchmarks ask one request after another and time them: a live check (``BlendConfig.quality_check``)
# running in the gap would share the CPU with the next one. They run "auto" without it; ``live-check``
# measures the check itself.
UNCHECKED = BlendConfig(quality_check=0.0)


def machine(vllm_engine=None) -> str:
    """What the numbers were measured on: the GPU, or the CPU with its vector
    extensions (vLLM's and torch's CPU speed depend on them), its count and
    the malloc this process runs on, and ``vllm_engine``'s workers'."""
    import torch

    if torch.cuda.is_available():
        return f"GPU {torch.cuda.get_device_name()}"
    if vllm_engine is not None:
        return f"{machine()}, vLLM's workers on malloc {vllm_engine.llm.collective_rpc('blend_allocator')[0]}"
    return f"CPU {cpu_name()}, malloc {process_allocator()}"


def walk_attention(engine) -> str:
    """vLLM's attention backend and how the blend pass attends, with what
    ``walk_attention="auto"`` measured to choose (``blend_attention``)."""
    a = engine.llm.collective_rpc("blend_attention")[0]
    how = "its kernel" if a["kernel"] else "SDPA"
    if a["probe"]:
        how += f", measured {a['probe']['kernel_ms']:.1f} ms kernel against {a['probe']['sdpa_ms']:.1f} ms SDPA"
    return f"{a['backend']} (blend pass: {how})"


def setup_line(cfg: dict) -> str:
    """The start of a result's first line: model, dtype, device, threads, prompt."""
    return (
        f"Model: {cfg['model']}; {cfg['dtype']} on {cfg['device']} ({cfg['torch_threads']} threads); "
        + (f"{cfg['machine']}; " if "machine" in cfg else "")
        + f"{cfg['chunks']}, {cfg['prompt_tokens']} prompt tokens; "
    )


def add_model_arguments(parser: argparse.ArgumentParser, *, repeats: int = 7) -> None:
    """The options of the benchmarks that time a random-weight model: its
    shape, the prompt's chunks, the rounds (``repeats`` by default), dtype and device."""
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, help="the MLP's width (default 3 x hidden)")
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        help="a named model shape instead of --layers/--hidden/--heads/--kv-heads/--intermediate",
    )
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")


def model_options(args: argparse.Namespace) -> dict:
    """``bench_model``'s options from the flags of ``add_model_arguments``."""
    return {
        name: getattr(args, name)
        for name in ("layers", "hidden", "heads", "kv_heads", "intermediate", "shape", "dtype")
    }


# Named shapes of random-weight models (the vocabulary is the local tokenizer's 2,048).
SHAPES = {
    "llama3-8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336),
}

MODEL_HELP = "smollm2, gemma3-270m, or a checkpoint directory, instead of the random-weight model"


def bench_model(
    model: str | None,
    *,
    layers: int = 16,
    hidden: int = 512,
    heads: int = 8,
    kv_heads: int = 2,
    intermediate: int | None = None,
    shape: str | None = None,
    context: int = 8192,
    dtype: str = "float32",
) -> tuple[str, str, str]:
    """(checkpoint directory, description, suffix of the results' file names) of
    a timing bench's model: a random-weight Llama of the given shape (speed is a
    property of the architecture, not of the weights), or ``model``."""
    if model is None:
        from tests.fixtures.local_models import cached_model_dir

        if shape is not None:
            layers, hidden, heads, kv_heads, intermediate = (
                SHAPES[shape][k] for k in ("layers", "hidden", "heads", "kv_heads", "intermediate")
            )
        path = cached_model_dir(
            num_layers=layers,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=kv_heads,
            intermediate_size=intermediate,
            context=context,
            # a bf16 run of a large shape stores its weights in bf16 (half the disk and load time)
            dtype="bfloat16" if dtype in ("bfloat16", "bf16") and shape else "float32",
        )
        label = f"llama, {layers} layers, hidden {hidden}, {heads} heads, {kv_heads} KV heads"
        label += f", MLP {intermediate}" if intermediate else ""
        label += f" ({shape}'s shape)" if shape else ""
        return str(path), label + ", random weights", f"-{shape}" if shape else ""
    if model == "smollm2":
        from blend_integrations.models.smollm2 import LABEL, smollm2_dir

        return str(smollm2_dir()), f"{LABEL}: llama, 30 layers, hidden 576, 9 heads, 3 KV heads", "-smollm2"
    if model == "gemma3-270m":
        from blend_integrations.models.packaged import GEMMA3_270M

        shape = "gemma3_text, 18 layers (15 with a 512-token window), hidden 640, 4 heads of 256, 1 KV head"
        return str(GEMMA3_270M.checkpoint()), f"{GEMMA3_270M.label}: {shape}", "-gemma3-270m"
    return model, model, "-" + Path(model).name


def compute_ceiling(mode: str, usage, layers: int, check_layer: int, selection: str = "deviation") -> float:
    """The most a mode can gain over full prefill by computing less (DESIGN section 5): full
    prefill's token-layers over the mode's, by the package's one cost model
    (``blend_integrations.cost``, the walk's own count), for the prompt ``usage`` describes
    (its prompt, cached and recomputed tokens). A blend recomputes ``recomputed_tokens`` of the
    cached ones past ``check_layer``; a selection by the query ("query", "mixed") first runs a
    reuse pass. Full prefill computes every layer of every token on both engines (the transformers
    engine's is the walk at ratio 1). A pass's fixed cost is not counted: this is the ceiling."""
    if mode == "full":
        return 1.0
    shape = Shape(usage.prompt_tokens, usage.cached_tokens)
    share = usage.recomputed_tokens / shape.reused if shape.reused else 0.0
    schedule = None if mode == "reuse" else [(check_layer, share)]
    return full_token_layers(shape, layers) / token_layers(shape, layers, schedule, selection != "deviation")


def shuffled_prompts(chunks: list[str], seed: int = 0) -> Callable[[], BlendPrompt]:
    """Prompts of the timing benches: the chunks in a new order at every call,
    between the same system text and question."""
    rng = random.Random(seed)
    prefix = "You are a helpful assistant. Answer from the documents."
    suffix = "Question: which company was founded in the river city, and when? Answer:"

    def prompt() -> BlendPrompt:
        order = chunks[:]
        rng.shuffle(order)
        return BlendPrompt(prefix, order, suffix)

    return prompt


def served_as(gen) -> str:
    """How a request that asked to blend or reuse was served: "blend" (chunk
    KV reused from the store), "fallback" (the vLLM blend pass failed and vLLM
    computed the prompt: ``Generation.fallback``) or "full" (nothing reused: a
    calibration that recomputes every token, or no chunk in the store). Only a
    "blend" may be timed or scored as one."""
    if gen.fallback is not None:
        return "fallback"
    return "blend" if gen.usage.cached_tokens > 0 else "full"


def time_cases(engine, prompt: Callable[[], BlendPrompt], cases, repeats: int) -> tuple[dict, dict, dict]:
    """Each case's ``(name, mode, ratio)`` time to first token over ``repeats``
    rounds that take turns (after one more that warms up), a new prompt each
    time: ``(seconds per name, the last usage per name, rounds not timed per
    name)``. A round of a case asked to blend or reuse that was not served so
    (``served_as``: it fell back, or ran as full prefill) is never timed as
    one: it is counted apart. Raises RuntimeError when a case has no round left."""
    times: dict[str, list[float]] = {name: [] for name, *_ in cases}
    apart = dict.fromkeys(times, 0)
    usage = {}
    for round_ in range(repeats + 1):  # round 0 warms up
        for name, mode, ratio in cases:
            g = engine.generate(prompt(), max_tokens=1, mode=mode, recompute_ratio=ratio)
            if not round_:
                continue
            if mode != "full" and served_as(g) != "blend":
                apart[name] += 1
                continue
            times[name].append(g.ttft_s)
            usage[name] = g.usage
    empty = [name for name, t in times.items() if not t]
    if empty:
        raise RuntimeError(
            f"no round of {', '.join(empty)} was blended (each fell back or ran as full prefill): "
            "nothing to time as a blend"
        )
    return times, usage, apart


def scratch_dir(prefix: str) -> str:
    """A new directory for a benchmark's chunk stores, removed when the
    benchmark's process exits: a store of warmed chunks holds gigabytes."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def write_results(
    out: str | Path, part: str, title: str, text: str, report: dict, *, command: str | None = None, extra: str = ""
) -> Path:
    """A part's results under ``out``: ``{part}.json`` (the report) and
    ``{part}.md`` (title, the command that made it, the rendered text)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{part}.json").write_text(json.dumps(report, indent=2) + "\n")
    command = command or f"`make bench` (or `python -m benchmarks {part}`)."
    (out / f"{part}.md").write_text(f"# {title}\n\nCommand: {command}\n\n{text}\n{extra}")
    print(f"\nwritten: {out / (part + '.md')}, {out / (part + '.json')}")
    return out
