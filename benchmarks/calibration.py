"""Calibration, judged on questions it never saw.

Calibrates a model (``engine.calibrate``) on probes of two kinds of question
at once (``--tasks``): the package's generated task and SQuAD train, so that
the kind where a policy does worst decides. Then it asks the held-out split
(``held_out.py``: the generated task on a seed no run had used, and SQuAD
dev; no document of them was calibrated on) in every mode side by side: full
prefill; blend with the defaults, which use the calibration; blend at the
calibrated single ratio; and blend at the uncalibrated fallback ratio. For
each, pooled and by task: agreement with full prefill's first ``tokens``
greedy tokens with its lower bound, the share answered right (SQuAD: its
F1), the mean ratio used, how often the guard raised it, and time to first
token against full prefill's, measured side by side. A request not blended
(it fell back, or ran as full prefill) is counted apart.

    python -m benchmarks calibration [--model reader|smollm2|gemma3-270m|DIR] [--backend transformers|vllm]
                                     [--prompts 48] [--questions 60] [--tasks generated squad] [--package]
                                     [--record docs/results/records/calibration-TAG.json] [--rejudge]

``--prompts`` and ``--questions`` are per task. ``--package`` also writes the
record, with its held-out numbers, as the calibration the package ships for
that model and engine, only where the held-out agreement's lower bound meets
the target on every task: otherwise the file ships full prefill, and says why.
``--rejudge`` measures nothing: it applies that rule to the shipped file's own
held-out numbers (a file from before the rule) and rewrites it where it fails.
Each record measured is kept in ``--out``'s ``records/``; ``--record FILE`` judges one
on the held-out questions without calibrating again (the two parts in two sessions).
A run stopped midway resumes where it stopped when run again with the same
arguments: its store, calibration journal and held-out answers are kept in
``--out``'s ``.calibration-TAG.partial/`` until it ends. That folder is not
committed; ``--checkpoint`` keeps the journal and the held-out answers so far in
``records/`` (compressed), where a commit carries them to another checkout, and a
run there starts from them (they are used only on a machine with the same CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import json
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from blend_integrations.calibration import (
    PACKAGED_DIR,
    CalibrationError,
    CalibrationRecord,
    PackagedCalibration,
    packaged_name,
    wilson_lower,
)
from blend_integrations.config import FALLBACK_RATIO
from blend_integrations.engines import load_engine
from blend_integrations.prompt import TokenizedPrompt
from blend_integrations.quality.metrics import contains
from blend_integrations.quality.squad import load_squad, retrieval_examples, squad_f1
from blend_integrations.store import ChunkStore

from . import UNCHECKED, held_out, machine, served_as, write_results
from .calibration_pages import markdown, summary
from .quality import model_and_task, results_name
from .squad import squad_task

# The models whose calibrations ship with the package (``--package``), by the name a user knows them by.
SHIPPED = {
    "reader": "the bundled reader",
    "smollm2": "SmolLM2-135M-Instruct",
    "gemma3-270m": "Gemma 3 270M",
    "qwen2.5-coder-0.5b": "Qwen2.5-Coder-0.5B-Instruct",
    "qwen2.5-coder-1.5b": "Qwen2.5-Coder-1.5B-Instruct",
}
CALIBRATION_SEED = 30_000  # the generated task's probes; the held-out ones: held_out.GENERATED_SEED
# The kinds of question (``--tasks``): each one's name among calibration's probes and held out.
TASKS = {"generated": ("generated", "generated"), "squad": ("squad-train", "squad-dev")}
RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
# Under ``--out``: each calibration record this benchmark measured, so that its held-out part can run again
# (``--record``) in another session: on a 1.5B model the two parts take hours each.
RECORDS = "records"


@dataclass(frozen=True)
class Asked:
    """A question as the benchmark asks it: its prompt, its documents and its gold answers."""

    prompt: TokenizedPrompt
    documents: list[str]
    answers: tuple[str, ...]


def asked_questions(kind: str, split: str, n: int, engine, task, args) -> list[Asked]:
    """``n`` questions of one kind (``TASKS``) from its calibration (``"probes"``) or held-out split:
    the generated task on ``CALIBRATION_SEED`` or ``held_out.GENERATED_SEED``, SQuAD train or dev."""
    if kind == "generated":
        seed = CALIBRATION_SEED if split == "probes" else held_out.GENERATED_SEED
        examples = task.examples(n, seed, tuple(args.doc_tokens) if args.doc_tokens else None)
        return [
            Asked(task.prompt(e, engine.tokenizer, engine.config.separator), e.documents, (e.answer,)) for e in examples
        ]
    squad_split, seed = (
        ("train", held_out.SQUAD_TRAIN_SEED) if split == "probes" else (held_out.SQUAD_SPLIT, held_out.SQUAD_SEED)
    )
    examples, _ = retrieval_examples(load_squad(squad_split), n, seed=seed, n_docs=tuple(args.squad_docs))
    asking = squad_task(engine)
    return [
        Asked(asking.prompt(e, engine.tokenizer, engine.config.separator), e.documents, e.answers) for e in examples
    ]


def read_record(path: Path, engine, args) -> CalibrationRecord:
    """A record this benchmark measured before (under ``RECORDS``), checked as an engine checks a stored
    one, and measured on the probes asked now (the same tasks and number of probes)."""
    try:
        record = CalibrationRecord.from_bytes(
            path.read_bytes(), fingerprint=engine.fingerprint, dtype=engine.dtype_name, num_layers=engine.num_layers
        )
    except (OSError, CalibrationError) as e:
        raise SystemExit(f"--record {path}: {e}") from None
    tasks = {TASKS[k][0]: args.prompts for k in args.tasks}
    if record.tasks != tasks or record.engine != engine.backend or record.target != args.target:
        raise SystemExit(
            f"--record {path} was measured on {record.tasks} probes on {record.engine} at target {record.target}, "
            f"not on the {tasks} asked now on {engine.backend} at {args.target}"
        )
    return record


def right(kind: str, text: str, answers: tuple[str, ...]) -> float:
    """The generated task's answer is a name in a sentence (contained); SQuAD's is scored by its F1."""
    return contains(text, answers[0]) if kind == "generated" else squad_f1(text, answers)


def held_out_key(record: CalibrationRecord, asked: list, modes: list[str]) -> str:
    """What held-out answers are valid for: the record's policy, the questions, the modes and this
    machine; not when the record was made (a run resumed on another day replays the same record)."""
    policy = dataclasses.replace(record, date="", seconds=0.0).to_bytes()
    return hashlib.sha256(policy + json.dumps([asked, modes, machine()]).encode()).hexdigest()


def resumed(path: Path, key: str, modes) -> dict[str, dict[str, list[dict]]]:
    """The held-out answers an earlier run of the same record and questions wrote before it stopped."""
    try:
        saved = json.loads(path.read_text())
        if saved["key"] == key and all(set(rows) == set(modes) for rows in saved["rows"].values()):
            return saved["rows"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return {}


# what --checkpoint keeps of a run stopped midway (the work folder's file: the name it is kept under)
KEPT = {"journal.jsonl": "journal.jsonl.gz", "held-out.partial.json": "held-out.json.gz"}


def checkpoint_paths(args) -> dict[Path, Path]:
    """Where ``--checkpoint`` keeps each of a run's files for another checkout (committed, unlike the work folder)."""
    return {args.work / name: args.out / RECORDS / f"calibration-{args.tag}.{kept}" for name, kept in KEPT.items()}


def write_checkpoint(args) -> list[Path]:
    """The journal of a run stopped midway, and its held-out answers so far where it has some, compressed
    where a commit carries them to another checkout."""
    if not (args.work / "journal.jsonl").is_file():
        raise SystemExit(
            f"no journal to keep: {args.work / 'journal.jsonl'} does not exist (run the calibration first)"
        )
    written = []
    for work, path in checkpoint_paths(args).items():
        if not work.is_file():
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        with work.open("rb") as f, gzip.open(path.with_suffix(".tmp"), "wb", compresslevel=9) as out:
            shutil.copyfileobj(f, out)
        path.with_suffix(".tmp").replace(path)
        written.append(path)
    return written


def run(args) -> dict:
    model_dir, task, label = model_and_task(args.model)
    # what a run stopped midway resumes from (kept until it ends): its store of warmed chunks, the
    # calibration's journal of replies, and the held-out answers so far
    args.work.mkdir(parents=True, exist_ok=True)
    journal, kept = args.work / "journal.jsonl", checkpoint_paths(args)
    for work, path in kept.items():
        # another checkout's: the journal, and the held-out answers' key, check that it is this machine's
        if not work.exists() and path.is_file():
            with gzip.open(path, "rb") as f, work.open("wb") as out:
                shutil.copyfileobj(f, out)
    store = ChunkStore(str(args.work / "store"), remote="")
    started = time.perf_counter()
    engine = load_engine(str(model_dir), store=store, backend=args.backend, config=UNCHECKED)
    probes = {TASKS[k][0]: asked_questions(k, "probes", args.prompts, engine, task, args) for k in args.tasks}
    held = {TASKS[k][1]: asked_questions(k, "held out", args.questions, engine, task, args) for k in args.tasks}
    calibrated_on = {d for qs in probes.values() for q in qs for d in q.documents}
    seen = calibrated_on & {d for qs in held.values() for q in qs for d in q.documents}
    assert not seen, f"{len(seen)} held-out documents were calibrated on"
    if args.record is not None:  # measured before on these probes (under RECORDS): only the held-out part runs
        record = read_record(args.record, engine, args)
        engine.keep_calibration(record)
    else:
        # "questions": the application's own prompts (each kind's questions, asked as the held-out ones are);
        # "documents": probes calibrate() builds from the documents alone
        given = (
            {"prompts": {name: [q.prompt for q in qs] for name, qs in probes.items()}}
            if args.probes == "questions"
            else {"documents": sorted(calibrated_on)}
        )
        record = engine.calibrate(
            **given,
            num_prompts=args.prompts,
            target=args.target,
            plot=args.out / f"calibration-{args.tag}.png",
            journal=journal,
        )
        (args.out / RECORDS).mkdir(parents=True, exist_ok=True)
        (args.out / RECORDS / f"calibration-{args.tag}.json").write_bytes(record.to_bytes())

    engine.warm(sorted({d for qs in held.values() for q in qs for d in q.documents}), progress=True)
    modes = {
        "full": {"mode": "full"},
        "default (calibrated)": {},
        # the calibrated single ratio with the settings it was measured under
        f"calibrated single ratio ({record.ratio})": {"recompute_ratio": record.ratio, **record.settings},
        f"fallback ({FALLBACK_RATIO})": {"recompute_ratio": FALLBACK_RATIO},
    }
    asked = [[list(q.prompt.token_ids) for q in qs] for qs in held.values()]
    key = held_out_key(record, asked, list(modes))
    answers = args.work / "held-out.partial.json"
    rows = {name: {mode: [] for mode in modes} for name in held} | resumed(answers, key, modes)
    for name, questions in held.items():
        kind = next(k for k, names in TASKS.items() if names[1] == name)
        done = len(rows[name]["full"])
        for q in tqdm(
            questions[done:],
            desc=f"held out, {name}: {len(modes)} modes",
            unit="question",
            initial=done,
            total=len(questions),
        ):
            full = None
            for mode, options in modes.items():
                gen = engine.generate(q.prompt, max_tokens=task.max_tokens, **options)
                full = gen if mode == "full" else full
                assert full is not None
                rows[name][mode].append(
                    {
                        "served": "full" if mode == "full" else served_as(gen),
                        "agree": gen.token_ids[: record.tokens] == full.token_ids[: record.tokens],
                        "right": right(kind, gen.text, q.answers),
                        "ttft": gen.ttft_s,
                        "full_ttft": full.ttft_s,
                        "ratio": gen.usage.recompute_ratio,
                        "source": gen.usage.ratio_source,
                    }
                )
            answers.with_suffix(".tmp").write_text(json.dumps({"key": key, "rows": rows}))
            answers.with_suffix(".tmp").replace(answers)  # whole or not at all
    by_task = {name: held_out_table(of_task, record.confidence) for name, of_task in rows.items()}
    pooled = held_out_table(
        {mode: [r for of_task in rows.values() for r in of_task[mode]] for mode in modes}, record.confidence
    )
    if args.package:
        write_packaged(record, pooled, by_task, args)
    shutil.rmtree(args.work, ignore_errors=True)
    for path in kept.values():  # the record holds what they were kept for
        path.unlink(missing_ok=True)
    return {
        "config": {
            "model": label,
            "tag": args.tag,
            "backend": args.backend,
            "dtype": engine.dtype_name,
            "cpu": machine(),
            "calibration_documents": len(calibrated_on),
            "probes": args.probes,
            "calibration_prompts": record.n,
            "calibration_tasks": record.tasks,
            # the record's: a resumed run's includes what its journal's replies took to measure
            "calibration_seconds": round(record.seconds, 1),
            "held_out_questions": sum(len(qs) for qs in held.values()),
            "held_out_tasks": {name: len(qs) for name, qs in held.items()},
            "mean_prompt_tokens": round(statistics.fmean(len(q.prompt) for qs in held.values() for q in qs)),
            "target": record.target,
            "confidence": record.confidence,
            "tokens_compared": record.tokens,
            "minutes": round((time.perf_counter() - started) / 60, 1),
            "date": time.strftime("%Y-%m-%d"),
        },
        "calibration": {
            "ratio": record.ratio,
            "guard": None if record.guard is None else {"base": record.guard.base, "threshold": record.guard.threshold},
            "meets_target": record.meets_target,
            "why": record.why,
            "settings": record.settings,
            "guard_settings": record.guard_settings,
            "curve": record.curve,
        },
        "held_out": pooled,
        "held_out_tasks": by_task,
    }


def held_out_table(rows: dict[str, list[dict]], confidence: float) -> dict[str, dict]:
    """Each mode over the questions it blended (full prefill: all of them), with the requests it did
    not blend (fell back, or ran as full prefill) counted apart, never scored or timed as blends:
    agreement with its Wilson lower bound, the share right, the mean ratio, the speedup. A mode that
    blended none (a calibration that chose full prefill) is given as served."""
    table = {}
    for mode, rs in rows.items():
        blended = [r for r in rs if r["served"] == ("full" if mode == "full" else "blend")]
        scored = blended or rs
        ratios = [r["ratio"] for r in scored if r["ratio"] is not None]
        agree = sum(r["agree"] for r in scored)
        table[mode] = {
            "blended": len(blended),
            "not_blended": len(rs) - len(blended),
            "agreement": round(agree / len(scored), 4),
            "agreement_lower": round(wilson_lower(agree, len(scored), confidence), 4),
            "right": round(statistics.fmean(r["right"] for r in scored), 4),
            "mean_ratio": round(statistics.fmean(ratios), 4) if ratios else None,
            "guard_fired": round(statistics.fmean(r["source"] == "guard" for r in scored), 4),
            "ttft_s": round(statistics.fmean(r["ttft"] for r in scored), 4),
            "ttft_speedup": round(sum(r["full_ttft"] for r in scored) / sum(r["ttft"] for r in scored), 3),
        }
    return table


def write_packaged(record, table: dict, by_task: dict[str, dict], args, folder: Path = PACKAGED_DIR) -> Path:
    """The calibration this package ships for a model it ships (``calibration.PACKAGED_DIR``): the record,
    named for the model, with the held-out measurements that say what it means, pooled and by task. A
    policy ships only where its held-out agreement's lower bound meets the target on every task
    (``PackagedCalibration.under_shipping_rule``): otherwise the file ships full prefill, and says why."""

    def summary(rows: dict, questions: int) -> dict:
        fallback = next(v for k, v in rows.items() if k.startswith("fallback"))
        calibrated = rows["default (calibrated)"]
        return {
            "questions": questions,
            "full_right": rows["full"]["right"],
            "calibrated": {**calibrated, "ratio": calibrated["mean_ratio"]},
            "fallback": {**fallback, "ratio": FALLBACK_RATIO},
        }

    held = summary(table, sum(table["full"]["blended"] for table in by_task.values()))
    held["tokens"] = record.tokens
    held["tasks"] = {name: summary(rows, rows["full"]["blended"]) for name, rows in by_task.items()}
    name = results_name(args.model)
    packaged = PackagedCalibration(dataclasses.replace(record, model=SHIPPED[name]), held, machine(), Path())
    if packaged.shortfalls():
        packaged = packaged.under_shipping_rule()
        print(f"not shipped: {packaged.record.why}")
    path = folder / packaged_name(name, args.backend)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(packaged.to_bytes())
    print(f"packaged calibration written: {path}")
    return path


def rejudge(path: Path) -> bool:
    """Apply the shipping rule to a packaged calibration as it is; rewrite it if its policy breaks the
    rule (for files written before the rule, or under a looser one). Returns whether it was rewritten."""
    packaged = PackagedCalibration.from_bytes(path.read_bytes(), path)
    judged = packaged.under_shipping_rule()
    if judged is packaged:
        print(f"{path.name} meets the shipping rule: unchanged")
        return False
    path.write_bytes(judged.to_bytes())
    print(f"{path.name} rewritten: {judged.record.why}")
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks calibration", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="reader", help=f"{', '.join(SHIPPED)} or a checkpoint directory")
    parser.add_argument("--backend", default="transformers", choices=("transformers", "vllm"))
    parser.add_argument("--prompts", type=int, default=48, help="calibration probe prompts per task")
    parser.add_argument("--questions", type=int, default=60, help="held-out questions per task")
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument(
        "--doc-tokens", type=int, nargs=2, metavar=("MIN", "MAX"), help="document length (default: the model's task's)"
    )
    parser.add_argument(
        "--tasks",
        nargs="+",
        choices=tuple(TASKS),
        default=list(TASKS),
        help="the kinds of question calibration probes and the held-out split asks: the generated task, and "
        "SQuAD (train for the probes, dev held out)",
    )
    parser.add_argument(
        "--squad-docs",
        type=int,
        nargs=2,
        default=(6, 11),
        metavar=("MIN", "MAX"),
        help="SQuAD paragraphs per prompt, the gold one among them",
    )
    parser.add_argument(
        "--probes",
        choices=("questions", "documents"),
        default="questions",
        help="calibrate on the calibration set's own questions (as an application with sample questions does), "
        "or on probes built from its documents alone",
    )
    parser.add_argument(
        "--record",
        type=Path,
        help="judge this record (docs/results/records/, measured before with the same --tasks and --prompts) "
        "on the held-out questions instead of calibrating again",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--package",
        action="store_true",
        help="also write the record as the calibration the package ships for this model and engine "
        "(blend_integrations/data/calibrations/; a shipped model, the default target and probes only)",
    )
    parser.add_argument(
        "--rejudge",
        action="store_true",
        help="measure nothing: apply the shipping rule to the calibration the package ships for this model and "
        "engine, from its own held-out numbers, and rewrite it as full prefill where its policy breaks the rule",
    )
    parser.add_argument(
        "--checkpoint",
        action="store_true",
        help="only keep the journal and held-out answers of a run stopped midway in --out's records/ (compressed), "
        "so that a commit carries them to another checkout, where the same command resumes from them on a machine "
        "with the same CPU",
    )
    args = parser.parse_args(argv)
    name = results_name(args.model)
    if args.package and (name not in SHIPPED or args.target != 0.95 or args.probes != "questions"):
        parser.error(f"--package is for the shipped models ({', '.join(SHIPPED)}) at the default target and probes")
    args.tag = (
        f"{name}-{args.backend}"
        + ("" if args.probes == "questions" else "-document-probes")
        + ("" if args.target == 0.95 else f"-target-{args.target}")
    )
    args.work = args.out / f".calibration-{args.tag}.partial"
    if args.rejudge:
        if name not in SHIPPED:
            parser.error(f"--rejudge is for the shipped models ({', '.join(SHIPPED)})")
        rejudge(PACKAGED_DIR / packaged_name(name, args.backend))
        return
    if args.checkpoint:
        print("kept:", *write_checkpoint(args))
        return
    report = run(args)
    write_results(
        args.out,
        f"calibration-{args.tag}",
        f"Calibration: {report['config']['model']}, {args.backend} engine",
        markdown(report),
        report,
        command=f"`python -m benchmarks calibration {' '.join(argv or [])}`",
    )
    print(f"written: {summary(args.out)}")
