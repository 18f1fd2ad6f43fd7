"""The live check on the blend server (``python -m blend_integrations.serve --quality-check``):
do its checks, walked on the workers in slices between engine steps, slow the users who arrive
while one is in flight?

    python -m benchmarks live-check --server [--arrivals 80] [--arrivals-share 1.0] [--risk 1.0]

``--arrivals-share 0`` is a control: every server runs without checks, in the same turns, so the
arms differ by chance and by server alone (its own page, as a share or risk other than the
defaults: ``live-check-served-vllm-share-0.md``).

The bundled reader is served at the policy its vLLM calibration chose (kept in the server's store
as a user's own calibration), and its requests arrive at random (exponential gaps, about half the
server busy), each streamed over HTTP as a user's would be: the time to first token is the first
streamed event's. The server cannot switch its checks off while it runs, so the arms are servers,
one after another on one store, with checks on (``--quality-check SHARE``) and off
(``--quality-check 0``). They come in pairs, ``--server-rounds`` of them, in the order on-off,
off-on, on-off, ... (so neither arm is always the later one), and both servers of a pair are asked
the same requests with the same gaps between them: each request's time to first token with checks
on over off is a paired ratio, and their median, with its distribution-free confidence interval,
is what the arms differ by (a control run, no checks on either server, gives the noise's own
width). Each server asks a few requests first, untimed, so that no arm pays for vLLM's start. The
checks that ended while users came are read from ``/metrics`` around each block.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from pathlib import Path

from tqdm.auto import tqdm

from blend_integrations import load_engine
from tests.fixtures.blend_server import BlendServer, checks_ended

from . import machine, scratch_dir
from .live_check import ARMS, BLOCK, holding_record, policy_label, ttft_quantiles
from .paired import paired, paired_text
from .quality import model_and_task

SERVED_SEED = 77_300  # a seed no other run uses
UNTIMED = 3  # requests asked first on each server, untimed: vLLM's first steps are slower


def drained(server, timeout_s: float = 600) -> dict:
    """The server's live checks once none waits for a lull or runs (a preempted one runs again first),
    seen twice a second apart: the server picks an answer for a check just after its last byte."""
    deadline = time.monotonic() + timeout_s
    idle_since = None
    while True:
        now = server.live_checks()
        if now["waiting"]:
            idle_since = None
        elif idle_since is None:
            idle_since = time.monotonic()
        if (idle_since is not None and time.monotonic() - idle_since >= 1.0) or time.monotonic() > deadline:
            return now
        time.sleep(0.25)


def served_arrivals(n: int, share: float, risk: float, tokens: int, rounds: int = 2) -> dict:
    """``n / 2`` of the reader's requests, each asked of both servers of one of ``rounds`` pairs
    (``ARMS``, on-off then off-on, in turn), in blocks of ``BLOCK`` with the same random gaps on
    both; each user's streamed time to first token, failures, the server's check counts, and the
    paired ratios' median."""
    servers = [(r, arm) for r in range(rounds) for arm in (ARMS if r % 2 == 0 else ARMS[::-1])]
    reader_dir, task, label = model_and_task("reader")
    per_server = n // len(servers)
    examples = task.examples((per_server + UNTIMED) * rounds, SERVED_SEED, None)
    store, logs = scratch_dir("blend-live-check-store-"), Path(scratch_dir("blend-live-check-logs-"))
    by_request: dict[str, dict[int, float]] = {arm: {} for arm in ARMS}  # per arm: request key -> TTFT
    failed = dict.fromkeys(ARMS, 0)
    checks: dict[str, dict] = {}
    policy, gap = None, None
    lock = threading.Lock()

    def user(engine, prompt, arm: str, key: int, mine: list[float]) -> None:
        try:
            stream = engine.stream(prompt, max_tokens=tokens)
            for _ in stream:
                pass
            ttft = stream.result().ttft_s
            with lock:
                by_request[arm][key] = ttft
                mine.append(ttft)
        except Exception:  # counted: a check must never make a user's request fail
            with lock:
                failed[arm] += 1

    for i, (pair, arm) in enumerate(servers):
        args = ["--quality-check", str(share if arm == "checks on" else 0.0), "--quality-check-risk", str(risk)]
        with BlendServer(reader_dir, store=store, log=logs / f"server-{i}.log", args=args) as server:
            engine = load_engine(server.url, backend="server")
            if policy is None:  # kept in the store: every later server on it reads it
                info = engine.served_model()
                record = holding_record(
                    "vllm", fingerprint=info["fingerprint"], dtype=info["dtype"], num_layers=info["num_layers"]
                )
                engine.keep_calibration(record)
                policy = policy_label(record)
            mine = examples[pair * (per_server + UNTIMED) : (pair + 1) * (per_server + UNTIMED)]
            engine.warm(sorted({d for e in mine for d in e.documents}))
            prompts = [task.prompt(e, engine.tokenizer, engine.config.separator) for e in mine]
            busy = statistics.fmean(engine.generate(p, max_tokens=tokens).total_s for p in prompts[:UNTIMED])
            gap = gap or 2 * busy  # about half the server busy; the first server's, kept for all
            before_all = drained(server)
            rng = random.Random(SERVED_SEED + pair)  # the pair's other server waits the same gaps
            during, this_server = 0.0, []
            for block in tqdm(range(UNTIMED, len(prompts), BLOCK), desc=f"server {i + 1}: {arm}", unit="block"):
                threads = []
                before = checks_ended(server.live_checks())
                for j, p in enumerate(prompts[block : block + BLOCK], start=block):
                    key = pair * len(prompts) + j
                    t = threading.Thread(target=user, args=(engine, p, arm, key, this_server))
                    t.start()
                    threads.append(t)
                    time.sleep(rng.expovariate(1.0 / gap))
                for t in threads:
                    t.join()
                during += checks_ended(server.live_checks()) - before
                drained(server)
            after = drained(server)
            counts = {
                k: after.get(k, 0) - before_all.get(k, 0)
                for k in ("agreed", "disagreed", "failed", "preempted", "given_up", "dropped")
            }
            checks[f"{i + 1}: {arm}"] = counts | {
                "ended_while_users_came": during,
                "ratio_after": after["ratio"],
                "ttft_p50": round(statistics.median(this_server), 4) if this_server else None,
            }
    return {
        "cpu": machine(),
        "model": f"{label}, at the policy its vLLM calibration chose ({policy})",
        "mean_gap_s": round(gap, 3),
        "ttft": {arm: ttft_quantiles(list(xs.values())) for arm, xs in by_request.items() if xs},
        "paired": paired(*(by_request[arm] for arm in ARMS)),
        "failed": failed,
        "checks": checks,
    }


def markdown(report: dict) -> str:
    c, a = report["config"], report["served"]
    # pages from before the arrivals were paired (no "paired" in them) keep their own wording
    paired = "paired" in a
    lines = [
        f"vllm engine served (`python -m blend_integrations.serve`) on {a['cpu']}; {c['date']}; {c['minutes']} min.",
        "",
        f"Arrivals: {c['arrivals']} of the reader's requests ({a['model']}) at random (mean gap {a['mean_gap_s']} s), "
        f"streamed over HTTP, on {len(a['checks'])} servers one after another on one store"
        + (
            ", in pairs (on-off, off-on, ...) whose two servers are asked the same requests with the same gaps: "
            if paired
            else " (each asked its own requests): "
        )
        + (
            "a control, every server with `--quality-check 0` (the arms are named as in a run with checks, in the "
            "same turns: they differ by chance and by server alone):"
            if c["arrivals_share"] == 0
            else f"checks on (`--quality-check {c['arrivals_share']:g}`; its calibrated policy is checked at an "
            f"eighth of it; `--quality-check-risk {c['risk']:g}`) and off" + (":" if paired else ", in turn:")
        ),
        "",
        "| | requests | TTFT p50 (s) | TTFT p95 (s) | failed |",
        "|---|---:|---:|---:|---:|",
    ]
    for arm, t in a["ttft"].items():
        lines.append(f"| {arm} | {t['n']} | {t['p50']} | {t['p95']} | {a['failed'][arm]} |")
    # older pages kept no server's own TTFT
    per_server = any("ttft_p50" in k for k in a["checks"].values())
    lines += [
        "",
        "| server | " + ("users' TTFT p50 (s) | " if per_server else "") + "checks agreed | disagreed | failed | "
        'preempted by a user | given up | dropped | ended while users came | ratio "auto" gives after |',
        "|---|" + ("---:|" if per_server else "") + "---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, k in a["checks"].items():
        ratio = ", ".join(f"{v:g} ({s})" for s, v in k["ratio_after"].items())
        lines.append(
            f"| {name} | "
            + (f"{k.get('ttft_p50') or ''} | " if per_server else "")
            + f"{k['agreed']:g} | {k['disagreed']:g} | {k['failed']:g} | {k['preempted']:g} | "
            f"{k['given_up']:g} | {k['dropped']:g} | {k['ended_while_users_came']:g} | {ratio} |"
        )
    on, off = a["ttft"].get("checks on"), a["ttft"].get("checks off")
    if on and off:
        median = "the arms' median" if paired else "the median"
        during = sum(k["ended_while_users_came"] + k["preempted"] for k in a["checks"].values())
        lines.append(
            (
                "\n- A control (no checks on any server): "
                if c["arrivals_share"] == 0
                else "\n- No user slower (the goal): "
            )
            + "time to first token with checks on over off, "
            + paired_text(a.get("paired"))
            + f"{on['p50'] / off['p50']:.2f}x at {median}, {on['p95'] / off['p95']:.2f}x at p95; "
            f"{a['failed']['checks on']} failed with checks on"
            + (
                "; no check was in flight while users came, so the arms differ by chance and by server."
                if not during
                else "."
            )
        )
    return "\n".join(lines) + "\n"
