"""The README's numbers, rendered from the committed results in ``docs/results/``.

    python -m benchmarks readme [--check]

Rewrites the blocks of README.md between ``<!-- readme:NAME -->`` and
``<!-- /readme:NAME -->`` (``commands``: the two commands and their times, from
newcomer.json; ``gains``: what blending gains, from the calibration, ttft, vllm
and GPU results). ``--check`` changes nothing: it prints the difference and exits
1 when the README is not what this script renders.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path

from blend_integrations.calibration import held_out_bounds, held_out_shortfalls

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "docs" / "results"

# The calibrated models, in table order: file label -> the name the README gives it.
CALIBRATED = {
    "reader": "[bundled reader](docs/concepts.md#bundled-reader)",
    "smollm2": "SmolLM2-135M-Instruct",
    "gemma3-270m": "Gemma 3 270M (base)",
    "qwen2.5-coder-0.5b": "Qwen2.5-Coder-0.5B-Instruct",
    "qwen2.5-coder-1.5b": "Qwen2.5-Coder-1.5B-Instruct",
}
ENGINES = {"transformers": "transformers", "vllm": "vLLM"}
RANDOM = "[random weights](docs/concepts.md#random-weights)"
GPU_CONTEXT_TOKENS = 8192  # the GPU row: the run whose stored chunks come closest to this many tokens

BLOCK = re.compile(r"(<!-- readme:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /readme:(?P=name) -->)", re.DOTALL)


def load(results: Path, name: str) -> dict:
    path = results / name
    if not path.is_file():
        made_by = (
            "python -m benchmarks newcomer" if name == "newcomer.json" else "its benchmark (README.md, Benchmarks)"
        )
        raise FileNotFoundError(f"{path} is missing: the README's numbers come from it; make it with `{made_by}`")
    return json.loads(path.read_text(encoding="utf-8"))


def minutes(seconds: float) -> str:
    return f"about {max(1, round(seconds / 60))} min"


def hardware(text: str, cpus: int | None = None) -> str:
    """A short name of the machine a result was measured on: 'NVIDIA H200', '2 CPUs (AVX-512)'."""
    if text.startswith("GPU ") or "NVIDIA" in text:
        return text.removeprefix("GPU ").split(",")[0]
    found = re.search(r"(\d+) CPUs", text)
    count = int(found.group(1)) if found else cpus
    isa = "AVX-512" if "avx512f" in text else "AVX2" if "avx2" in text else ""
    name = f"{count} CPUs" if count else "CPU"
    return f"{name} ({isa})" if isa else name


def percent(share: float) -> str:
    return f"{share:.0%}"


def render_commands(results: Path) -> str:
    report = load(results, "newcomer.json")
    cfg, steps = report["config"], report["steps"]
    for step in steps:
        if steps[step]["rc"] != 0:
            raise ValueError(
                f"{results / 'newcomer.json'}: `{steps[step]['command']}` exited {steps[step]['rc']}; "
                "the README quotes times of runs that passed: run `python -m benchmarks newcomer` again"
            )
    setup = minutes(steps["install"]["seconds"])
    where = hardware(cfg["cpu"], cfg.get("cpus"))
    tests = f"({minutes(steps['test']['seconds'])})" if "test" in steps else "(not timed yet)"
    return (
        f"- `make demo`: sets up `.venv` ({setup} the first time) and answers a question through a LangChain\n"
        f"  RAG chain with blending and with full prefill ({minutes(steps['demo']['seconds'])}).\n"
        f"- `make test`: sets up the same `.venv` and runs the tests {tests}.\n"
        f"\nTimes on {where}, {cfg['date']} ([newcomer.json](docs/results/newcomer.json)).\n"
    )


# The held-out kinds of question (the calibration benchmark's ``held_out_tasks``), as the README names them.
TASK_NAMES = {"generated": "generated", "squad-dev": "SQuAD dev"}


def calibration_row(results: Path, label: str, engine: str) -> tuple[list[str], dict]:
    report = load(results, f"calibration-{label}-{engine}.json")
    cfg, held = report["config"], report["held_out"]
    # reports from before SQuAD held out one kind of question: the generated one
    tasks = report.get("held_out_tasks") or {"generated": held}
    sizes = cfg.get("held_out_tasks") or {"generated": cfg["held_out_questions"]}
    (fallback_key,) = [key for key in held if key.startswith("fallback")]
    full, default, fallback = held["full"], held["default (calibrated)"], held[fallback_key]
    # the chosen policy on each kind of question, with its lower bound (the shipping rule's)
    rows = {name: {**table["default (calibrated)"], "n": sizes[name]} for name, table in tasks.items()}
    if report["calibration"]["ratio"] >= 1.0 and report["calibration"]["guard"] is None:
        matched = f"{default['ttft_speedup']:.2f}x: needs full prefill"
    elif short := held_out_shortfalls(rows, cfg.get("target", 0.95), cfg["confidence"]):
        # the package ships full prefill (PackagedCalibration.under_shipping_rule)
        fell = ", ".join(
            f"{percent(r['agreement'])} agree (at least {percent(r['agreement_lower'])}) on {TASK_NAMES[name]}"
            for name, r in short.items()
        )
        matched = f"1.00x: needs full prefill (the policy chosen on the probes, {default['ttft_speedup']:.2f}x, fell short held out: {fell})"
    else:
        agree = [
            f"{percent(r['agreement'])} agree (at least {percent(r['agreement_lower'])})"
            + (f" on {TASK_NAMES[name]}" if len(tasks) > 1 else "")
            for name, r in held_out_bounds(rows, cfg["confidence"]).items()
        ]
        matched = f"{default['ttft_speedup']:.2f}x, " + ", ".join(agree)
    row = [
        CALIBRATED[label],
        f"{ENGINES[engine]}, {hardware(cfg['cpu'], cfg.get('cpus'))}",
        matched,
        f"{fallback['ttft_speedup']:.2f}x",
        percent(1.0 - fallback["agreement"]),
        f"{percent(fallback['right'])} ({percent(full['right'])})",
    ]
    return row, cfg | {"fallback_ratio": fallback["mean_ratio"], "held_out_sizes": sizes}


def random_row(model: str, engine: str, where: str, speedup: str) -> list[str]:
    return [f"{model}, {RANDOM}", f"{engine}, {where}", "— (no answers to match)", speedup, "—", "—"]


def chunks(text: str) -> str:
    """'6 x 512 tokens' -> '6 chunks of 512 tokens'."""
    found = re.match(r"(\d+) x (\d+) tokens", text)
    return f"{found.group(1)} chunks of {found.group(2)} tokens" if found else text


def layers(model: str) -> int:
    return int(re.search(r"(\d+) layers", model).group(1))  # type: ignore[union-attr]


def render_gains(results: Path) -> str:
    rows, configs = [], []
    for label in CALIBRATED:
        for engine in ENGINES:
            row, cfg = calibration_row(results, label, engine)
            rows.append(row)
            configs.append(cfg)
    ratios = {c["fallback_ratio"] for c in configs}
    if len(ratios) != 1:
        raise ValueError(f"the calibration results blend at several fallback ratios: {sorted(ratios)}")
    ratio = ratios.pop()

    blend = f"blend@{ratio:g}"
    ttft, vllm = load(results, "ttft.json"), load(results, "vllm.json")
    for engine, report, timed in (("transformers", ttft, ttft["results"]), ("vLLM", vllm, vllm["ttft"])):
        model = f"{layers(report['config']['model'])}-layer Llama shape"
        rows.append(random_row(model, engine, hardware(report["config"]["machine"]), f"{timed[blend]['speedup']:.2f}x"))
    gpu = load(results, "gpu-h200-ttft-llama3-8b.json")["runs"]
    run = min(gpu, key=lambda r: abs(r["results"][blend]["cached_tokens"] - GPU_CONTEXT_TOKENS))
    gpu_cfg, gpu_blend = run["config"], run["results"][blend]
    gpu_model = "Llama-3-8B's shape" if "llama3-8b" in gpu_cfg["model"] else f"{layers(gpu_cfg['model'])}-layer Llama"
    speedup = f"{gpu_blend['speedup']:.2f}x ({round(gpu_cfg['prompt_tokens'] / 1024)}k tokens)"
    rows.append(random_row(f"{gpu_model} in {gpu_cfg['dtype']}", "transformers", hardware(gpu_cfg["machine"]), speedup))

    first = configs[0]
    for cfg in configs:
        for key in ("tokens_compared", "target"):
            if cfg[key] != first[key]:
                raise ValueError(f"the calibration results differ in {key}: {cfg[key]} and {first[key]}")
    dates = sorted({c["date"] for c in configs} | {ttft["config"]["date"], vllm["config"]["date"], gpu_cfg["date"]})
    tokens = first["tokens_compared"]
    header = [
        "model",
        "engine, hardware",
        "speedup at matched quality",
        f"speedup at {ratio:g}",
        f"answers changed at {ratio:g}",
        f"right at {ratio:g} (full prefill)",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 2 + "---:|" * 4]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    span = dates[0] + (f" to {dates[-1]}" if dates[-1] != dates[0] else "")
    lines += [
        "",
        f"Speedup: full prefill's time to first token over blend's. Matched quality: at the ratio that\n"
        f"[calibration](docs/concepts.md#calibration) chose to keep full prefill's first {tokens} tokens on"
        f' {percent(first["target"])} of prompts; "at least": the\n{percent(first["confidence"])} lower bound of'
        f" the agreement on questions calibration never saw ({held_out_words(configs)}).\n"
        f"Answers changed: the share of them whose first {tokens} tokens differ from full prefill's; right: the share"
        " answered right\n(SQuAD: F1). The random-weight rows time real model shapes on prompts of"
        f" {chunks(ttft['config']['chunks'])} (CPU) and {chunks(gpu_cfg['chunks'])} (GPU).\nMeasured {span}:"
        " [calibration](docs/results/calibration.md), [real questions](docs/results/squad.md),"
        " [TTFT](docs/results/ttft.md), [vLLM](docs/results/vllm.md),"
        " [GPU](docs/results/gpu-h200.md).",
        "",
    ]
    return "\n".join(lines)


def held_out_words(configs: list[dict]) -> str:
    """The held-out questions in words: those of the rows calibrated before SQuAD (one kind) and after (two)."""
    old = sorted({c["held_out_sizes"]["generated"] for c in configs if len(c["held_out_sizes"]) == 1})
    new = [c["held_out_sizes"] for c in configs if len(c["held_out_sizes"]) > 1]
    parts = []
    if old:
        parts.append(
            f"{'/'.join(map(str, old))} generated ones; for the real models the oracle benchmark's 12, "
            "which chose the selections calibration tries, among them"
        )
    if new:
        kinds = {name: sorted({sizes[name] for sizes in new}) for name in new[0]}
        listed = " and ".join(f"{'/'.join(map(str, n))} {TASK_NAMES[name]}" for name, n in kinds.items())
        parts.append(f"where a kind is named: {listed}, on a seed and articles no run had used")
    return "; ".join(parts)


RENDERERS = {"commands": render_commands, "gains": render_gains}


def render(readme_text: str, results: Path = RESULTS) -> str:
    """``readme_text`` with every generated block rendered anew from ``results``."""
    found = {m.group("name") for m in BLOCK.finditer(readme_text)}
    missing = set(RENDERERS) - found
    if missing:
        raise ValueError(f"README.md has no block {sorted(missing)} (<!-- readme:NAME --> ... <!-- /readme:NAME -->)")
    unknown = found - set(RENDERERS)
    if unknown:
        raise ValueError(f"README.md has blocks this script does not render: {sorted(unknown)}")
    return BLOCK.sub(lambda m: m.group(1) + RENDERERS[m.group("name")](results) + m.group(4), readme_text)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks readme", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if README.md is not current")
    args = parser.parse_args(argv)
    text = README.read_text(encoding="utf-8")
    rendered = render(text)
    if args.check:
        if rendered != text:
            diff = difflib.unified_diff(
                text.splitlines(keepends=True), rendered.splitlines(keepends=True), "README.md", "rendered"
            )
            sys.stdout.writelines(diff)
            sys.exit(1)
        print("README.md is current")
    elif rendered != text:
        README.write_text(rendered, encoding="utf-8")
        print(f"written: {README}")
    else:
        print("README.md is current")
