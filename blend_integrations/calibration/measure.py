"""Calibration, measurement: ``calibrate`` runs the probes on an engine, measures the
policies cheapest first, chooses, and keeps the record. It needs of an engine only
``Calibratable``, what ``engines.base.Engine`` offers, so the engines call it without a cycle."""

from __future__ import annotations

import collections
import contextlib
import fcntl
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from tqdm.auto import tqdm

from ..config import BlendConfig, check_ratio
from ..prompt import PromptInput, TokenizedPrompt
from ..store import ChunkStore
from ..version import __version__
from .choice import Costs, candidates, choose, default_variants, meets
from .journal import Journal, cpu_name
from .probes import MIN_PROBE_TOKENS, probe_prompts, question_probes
from .records import LADDER, CalibrationError, CalibrationRecord, max_misses, record_name, settings_label, wilson_lower
from .report import report, write_plot

KL_TOP = 20  # the first token's KL is over full prefill's top KL_TOP tokens and the rest as one bucket


class Reply(Protocol):
    """What calibration reads of a generation (``engines.base.Reply``)."""

    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    ttft_s: float
    ranking_share: Callable[[float], float] | None


class Calibratable(Protocol):
    """What calibration needs of an engine: ``engines.base.Engine`` offers it all."""

    backend: str
    model_name: str
    fingerprint: str
    dtype_name: str
    num_layers: int | None
    config: BlendConfig

    @property
    def store(self) -> ChunkStore: ...

    @property
    def kv_codec(self) -> str | None: ...

    @property
    def tokenizer(self) -> Any: ...

    def tokenize(self, prompt: PromptInput) -> TokenizedPrompt: ...

    @property
    def generate(self) -> Callable[..., Any]: ...  # (prompt, mode=, recompute_ratio=, ...) -> a Reply

    def warm(self, documents: Sequence[Any], *, progress: bool = ...) -> int: ...

    def stored_documents(self, limit: int = ...) -> list[str]: ...

    def calibration_lock(self, name: str) -> contextlib.AbstractContextManager: ...

    def keep_calibration(self, record: CalibrationRecord) -> None: ...


def _agree(full: Reply, blend: Reply, tokens: int) -> bool:
    return full.token_ids[:tokens] == blend.token_ids[:tokens]


def _first_token_kl(full: Reply, blend: Reply) -> float | None:
    """KL(full || blend) of the first token over full's top KL_TOP tokens and
    the rest as one bucket (a lower bound on the whole-vocabulary KL)."""
    if not full.logprobs or not blend.logprobs:
        return None
    p, q = full.logprobs[0], blend.logprobs[0]
    floor = min(q.values()) if q else -30.0  # a token outside blend's top-k has at most its smallest probability
    kl, p_rest, q_rest = 0.0, 1.0, 1.0
    for token, lp in p.items():
        lq = q.get(token, floor)
        kl += math.exp(lp) * (lp - lq)
        p_rest -= math.exp(lp)
        q_rest -= math.exp(lq)
    p_rest, q_rest = max(p_rest, 1e-12), max(q_rest, 1e-12)
    return max(0.0, kl + p_rest * math.log(p_rest / q_rest))


class _Replies:
    """Each probe's full prefill, and its blended replies under each setting
    and ratio, each run once, when a policy first needs it."""

    def __init__(self, probes: list, fulls: list, blend: Callable, settings: list[dict], tasks: list[str]) -> None:
        self.probes, self.fulls, self.blend, self.settings = probes, fulls, blend, settings
        self.tasks = tasks  # each probe's kind of question
        self.runs: dict[tuple[int, float, int], Reply] = {}

    def has(self, settings: int, ratio: float, j: int) -> bool:
        return ratio >= 1.0 or (settings, ratio, j) in self.runs

    def get(self, settings: int, ratio: float, j: int) -> Reply | None:
        return None if ratio >= 1.0 else self.blended(settings, ratio, j)  # None: full prefill itself

    def blended(self, settings: int, ratio: float, j: int) -> Reply:
        key = (settings, ratio, j)
        if key not in self.runs:
            self.runs[key] = self.blend(self.probes[j], ratio, self.settings[settings])
        return self.runs[key]

    def reorder(self, order: list[int]) -> None:
        """Index the probes in ``order`` from now on."""
        at = {j: i for i, j in enumerate(order)}
        self.probes = [self.probes[j] for j in order]
        self.fulls = [self.fulls[j] for j in order]
        self.tasks = [self.tasks[j] for j in order]
        self.runs = {(s, r, at[j]): g for (s, r, j), g in self.runs.items()}


@contextlib.contextmanager
def exclusive(store: ChunkStore, name: str) -> Iterator[None]:
    """One calibration of a model per store directory at a time."""
    path = Path(store.path) / f".{name}.lock"
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CalibrationError(
                f"another process is calibrating this model on the store {store.path} (lock {path}); "
                "wait for it: its record is used by every engine on the store"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def check_target(target: Any, name: str = "target") -> float:
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0.0 < target <= 1.0:
        raise CalibrationError(f"{name} must be a number in (0, 1], got {target!r:.40}")
    return float(target)


def calibrate(
    engine: Calibratable,
    documents: Sequence[str] | None = None,
    *,
    prompts: Sequence[PromptInput] | Mapping[str, Sequence[PromptInput]] | None = None,
    questions: Sequence[str] | None = None,
    target: float = 0.95,
    confidence: float = 0.8,
    tokens: int = 4,
    num_prompts: int = 48,
    ratios: Sequence[float] = LADDER,
    variants: Sequence[dict] | None = None,
    seed: int = 0,
    min_speedup: float = 1.1,
    progress: bool | None = None,
    plot: str | os.PathLike | None = None,
    save: bool = True,
    exhaustive: bool = False,
    journal: str | os.PathLike | None = None,
) -> CalibrationRecord:
    """Measure the recompute policy this engine's model needs to agree with
    full prefill on ``target`` of the prompts, store it, and return the record.
    ``variants``: blend settings tried besides the engine's own, each a dict
    of ``config.SETTINGS`` changes (None: ``default_variants``; ``[]``: only
    the engine's own). See the module docstring for the method.

    Probes: ``prompts`` (the application's own; a mapping of kinds of
    question to their prompts calibrates on every kind at once, and a policy
    meets the target only where it meets it on each: the worst decides), else
    ``questions`` (the application's own questions) asked over the
    ``documents`` a BM25 retriever ranks first for each, else questions made
    up about ``documents`` (``probes.probe_prompts``). ``min_speedup``: a policy
    measured less than this many times sooner than full prefill is not worth
    its risk: when none meeting the target is faster, the record chooses full
    prefill. Policies are measured cheapest first and stop early (see
    ``_measure``); ``exhaustive`` measures every one on every probe, for the
    whole curve (slower; the same choice). Prints a table; ``plot``: also
    write a PNG of agreement and TTFT speedup against the ratio. ``journal``:
    a file every reply is appended to as it is measured; a calibration
    stopped midway and run again with the same journal resumes where it
    stopped (``journal.Journal``)."""
    target = check_target(target)
    confidence = check_target(confidence, "confidence")
    if isinstance(min_speedup, bool) or not isinstance(min_speedup, (int, float)) or not min_speedup > 0:
        raise CalibrationError(f"min_speedup must be a positive number, got {min_speedup!r:.40}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise CalibrationError(f"tokens must be a positive integer, got {tokens!r:.40}")
    if not isinstance(exhaustive, bool):
        raise CalibrationError(f"exhaustive must be True or False, got {exhaustive!r:.40}")
    if isinstance(num_prompts, bool) or not isinstance(num_prompts, int) or num_prompts < 2:
        raise CalibrationError(f"num_prompts must be an integer >= 2, got {num_prompts!r:.40}")
    ladder = sorted({check_ratio(r) for r in ratios} - {1.0})
    if not ladder:
        raise CalibrationError("ratios must hold at least one ratio below 1.0")
    config, num_layers = engine.config, engine.num_layers
    if num_layers is None:
        raise CalibrationError(
            f"the {engine.backend} engine does not know its model's layers here: calibrate where it runs"
        )
    base = config.settings()
    tried = [base]
    for v in default_variants(config, num_layers) if variants is None else variants:
        try:
            settings = config.with_settings(v, num_layers=num_layers).settings()
        except (TypeError, ValueError) as e:
            raise CalibrationError(f"variant {v!r:.80}: {e}") from None
        if settings not in tried:
            tried.append(settings)
    if prompts is not None:
        given = prompts if isinstance(prompts, Mapping) else {"prompts": prompts}
        if not given or isinstance(prompts, str) or any(isinstance(v, str) or not v for v in given.values()):
            raise CalibrationError("prompts must be a list of prompts, or a mapping of task names to such lists")
        probes, tasks = [], []
        for task, of_task in given.items():
            probes += [engine.tokenize(p) for p in of_task]
            tasks += [str(task)] * len(of_task)
        source = f"{len(probes)} given prompts" + (f" of {len(given)} tasks" if len(given) > 1 else "")
    else:
        if documents is None:
            documents = engine.stored_documents()
            if not documents:
                raise CalibrationError(
                    "calibration needs documents (or prompts) to probe with, and none were given: pass the "
                    "documents your RAG application retrieves, or warm the store with them first (calibration "
                    f"then reads this model's chunks from {engine.store.path})"
                )
        if isinstance(documents, str):
            raise CalibrationError("documents must be a list of texts, not one string")
        docs = [d for d in documents if isinstance(d, str) and d.strip()]
        usable = [d for d in docs if len(engine.tokenizer.encode(d, add_special_tokens=False)) >= MIN_PROBE_TOKENS]
        if len(usable) < 2:
            raise CalibrationError(
                f"calibration needs at least 2 documents of {MIN_PROBE_TOKENS} tokens or more to blend; "
                f"got {len(docs)} text(s), {len(usable)} long enough"
            )
        if questions is not None:
            if isinstance(questions, str) or not all(isinstance(q, str) and q.strip() for q in questions):
                raise CalibrationError("questions must be a list of non-empty question strings")
            if not questions:
                raise CalibrationError("questions is empty: pass your application's questions, or none")
            probes = question_probes(engine, usable, list(questions), num_prompts, seed)
            tasks = ["questions"] * len(probes)
            source = f"{len(probes)} probes of {len(questions)} questions over {len(usable)} documents"
        else:
            probes = probe_prompts(engine, usable, num_prompts, seed)
            tasks = ["documents"] * len(probes)
            source = f"{len(probes)} probes from {len(usable)} documents"
    kept = [j for j, p in enumerate(probes) if p.chunk_spans]
    probes, tasks = [probes[j] for j in kept], [tasks[j] for j in kept]
    if len(probes) < 2:
        raise CalibrationError("calibration needs at least 2 prompts with retrieved documents (chunks) in them")
    task_sizes = dict(collections.Counter(tasks))
    name = record_name(engine.fingerprint, engine.dtype_name, engine.kv_codec)
    show = progress if progress is not None else True
    started = time.perf_counter()
    n = len(probes)

    journaled = None
    if journal is not None:
        identity: dict[str, Any] = {"fingerprint": engine.fingerprint, "dtype": engine.dtype_name}
        identity |= {"engine": engine.backend, "kv_codec": engine.kv_codec, "tokens": tokens, "kl_top": KL_TOP}
        journaled = Journal(journal, identity | {"cpu": cpu_name(), "version": __version__}, ladder)

    earlier_s = 0.0  # what measuring the replies read back from the journal took, in earlier pieces

    def measured(tp: TokenizedPrompt, ratio: float | None = None, settings: dict | None = None) -> Reply:
        """Full prefill (no ``ratio``) or a blend of ``tp``: from the journal where it holds it."""
        nonlocal earlier_s
        key = Journal.key(tp, "full" if ratio is None else "blend", ratio, settings)
        if journaled is not None and (hit := journaled.get(key)) is not None:
            earlier_s += hit.wall_s
            return hit
        asked = time.perf_counter()
        if ratio is None:
            reply = engine.generate(tp, mode="full", max_tokens=tokens, logprobs=KL_TOP)
        else:
            reply = engine.generate(
                tp, mode="blend", recompute_ratio=ratio, **(settings or {}), max_tokens=tokens, logprobs=KL_TOP
            )
        if journaled is not None:
            journaled.put(key, reply, time.perf_counter() - asked)
        return reply

    with engine.calibration_lock(name):
        chunks = {tuple(p.token_ids[a:b]) for p in probes for a, b in p.chunk_spans}
        engine.warm([list(c) for c in chunks], progress=show)
        first = f"calibrating ({source}): full prefill and ratio {ladder[0]}"
        with tqdm(total=2 * n, desc=first, unit="run", disable=not show) as bar:
            fulls = []
            for tp in probes:
                fulls.append(measured(tp))
                bar.update()
            replies = _Replies(probes, fulls, measured, tried, tasks)
            for j in range(n):
                replies.blended(0, ladder[0], j)
                bar.update()
        curve = _measure(
            replies,
            ladder,
            tried,
            num_layers,
            tokens,
            target=target,
            confidence=confidence,
            min_speedup=min_speedup,
            exhaustive=exhaustive,
            progress=show,
        )
        record = choose(
            curve,
            base=base,
            ladder=ladder,
            min_speedup=min_speedup,
            target=target,
            confidence=confidence,
            tokens=tokens,
            tasks=task_sizes,
            identity={
                "model": engine.model_name,
                "fingerprint": engine.fingerprint,
                "dtype": engine.dtype_name,
                "engine": engine.backend,
                "kv_codec": engine.kv_codec,
            },
            version=__version__,
            seconds=time.perf_counter() - started + earlier_s,  # a resumed calibration's earlier pieces too
        )
        if save:
            engine.keep_calibration(record)
    print(report(record))
    if plot is not None:
        write_plot(record, plot)
    return record


def _row(
    fulls: list[Reply],
    per_probe: list[tuple[float, Reply | None]],
    tokens: int,
    confidence: float,
    tasks: list[str],
    **fields,
) -> dict:
    """One policy's measures over the probes it ran on (the first ``len(per_probe)``);
    a None generation is full prefill (the guard's 1.0). Its lower bound is
    its worst task's (``tasks``: each probe's): one stopped early has none."""
    n = len(fulls)
    measured = fulls[: len(per_probe)]
    agrees = [g is None or _agree(f, g, tokens) for f, (_, g) in zip(measured, per_probe)]
    agree = sum(agrees)
    by_task: dict[str, dict[str, Any]] = {}
    bounds: list[float] = []
    for task in dict.fromkeys(tasks):
        of_task = [a for a, t in zip(agrees, tasks) if t == task]
        size = tasks.count(task)
        bounds.append(round(wilson_lower(sum(of_task), size, confidence), 4) if len(of_task) == size else 0.0)
        by_task[task] = {
            "n": len(of_task),
            "agreement": round(sum(of_task) / len(of_task), 4) if of_task else None,
            "lower_bound": bounds[-1],
        }
    kls = [k for f, (_, g) in zip(measured, per_probe) if g is not None and (k := _first_token_kl(f, g)) is not None]
    ttft = [g.ttft_s if g is not None else f.ttft_s for f, (_, g) in zip(measured, per_probe)]
    return {
        **fields,
        "mean_ratio": round(statistics.fmean(r for r, _ in per_probe), 4),
        "n": len(per_probe),
        "agreement": round(agree / len(per_probe), 4),
        # a policy stopped early is short of n probes: it cannot meet the target
        "lower_bound": min(bounds) if len(per_probe) == n else 0.0,
        **({"tasks": by_task} if len(by_task) > 1 else {}),
        "kl": round(statistics.fmean(kls), 4) if kls else None,
        "ttft_speedup": round(statistics.fmean(f.ttft_s for f in measured) / statistics.fmean(ttft), 3),
    }


def _measure(
    replies: _Replies,
    ladder: list[float],
    tried: list[dict],
    num_layers: int,
    tokens: int,
    *,
    target: float,
    confidence: float,
    min_speedup: float,
    exhaustive: bool,
    progress: bool = False,
) -> list[dict]:
    """Measure the policies cheapest first, each on the probes hardest first,
    and return their rows. Every probe's reply at the cheapest ratio comes
    first: the first setting's orders the probes (disagreeing, then by
    first-token KL), and each setting's gives its guard the shares. A policy
    stops at the disagreement that rules the target out, and is not run at
    all once a cheaper one met the target (a single ratio only for a cheaper
    single ratio: a record keeps the cheapest one besides its guard) or one
    as costly was measured too slow to be worth it. The choice is the one
    measuring everything would make; ``exhaustive`` does, for the whole curve."""
    n, base = len(replies.fulls), tried[0]
    first = [replies.blended(0, ladder[0], j) for j in range(n)]
    hardness = [(_agree(f, g, tokens), -(_first_token_kl(f, g) or 0.0)) for f, g in zip(replies.fulls, first)]
    replies.reorder(sorted(range(n), key=lambda j: hardness[j]))
    tasks = replies.tasks
    allowed = {t: max_misses(tasks.count(t), target, confidence) for t in dict.fromkeys(tasks)}
    showable = min(allowed.values()) >= 0  # else no policy can meet the target on every task
    best_single = best_any = too_slow = math.inf
    rows = []
    # each setting's guard shares, in the probes' new order (from its cheapest runs: the first
    # setting's made above); none where the engine reports none, or where no policy can meet the target
    shares = {}
    for i in range(len(tried) if showable else 0):
        of_probes = [s for j in range(n) if (s := replies.blended(i, ladder[0], j).ranking_share) is not None]
        if len(of_probes) < n:
            break  # the engine reports no shares
        shares[i] = of_probes
    # the cost model's pass cost, fitted to the times measured so far: full prefill's and the cheapest blends'
    runs: list[tuple[int, dict | None, float, float]] = [(j, None, 1.0, f.ttft_s) for j, f in enumerate(replies.fulls)]
    runs += [(j, tried[i], r, g.ttft_s) for (i, r, j), g in replies.runs.items()]
    costs = Costs.of(replies.probes, num_layers).fitted(runs)
    bar = tqdm(
        candidates(shares, ladder, tried, costs),
        desc="calibrating: policies, cheapest first",
        unit="policy",
        disable=not progress,
    )
    for policy in bar:
        bar.set_postfix(runs=len(replies.runs), refresh=False)
        settings = tried[policy.settings]
        cheaper_met = best_single if policy.kind == "ratio" else best_any
        measured = all(replies.has(policy.settings, r, j) for j, r in enumerate(policy.rungs))
        if not (exhaustive or measured) and (not showable or policy.cost >= min(cheaper_met, too_slow)):
            continue  # its row costs nothing to give when its replies are all there
        per_probe: list[tuple[float, Reply | None]] = []
        misses = dict.fromkeys(allowed, 0)
        for j, r in enumerate(policy.rungs):
            # past the miss that rules the target out on a task, only replies already measured are counted
            ruled_out = any(misses[t] > allowed[t] for t in allowed)
            if ruled_out and not exhaustive and not replies.has(policy.settings, r, j):
                break
            g = replies.get(policy.settings, r, j)
            per_probe.append((r, g))
            misses[tasks[j]] += g is not None and not _agree(replies.fulls[j], g, tokens)
        fields = {"threshold": policy.threshold} if policy.kind == "guard" else {}
        row = _row(
            replies.fulls,
            per_probe,
            tokens,
            confidence,
            tasks,
            policy=policy.kind,
            variant=settings_label(settings, base),
            settings=settings,
            ratio=policy.ratio,
            **fields,
            cost=round(policy.cost, 4),
        )
        rows.append(row)
        if row["n"] == n and row["ttft_speedup"] < min_speedup:
            too_slow = min(too_slow, policy.cost)
        if meets(row, target, n, min_speedup):
            best_any = min(best_any, policy.cost)
            if policy.kind == "ratio":
                best_single = min(best_single, policy.cost)
    return rows
