"""The live check (``BlendConfig.quality_check``) on streams of requests: where the policy in use
loses answers it must climb until they hold, and where it holds it must cost little and stay put.

    python -m benchmarks live-check [--backend vllm|transformers] [--requests 200] [--share 1.0]
                                    [--holds-share 0.05] [--arrivals 120] [--arrivals-share 1.0]
                                    [--risk 0.05] [--server]

Streams, each request asked with ``"auto"`` and answered before the next, its check run at once
(``quality_check_risk=1``: how fast the checks climb, counted in requests, is the point):

- **loses**: SmolLM2-135M-Instruct's real weights under a ``config.json`` with one key more, a
  checkpoint no calibration knows, so ``"auto"`` starts at the fallback (0.15), which changes
  about a third of its answers; its generated task on a seed no run had used. Checks at
  ``--share`` (1.0: every request).
- **holds**: the bundled reader at the policy its calibration on this engine chose
  (docs/results/records/), kept in the store as a user's own calibration, on its own task (the
  generated kind, where it held out), checks at ``--holds-share``.

After each answer (and its check) the benchmark asks full prefill itself, so each request's
agreement with full prefill's first tokens is known apart from the check's own verdict. Then
**arrivals**: the reader's requests arriving at random (exponential gaps, about half the engine
busy), at the default ``quality_check_risk`` (``--risk``), in blocks each asked twice, with checks
at ``--arrivals-share`` and with checks off (on-off, then off-on, in turn), with the same gaps: each
request's time to first token with checks on over off is a paired ratio, whose median and
distribution-free interval say what the arms differ by; beside them the arms' quantiles, any
request that failed, and where the checks ran (while users came, or in the pause after a block). The page ends each stream with its
goal: later answers that agree on at least 95% within 200 requests where the policy loses them;
checks that cost at most 5% of compute and never raise the ratio where it holds. ``--server`` runs
the arrivals alone on the blend server instead (``live_check_served``), on a page of their own.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import threading
import time
from pathlib import Path

from tqdm.auto import tqdm

from blend_integrations import BlendConfig, ChunkStore, load_engine
from blend_integrations.calibration import CalibrationRecord, wilson_lower
from blend_integrations.calibration.records import settings_label
from blend_integrations.models.smollm2 import smollm2_dir

from . import machine, scratch_dir, served_as, write_results
from .paired import paired, paired_text
from .quality import model_and_task

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
LOSES_SEED, HOLDS_SEED, ARRIVALS_SEED = 76_000, 76_500, 76_900  # seeds no other run uses
TOKENS = 4  # the first tokens compared, as calibration compares them
CONFIDENCE = 0.8
ARMS = ("checks on", "checks off")
BLOCK = 10  # the arrivals' block: asked with checks on and off one after the other


def uncalibrated_copy(model_dir: Path) -> Path:
    """A checkpoint the package ships no calibration for: ``model_dir``'s files linked, and its
    ``config.json`` with one key more (another fingerprint, the same model)."""
    copy = Path(scratch_dir("blend-live-check-model-"))
    for f in model_dir.iterdir():
        if f.name != "config.json":
            (copy / f.name).symlink_to(f.resolve())
    config = json.loads((model_dir / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "blend_benchmark_copy": "live-check"}, indent=2))
    return copy


def holding_record(backend: str, *, fingerprint: str, dtype: str, num_layers: int) -> CalibrationRecord:
    """The policy the reader's calibration on ``backend`` chose (docs/results/records/): where it held
    out on the generated task (the package ships it only where SQuAD's held-out bound holds too)."""
    path = RESULTS / "records" / f"calibration-reader-{backend}.json"
    return CalibrationRecord.from_bytes(path.read_bytes(), fingerprint=fingerprint, dtype=dtype, num_layers=num_layers)


def policy_label(record: CalibrationRecord) -> str:
    """A record's policy in a few words: its single ratio and settings, and its guard."""
    guard = record.guard
    return f"{record.ratio:g} ({settings_label(record.settings)})" + (
        f", a guard from {guard.base:g} at threshold {guard.threshold:g}" if guard else ""
    )


def ttft_quantiles(xs: list[float]) -> dict:
    """The count, median and p95 of users' times to first token."""
    qs = statistics.quantiles(xs, n=20) if len(xs) >= 2 else [xs[0]] * 19
    return {"n": len(xs), "p50": round(statistics.median(xs), 4), "p95": round(qs[18], 4)}


def ask_stream(engine, task, n: int, seed: int, name: str) -> list[dict]:
    """``n`` requests one after another, each then checked by full prefill here too (the reference)."""
    examples = task.examples(n, seed, None)
    engine.warm(sorted({d for e in examples for d in e.documents}), progress=True)
    rows = []
    for i, e in enumerate(tqdm(examples, desc=f"{name}: requests", unit="request")):
        prompt = task.prompt(e, engine.tokenizer, engine.config.separator)
        gen = engine.generate(prompt, max_tokens=TOKENS)
        engine.quality_checker.wait(600)
        full = engine.generate(prompt, max_tokens=TOKENS, mode="full")
        rows.append(
            {
                "i": i,
                "served": served_as(gen),
                "ratio": gen.usage.recompute_ratio,
                "source": gen.usage.ratio_source,
                "checked": gen.usage.quality_checked,
                "agree": gen.token_ids[:TOKENS] == full.token_ids[:TOKENS],
                "ttft": gen.ttft_s,
                "full_ttft": full.ttft_s,
            }
        )
    return rows


def stream_summary(rows: list[dict], engine) -> dict:
    blended = [r for r in rows if r["served"] == "blend"]
    steps = engine.calibrations.live.state.steps if engine.calibrations.live.state else []
    last_move = (
        max((i for i, (a, b) in enumerate(itertools.pairwise(rows)) if a["ratio"] != b["ratio"]), default=-1) + 1
    )
    after = rows[last_move:]  # every answer users got after the last step, blended or run in full

    def agreement(rs: list[dict]) -> dict | None:
        if not rs:
            return None
        agreed = sum(r["agree"] for r in rs)
        return {
            "n": len(rs),
            "agreement": round(agreed / len(rs), 4),
            "lower_bound": round(wilson_lower(agreed, len(rs), CONFIDENCE), 4),
        }

    stats = engine.quality_check_stats()
    user_s = sum(r["ttft"] for r in rows)
    return {
        "requests": len(rows),
        "blended": len(blended),
        "start_ratio": rows[0]["ratio"],
        "end_ratio": rows[-1]["ratio"],
        "settled_at_request": last_move,
        "agreement_all": agreement(blended),
        "agreement_after_last_step": agreement(after),
        "blended_after_last_step": sum(r["served"] == "blend" for r in after),
        "steps": [{k: s[k] for k in ("from", "to", "why")} for s in steps],
        "checks": {k: v for k, v in stats.items() if k != "state"},
        # the checks' compute against the users' prefill compute (time to first token), both on this engine
        "check_share_of_prefill": round(stats["seconds"] / user_s, 4) if user_s else None,
        "ratios": [r["ratio"] for r in rows],
        "agrees": [r["agree"] for r in rows],
    }


def arrivals(engine, task, n: int, share: float, risk: float) -> dict:
    """``n / 2`` of the reader's requests arriving at random, each asked twice: in blocks of
    ``BLOCK``, asked with checks at ``share`` and then off (off then on in every other block) with
    the same random gaps; each user's time to first token, failures, the paired ratios' median,
    and the checks that ran while users came and in the pauses after a block."""
    examples = task.examples(n // 2, ARRIVALS_SEED, None)
    engine.warm(sorted({d for e in examples for d in e.documents}), progress=True)
    prompts = [task.prompt(e, engine.tokenizer, engine.config.separator) for e in examples]
    busy = statistics.fmean(engine.generate(p, max_tokens=TOKENS).total_s for p in prompts[:5])
    by_request: dict[str, dict[int, float]] = {arm: {} for arm in ARMS}  # per arm: request -> TTFT
    failures = dict.fromkeys(ARMS, 0)
    lock = threading.Lock()
    checker = engine.quality_checker
    checker.risk = risk
    ran_while_users_came = 0

    def ended() -> int:
        """Checks that ended: run, preempted or failed."""
        return checker.counts["checked"] + checker.counts["preempted"] + checker.counts["failed"]

    def user(prompt, arm: str, key: int) -> None:
        try:
            gen = engine.generate(prompt, max_tokens=TOKENS)
            with lock:
                by_request[arm][key] = gen.ttft_s
        except Exception:  # counted: a check must never make a user's request fail
            with lock:
                failures[arm] += 1

    for b, block in enumerate(tqdm(range(0, len(prompts), BLOCK), desc="arrivals", unit="block")):
        for arm in ARMS if b % 2 == 0 else ARMS[::-1]:
            checker.share = share if arm == "checks on" else 0.0
            rng = random.Random(ARRIVALS_SEED + b)  # the block's other arm waits the same gaps
            threads = []
            for key, p in enumerate(prompts[block : block + BLOCK], start=block):
                t = threading.Thread(target=user, args=(p, arm, key))
                t.start()
                threads.append(t)
                time.sleep(rng.expovariate(1.0 / (2 * busy)))  # about half the engine busy
            before = ended()
            for t in threads:
                t.join()
            ran_while_users_came += ended() - before
            checker.wait(600)
    checker.share = share

    return {
        "mean_gap_s": round(2 * busy, 3),
        "ttft": {arm: ttft_quantiles(list(xs.values())) for arm, xs in by_request.items() if xs},
        "paired": paired(*(by_request[arm] for arm in ARMS)),
        "failed": failures,
        "checks": {k: v for k, v in checker.stats().items() if k != "state"},
        "checks_while_users_came": ran_while_users_came,  # ended (run, preempted or failed) during a block
    }


def run(args) -> dict:
    started = time.perf_counter()
    report: dict = {
        "config": {
            "backend": args.backend,
            "cpu": machine(),
            "requests": args.requests,
            "share": args.share,
            "holds_share": args.holds_share,
            "arrivals": args.arrivals,
            "arrivals_share": args.arrivals_share,
            "risk": args.risk,
            "tokens_compared": TOKENS,
            "date": time.strftime("%Y-%m-%d"),
        }
    }
    _, smollm2_task, _ = model_and_task("smollm2")
    store = ChunkStore(scratch_dir("blend-live-check-store-"), remote="")
    with load_engine(
        str(uncalibrated_copy(smollm2_dir())),
        store=store,
        backend=args.backend,
        config=BlendConfig(quality_check=args.share, quality_check_risk=1.0),
    ) as engine:
        rows = ask_stream(engine, smollm2_task, args.requests, LOSES_SEED, "loses")
        report["loses"] = {"model": "SmolLM2-135M-Instruct, uncalibrated copy", **stream_summary(rows, engine)}
    reader_dir, reader_task, label = model_and_task("reader")
    store = ChunkStore(scratch_dir("blend-live-check-store-"), remote="")
    config = BlendConfig(quality_check=args.holds_share, quality_check_risk=1.0)
    with load_engine(str(reader_dir), store=store, backend=args.backend, config=config) as engine:
        record = holding_record(
            engine.backend, fingerprint=engine.fingerprint, dtype=engine.dtype_name, num_layers=engine.num_layers
        )
        engine.keep_calibration(record)
        policy = policy_label(record)
        report["holds"] = {
            "model": f"{label}, at the policy its calibration chose ({policy})",
            **stream_summary(ask_stream(engine, reader_task, args.requests, HOLDS_SEED, "holds"), engine),
        }
        if args.arrivals:
            report["arrivals"] = arrivals(engine, reader_task, args.arrivals, args.arrivals_share, args.risk)
    report["config"]["minutes"] = round((time.perf_counter() - started) / 60, 1)
    return report


def markdown(report: dict) -> str:
    c = report["config"]
    lines = [
        f"{c['backend']} engine on {c['cpu']}; {c['date']}; {c['minutes']} min. Agreement: the first "
        f"{c['tokens_compared']} tokens equal to full prefill's (asked by the benchmark after each answer), "
        f"over the answers its column names, with the {CONFIDENCE:.0%} Wilson lower bound. In the two streams "
        "each check runs at once, before the next request (quality_check_risk 1).",
        "",
        "| stream | model | checks | requests | ratio: start → end | settled at request | agreement, blended "
        "answers | agreement, every answer after the last step (blended) | checks run (agreed) | "
        "check compute / users' prefill |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for name, share in (("loses", c["share"]), ("holds", c["holds_share"])):
        s = report[name]

        def agreed(a: dict | None) -> str:
            return "—" if a is None else f"{a['agreement']:.2f} (≥ {a['lower_bound']:.2f}, n={a['n']})"

        lines.append(
            f"| {name} | {s['model']} | {share:g} | {s['requests']} | {s['start_ratio']} → {s['end_ratio']} | "
            f"{s['settled_at_request']} | {agreed(s['agreement_all'])} | {agreed(s['agreement_after_last_step'])} "
            f"({s['blended_after_last_step']}) | {s['checks']['checked']} ({s['checks']['agreed']}) | "
            f"{s['check_share_of_prefill']:.1%} |"
        )
    loses, holds = report["loses"], report["holds"]
    later = loses["agreement_after_last_step"]
    lines += [
        "",
        f"- Where the policy loses answers: after request {loses['settled_at_request']} of {loses['requests']}, at "
        f"ratio {loses['end_ratio']}, users' answers agree with full prefill's on {later['agreement']:.0%} "
        f"(at least {later['lower_bound']:.0%}, n={later['n']}; the goal: 95% within 200 requests)"
        + (", by running full prefill: no blend on this model held" if loses["end_ratio"] == 1.0 else "")
        + ".",
        f"- Where it holds: the checks cost {holds['check_share_of_prefill']:.1%} of the users' prefill compute (the "
        f"goal: at most 5%), and the live check stepped the ratio {len(holds['steps'])} times (the goal: never "
        "raised); a guard's requests run at the ratio it gives each, so their start and end differ all the same.",
    ]
    for name in ("loses", "holds"):
        for step in report[name]["steps"]:
            lines.append(f"\n- {name}: {step['from']} → {step['to']}: {step['why']}")
    if "arrivals" in report:
        a = report["arrivals"]
        lines += [
            "",
            f"Arrivals: {c['arrivals']} of the reader's requests at random (mean gap {a['mean_gap_s']} s), "
            f"in blocks of {BLOCK}, each block asked with checks on and off one after the other (on-off, then "
            "off-on, in turn) with the same gaps, so each request is asked in both arms: checks on "
            f"(share {c['arrivals_share']}; its calibrated policy is checked at an eighth of it) and off:",
            "",
            "| | requests | TTFT p50 (s) | TTFT p95 (s) | failed |",
            "|---|---:|---:|---:|---:|",
        ]
        for arm, t in a["ttft"].items():
            lines.append(f"| {arm} | {t['n']} | {t['p50']} | {t['p95']} | {a['failed'][arm]} |")
        ch = a["checks"]
        during = a.get("checks_while_users_came")
        lines.append(
            f"\nChecks during arrivals (quality_check_risk {c.get('risk', 1.0)}): {ch['checked']} run, "
            f"{ch['preempted']} preempted by a user's request, {ch['dropped']} dropped (the queue was full)"
            + (
                ""
                if during is None
                else f"; {during} of them ended while users were arriving, the rest in the pause after a block"
            )
            + "."
        )
        on, off = a["ttft"].get("checks on"), a["ttft"].get("checks off")
        if on and off:
            lines.append(
                "\n- No user slower (the goal): time to first token with checks on over off, "
                + paired_text(a.get("paired"))
                + f"{on['p50'] / off['p50']:.2f}x at the arms' median, {on['p95'] / off['p95']:.2f}x at p95; "
                f"{a['failed']['checks on']} failed with checks on"
                + (
                    "; no check was in flight while users came, so the two arms differ by chance alone."
                    if during == 0
                    else "."
                )
            )
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, name in zip(axes, ("loses", "holds")):
        s = report[name]
        ax.step(range(len(s["ratios"])), [r if r is not None else float("nan") for r in s["ratios"]], where="post")
        ax.set_ylabel("recompute ratio")
        ax.set_xlabel("request")
        window = 20
        rolling = [statistics.fmean(s["agrees"][max(0, i - window + 1) : i + 1]) for i in range(len(s["agrees"]))]
        twin = ax.twinx()
        twin.plot(rolling, color="tab:orange", alpha=0.8)
        twin.set_ylim(0, 1.05)
        twin.set_ylabel(f"agreement, last {window}")
        ax.set_title(f"{name}: {s['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks live-check", description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="vllm", choices=("transformers", "vllm"))
    parser.add_argument("--requests", type=int, default=200, help="requests per stream")
    parser.add_argument("--share", type=float, default=1.0, help="the check share on the stream that loses answers")
    parser.add_argument("--holds-share", type=float, default=0.05, help="the check share where the policy holds")
    parser.add_argument(
        "--arrivals",
        type=int,
        default=240,
        help="requests arriving at random, half of them asked again in the other arm (0: none)",
    )
    parser.add_argument(
        "--arrivals-share",
        type=float,
        default=1.0,
        help="the check share while the arrivals' checks are on (a calibrated policy is checked at an eighth of it)",
    )
    parser.add_argument(
        "--risk",
        type=float,
        default=BlendConfig().quality_check_risk,
        help="the arrivals' quality_check_risk: how likely a user may arrive during a check that starts",
    )
    parser.add_argument(
        "--server",
        action="store_true",
        help="only the arrivals, on the blend server (vllm; its own page): on servers with checks on and off",
    )
    parser.add_argument("--server-rounds", type=int, default=2, help="--server: pairs of servers, checks on and off")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--render", type=Path, metavar="JSON", help="rewrite this result's page from its JSON")
    args = parser.parse_args(argv)
    if args.render:
        render(args.render)
        return
    if args.requests < 2:
        parser.error("--requests must be at least 2")
    if args.server:
        served(args, argv)
        return
    report = run(args)
    part = page_name(args)
    write_results(
        args.out,
        part,
        "The live check",
        markdown(report),
        report,
        command=f"`{' '.join(['python -m benchmarks live-check', *(argv or [])])}`",
        extra=f"\n![ratio and agreement over requests]({part}.png)\n",
    )
    plot(report, args.out / f"{part}.png")


def render(path: Path) -> None:
    """Rewrite the page of the result in ``path`` (JSON) from it, keeping its title and command: a
    ``--server`` result with the served page's markdown, which has no plot."""
    from . import live_check_served

    report, page = json.loads(path.read_text()), path.with_suffix(".md")
    title, command = page.read_text().split("\n\n", 2)[:2]
    if "served" in report:
        body = live_check_served.markdown(report)
    else:
        body = f"{markdown(report)}\n\n![ratio and agreement over requests]({page.stem}.png)"
    page.write_text(f"{title}\n\n{command}\n\n{body}\n")


def page_name(args) -> str:
    """The page's name (``--server``'s its own): an arrivals' share or risk other than the defaults is
    named in it, so that a control (``--arrivals-share 0``: both arms without checks) or a worst case
    (``--risk 1``) keeps the main page."""
    part = "live-check-served-vllm" if args.server else f"live-check-{args.backend}"
    if args.arrivals_share != 1.0:
        part += f"-share-{args.arrivals_share:g}"
    if args.risk != BlendConfig().quality_check_risk:
        part += f"-risk-{args.risk:g}"
    return part


def served(args, argv: list[str] | None) -> None:
    """``--server``: the arrivals on the blend server (``live_check_served``), on their own page."""
    from . import live_check_served

    if args.backend != "vllm" or args.server_rounds < 1 or args.arrivals < 2 * args.server_rounds:
        raise SystemExit("--server runs on vllm with at least one --server-rounds and an arrival per server")
    started = time.perf_counter()
    report = {
        "config": {
            "arrivals": args.arrivals,
            "arrivals_share": args.arrivals_share,
            "risk": args.risk,
            "rounds": args.server_rounds,
            "tokens_compared": TOKENS,
            "date": time.strftime("%Y-%m-%d"),
        },
        "served": live_check_served.served_arrivals(
            args.arrivals, args.arrivals_share, args.risk, TOKENS, args.server_rounds
        ),
    }
    report["config"]["minutes"] = round((time.perf_counter() - started) / 60, 1)
    write_results(
        args.out,
        page_name(args),
        "The live check on the blend server",
        live_check_served.markdown(report),
        report,
        command=f"`{' '.join(['python -m benchmarks live-check', *(argv or [])])}`",
    )
