"""Tuning layer: make a model blend-ready by self-distillation.

The teacher is the unchanged model reading a blend prompt with full
attention; the student is the same model with LoRA adapters (``peft``). On
the teacher's own greedy reply, teacher-forced, the student reads each prompt
both ways (``readings.py``): with every chunk read alone, as the chunk store
holds it, and with full attention; the loss is the KL divergence from the
teacher for each. Reading alone is what reuse and blending ask of the model;
keeping the full reading next to the teacher keeps the tuned model's full
prefill where the untuned one's was, so a partial recompute mixes two
readings the model knows (Block-Attention trains both the same way).

The result is a model directory (merged weights, tokenizer, chat template,
``tuning.json``, and the adapter alone in ``adapter/``) that either engine
loads like any checkpoint; its weights,
and so its fingerprint, chunk keys and calibrations, are its own.

Work goes into ``OUT.partial`` (checkpoints every ``checkpoint_every``
steps, resumable) and is renamed to ``OUT`` at the end, so an ``OUT`` that
exists is always complete.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import resource
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config import BlendConfig
from ..engines.vllm_host import process_allocator
from ..models import check_supported
from ..models.adapters import RECORD, merge_adapter
from ..models.loading import cpu_has_bfloat16, dtype_name, resolve_device, resolve_model_dir
from ..prompt import bos_id_added
from ..store import model_fingerprint
from .prompts import RECIPES, make_prompts, read_documents, squad_prompts
from .readings import block_reading, full_reading, kl, reply_logprobs
from .teacher import Teacher

ADAPTER = "adapter"
CHECKPOINT = "checkpoint"
TEACHER = "teacher"  # the teacher's replies, one file a prompt, in OUT.partial
# the projections LoRA adapts in every supported family (peft finds them by name)
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# how the learning rate moves over the steps (transformers' schedulers, without warm-up)
LR_SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class TuneOptions:
    steps: int = 300
    rank: int = 16
    alpha: int = 32
    learning_rate: float = 2e-4
    lr_schedule: str = "constant"  # or "cosine": from learning_rate down to 0 at the last step
    batch_size: int = 4
    seq_len: int = 1024  # the longest prompt plus reply, in tokens
    chunks_per_prompt: int = 4
    chunk_tokens: int = 128
    reply_tokens: int = 8  # the teacher's greedy reply, on which the KL is taken
    recipe: str = "sentence"  # "sentence" or "cloze" from the documents, or "squad" (prompts.py)
    full_weight: float = 1.0  # the full reading's share of the loss, beside the block reading's 1
    prompts: int = 400  # training prompts
    held_out: int = 24  # held-out prompts for the KL reported while training
    eval_every: int = 25
    checkpoint_every: int = 25
    target: float | None = None  # stop once the held-out block KL is at most this
    dtype: str = "auto"  # "auto": bfloat16 on CUDA and on CPUs with bfloat16 instructions, else float32
    device: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "rank", "alpha", "batch_size", "seq_len", "chunks_per_prompt", "chunk_tokens"):
            _positive_int(name, getattr(self, name))
        for name in ("reply_tokens", "prompts", "held_out", "eval_every", "checkpoint_every"):
            _positive_int(name, getattr(self, name))
        for name in ("learning_rate", "full_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.learning_rate == 0:
            raise ValueError("learning_rate must be above 0")
        if self.target is not None and (
            isinstance(self.target, bool) or not isinstance(self.target, (int, float)) or not self.target >= 0
        ):
            raise ValueError(f"target must be a number >= 0 (a held-out KL), got {self.target!r}")
        if self.recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {', '.join(RECIPES)}, got {self.recipe!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.seq_len <= self.reply_tokens + 16:
            raise ValueError(f"seq_len must leave room for a prompt beside the reply, got {self.seq_len}")


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def resolve_tune_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or cpu_has_bfloat16() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


@dataclass
class TuneResult:
    out: Path
    steps: int
    held_out_kl: list[tuple[int, float, float]] = field(default_factory=list)  # (step, block KL, full KL)
    seconds: float = 0.0
    learning_rates: list[float] = field(default_factory=list)  # the rate each step took, resumed ones included
    step_seconds: list[float] = field(default_factory=list)  # each step's time, held-out measurements left out
    # One per process the run took (a resume starts another): the step it began at, the malloc it ran
    # on and the most memory it held (CPU: resident; CUDA: torch's allocations). Per process, since a
    # long run's resident memory depends on its malloc (``__main__``) and a resume may change it.
    processes: list[dict[str, Any]] = field(default_factory=list)

    def start_process(self) -> None:
        self.processes.append({"from_step": self.steps, "malloc": process_allocator(), "peak_memory_gb": 0.0})

    def note_memory(self, device: torch.device) -> None:
        self.processes[-1]["peak_memory_gb"] = round(peak_memory_gb(device), 2)

    def summary(self) -> dict[str, Any]:
        """What the run cost, for its record: each step's time (median and slowest), and each process's
        malloc and peak memory."""
        times = sorted(self.step_seconds)
        return {
            "step_seconds_median": round(times[len(times) // 2], 2) if times else None,
            "step_seconds_max": round(times[-1], 2) if times else None,
            "processes": self.processes,
        }


class TuneError(ValueError):
    """Tuning cannot start as asked; nothing was written."""


def resumed_options(out: str | os.PathLike, given: Mapping[str, Any] | None = None) -> TuneOptions:
    """The options of the unfinished tuning into ``out`` (its checkpoint's), with the ``given`` ones (by
    field name). A given option may only equal the checkpoint's, ``steps`` aside (a resumed tuning may
    stop sooner or go on longer): resuming with other options would train on other prompts or at
    another rate than the steps done, so a TuneError names each that differs."""
    out = Path(out)
    saved = TuneOptions(**_read_meta(out.with_name(out.name + ".partial") / CHECKPOINT)["options"])
    _refuse_other_options(given or {}, saved)
    return dataclasses.replace(saved, **(given or {}))


def _refuse_other_options(given: Mapping[str, Any], saved: TuneOptions) -> None:
    differing = [
        f"{option_flag(name, value)} differs from the checkpoint's {_shown(getattr(saved, name))}"
        for name, value in given.items()
        if name != "steps" and value != getattr(saved, name)
    ]
    if differing:
        raise TuneError(f"--resume: {'; '.join(differing)}: resume with the checkpoint's options or start a new run")


def option_flag(name: str, value: object) -> str:
    """An option as the command line takes it: "--learning-rate 5e-05"."""
    return f"--{name.replace('_', '-')} {_shown(value)}"


def _shown(value: object) -> str:
    return "none" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def peak_memory_gb(device: torch.device) -> float:
    """The most memory this process has held so far: torch's allocations on CUDA, the resident set on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux, bytes on macOS
    return peak / 1e9 if sys.platform == "darwin" else peak * 1024 / 1e9


def tune(
    model: str | os.PathLike,
    documents: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    options: TuneOptions | None = None,
    questions: Sequence[str] = (),
    resume: bool = False,
    steps: int | None = None,
    progress: bool = True,
    on_eval: Callable[[int, float, float], None] | None = None,
) -> TuneResult:
    """Tune ``model`` on prompts made from ``documents`` (none for the ``squad`` recipe) and write the tuned
    model directory to ``out`` (see the module's docstring). ``resume``:
    continue from the checkpoint in ``out + ".partial"``, with its options;
    ``options`` given with it must equal them, but for ``steps``
    (``resumed_options``). ``steps``: the total steps, in place of the
    options' (or the checkpoint's): a resumed tuning may stop sooner or go on
    longer."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, get_scheduler

    out = Path(out)
    work = out.with_name(out.name + ".partial")
    if out.exists():
        raise TuneError(f"{str(out)!r} exists: choose a new --out (a finished tuning is never overwritten)")
    model_dir = resolve_model_dir(model)
    check_supported(AutoConfig.from_pretrained(model_dir))
    fingerprint = model_fingerprint(model_dir)
    checkpoint = work / CHECKPOINT
    if resume:
        meta = _read_meta(checkpoint)
        if meta["base_fingerprint"] != fingerprint:
            raise TuneError(
                f"--resume: the checkpoint in {str(checkpoint)!r} was made from {meta['base_model']!r} "
                f"(fingerprint {meta['base_fingerprint'][:12]}), not from {str(model)!r} ({fingerprint[:12]})"
            )
        saved = TuneOptions(**meta["options"])
        if options is None:
            options = saved
        else:  # never replaced silently: options given must be the checkpoint's, but for the steps
            _refuse_other_options(dataclasses.asdict(options), saved)
    elif work.exists() and set(os.listdir(work)) - {TEACHER}:  # the teacher's replies alone: nothing to resume
        raise TuneError(f"{str(work)!r} holds an unfinished tuning: pass --resume to continue it, or remove it")
    if options is None:
        options = TuneOptions()
    if steps is not None:
        options = dataclasses.replace(options, steps=steps)
    if options.recipe == "squad" and (documents or questions):
        raise TuneError(
            "the squad recipe asks SQuAD train's own questions about its own paragraphs: leave out "
            "--documents and --questions"
        )
    texts = read_documents(documents) if options.recipe != "squad" else []
    device = resolve_device(options.device)
    dtype = resolve_tune_dtype(options.dtype, device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    bos = bos_id_added(tokenizer)
    shape: dict[str, Any] = {
        "chunks_per_prompt": options.chunks_per_prompt,
        "max_prompt_tokens": options.seq_len - options.reply_tokens,
        "count": options.prompts,
        "held_out": options.held_out,
        "seed": options.seed,
    }
    if options.recipe == "squad":
        prompts = squad_prompts(tokenizer, BlendConfig().separator, **shape)
    else:
        prompts = make_prompts(
            texts,
            tokenizer,
            BlendConfig().separator,
            chunk_tokens=options.chunk_tokens,
            questions=questions,
            recipe=options.recipe,
            **shape,
        )
    torch.manual_seed(options.seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(device)
    base.config.use_cache = False
    if resume:
        model_ = PeftModel.from_pretrained(base, str(checkpoint), is_trainable=True)
    else:
        lora = LoraConfig(
            r=options.rank, lora_alpha=options.alpha, lora_dropout=0.0, target_modules=TARGET_MODULES, bias="none"
        )
        model_ = get_peft_model(base, lora)
    params = [p for p in model_.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=options.learning_rate, weight_decay=0.0)
    result = TuneResult(out, 0)  # the progress so far, checkpointed
    if resume:
        saved = torch.load(checkpoint / "state.pt", weights_only=True)
        optimizer.load_state_dict(saved["optimizer"])
        done_so_far = dict(saved["progress"])
        if "peak_memory_gb" in done_so_far:  # a checkpoint of 0.1.0 kept the whole run's peak, malloc unknown
            done_so_far["processes"] = [
                {"from_step": 0, "malloc": None, "peak_memory_gb": done_so_far.pop("peak_memory_gb")}
            ]
        result = TuneResult(out, **done_so_far)
        if result.steps > options.steps:
            raise TuneError(f"--steps {options.steps}: the checkpoint has done {result.steps} steps already")
        random.setstate(saved["python_rng"])
        torch.set_rng_state(saved["torch_rng"])
    # Made after the optimizer's state is loaded, which keeps the schedule's starting rate; then
    # moved to the steps done. A resumed cosine with other --steps decays over the new total.
    schedule = get_scheduler(options.lr_schedule, optimizer, num_warmup_steps=0, num_training_steps=options.steps)
    with warnings.catch_warnings():  # torch warns of a schedule stepped before its optimizer: here, on purpose
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(result.steps):
            schedule.step()
    result.start_process()

    teacher = Teacher(model_, tokenizer, options.reply_tokens, work / TEACHER, fingerprint)
    held_out = [(tp, *teacher(tp)) for tp in prompts.held_out]
    order = random.Random(options.seed + 1)
    started = time.perf_counter() - result.seconds

    def evaluate() -> tuple[float, float]:
        model_.eval()
        with torch.no_grad():
            block = full = 0.0
            for tp, reply, target in held_out:
                target = target.to(device)
                block += kl(target, reply_logprobs(model_, [block_reading(tp, reply, bos)], dtype)).item()
                full += kl(target, reply_logprobs(model_, [full_reading(tp, reply)], dtype)).item()
        model_.train()
        return block / len(held_out), full / len(held_out)

    if not result.held_out_kl:
        result.held_out_kl.append((0, *evaluate()))
    bar = tqdm(total=options.steps, initial=result.steps, desc="tuning", unit="step", disable=not progress)
    last = result.held_out_kl[-1]
    bar.set_postfix(held_out_kl=f"{last[1]:.4f}")
    model_.train()
    while result.steps < options.steps:
        # the same batches after a resume: the order is drawn from the seed and the step
        order.seed(options.seed * 1_000_003 + result.steps)
        batch = [prompts.train[order.randrange(len(prompts.train))] for _ in range(options.batch_size)]
        step_started = time.perf_counter()
        taught = [(tp, *teacher(tp)) for tp in batch]
        optimizer.zero_grad(set_to_none=True)
        loss = backward_batch(model_, taught, bos, dtype, options.full_weight)
        result.learning_rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
        result.step_seconds.append(time.perf_counter() - step_started)
        result.note_memory(device)
        result.steps += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", held_out_kl=f"{result.held_out_kl[-1][1]:.4f}")
        done = result.steps == options.steps
        if result.steps % options.eval_every == 0 or done:
            result.held_out_kl.append((result.steps, *evaluate()))
            if on_eval is not None:
                on_eval(*result.held_out_kl[-1])
            if options.target is not None and result.held_out_kl[-1][1] <= options.target:
                done = True
        if result.steps % options.checkpoint_every == 0 or done:
            result.seconds = time.perf_counter() - started
            _save_checkpoint(model_, optimizer, result, checkpoint, model, fingerprint, options)
        if done:
            break
    bar.close()
    result.seconds = time.perf_counter() - started
    _write_model(model_, work / "model", model_dir, model, fingerprint, options, result, dtype, len(prompts.train))
    (work / "model").rename(out)
    shutil.rmtree(work)
    return result


def backward_batch(model, taught, bos: int | None, dtype: torch.dtype, full_weight: float) -> float:
    """Accumulate into ``model``'s gradients the gradient of a batch's loss (the block reading's mean
    KL over every reply row of the batch, plus ``full_weight`` times the full reading's), and return
    that loss. ``taught``: (prompt, reply, the teacher's log-probabilities) for each prompt. One reading
    of one prompt at a time, each backward before the next forward: one reading's activations in
    memory, not the batch's two readings' (Qwen2.5-Coder-1.5B at 4 prompts a step went past 24 GiB)."""
    device = next(model.parameters()).device
    rows = sum(len(target) for *_, target in taught)
    loss = 0.0
    for tp, reply, target in taught:
        target = target.to(device)
        for reading, weight in ((block_reading(tp, reply, bos), 1.0), (full_reading(tp, reply), full_weight)):
            if weight:
                part = kl(target, reply_logprobs(model, [reading], dtype)) * (weight * len(target) / rows)
                part.backward()
                loss += part.item()
    return loss


def _save_checkpoint(model, optimizer, result: TuneResult, checkpoint: Path, base_model, fingerprint, options) -> None:
    """The adapters, the optimizer and the progress, written beside the old
    checkpoint and swapped in, so a stop at any moment leaves one whole."""
    checkpoint.parent.mkdir(parents=True, exist_ok=True)  # the work folder, made at the first checkpoint
    new = checkpoint.with_name(CHECKPOINT + ".new")
    shutil.rmtree(new, ignore_errors=True)
    model.save_pretrained(str(new))
    torch.save(
        {
            "optimizer": optimizer.state_dict(),
            "progress": {
                "steps": result.steps,
                "held_out_kl": result.held_out_kl,
                "seconds": result.seconds,
                "learning_rates": result.learning_rates,
                "step_seconds": result.step_seconds,
                "processes": result.processes,
            },
            "python_rng": random.getstate(),
            "torch_rng": torch.get_rng_state(),
        },
        new / "state.pt",
    )
    meta = {"base_model": str(base_model), "base_fingerprint": fingerprint, "options": dataclasses.asdict(options)}
    # how far the run is, readable while it runs: the steps, the held-out KL so far and what it costs
    meta["progress"] = {"steps": result.steps, "held_out_kl": result.held_out_kl, **result.summary()}
    (new / "meta.json").write_text(json.dumps(meta, indent=1))
    old = checkpoint.with_name(CHECKPOINT + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if checkpoint.exists():
        checkpoint.rename(old)
    new.rename(checkpoint)
    shutil.rmtree(old, ignore_errors=True)


def _read_meta(checkpoint: Path) -> dict:
    try:
        meta = json.loads((checkpoint / "meta.json").read_text())
        if not {"base_model", "base_fingerprint", "options"} <= set(meta) or not (checkpoint / "state.pt").is_file():
            raise ValueError("fields are missing")
        return meta
    except (OSError, ValueError) as exc:
        raise TuneError(f"--resume: no readable checkpoint in {str(checkpoint)!r} ({exc})") from exc


def _write_model(model, path: Path, base_dir, base_model, fingerprint, options, result, dtype, train_prompts) -> None:
    """The LoRA adapter alone in ``adapter/`` with ``tuning.json`` (a few MB:
    what a package ships), and beside them the base model with the adapter
    merged in, in the base's own dtype (``models.adapters.merge_adapter``)."""
    record = {
        "base_model": str(base_model),
        "base_fingerprint": fingerprint,
        "method": "LoRA self-distillation: block and full readings against the untuned model's full reading",
        "options": dataclasses.asdict(options),
        "dtype": dtype_name(dtype),
        "steps": result.steps,
        "train_prompts": train_prompts,
        "held_out_kl": [{"step": s, "block": b, "full": f} for s, b, f in result.held_out_kl],
        "seconds": round(result.seconds, 1),
        **result.summary(),
    }
    adapter = path / ADAPTER
    model.save_pretrained(str(adapter))
    (adapter / RECORD).write_text(json.dumps(record, indent=1) + "\n")
    merge_adapter(base_dir, adapter, path)
