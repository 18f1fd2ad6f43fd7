"""Calibration, report: a record's curve and choice as a table, and as a plot."""

from __future__ import annotations

import os
from pathlib import Path

from .records import CalibrationRecord, settings_label


def curve_table(curve: list[dict], n: int) -> list[str]:
    """The single-ratio policies measured, as a Markdown table; with probes
    of several tasks, each task's agreement (the lower bound is the worst task's)."""
    tasks = list(next((c["tasks"] for c in curve if "tasks" in c), {}))
    per_task = "".join(f" {t} |" for t in tasks)
    lines = [
        f"| settings | ratio | cost | agreement |{per_task} lower bound | first-token KL | TTFT full / blend |",
        "|---|---:|---:|---:|" + "---:|" * len(tasks) + "---:|---:|---:|",
    ]
    for c in curve:
        if c["policy"] == "ratio":
            kl = "-" if c["kl"] is None else f"{c['kl']:.4f}"
            agreement = f"{c['agreement']:.3f}" + ("" if c["n"] == n else f" (stopped after {c['n']})")
            of_tasks = "".join(
                " - |" if c["tasks"][t]["agreement"] is None else f" {c['tasks'][t]['agreement']:.3f} |" for t in tasks
            )
            lines.append(
                f"| {c['variant']} | {c['ratio']:.2f} | {c['cost']:.3f} | {agreement} |{of_tasks} "
                f"{c['lower_bound']:.3f} | {kl} | {c['ttft_speedup']:.2f}x |"
            )
    return lines


def report(record: CalibrationRecord) -> str:
    """The calibration as a table and the choice, in words."""
    lines = [
        f"Calibration of {record.model} ({record.dtype}, {record.engine} engine): {record.n} prompts, "
        f"agreement = the first {record.tokens} greedy tokens equal full prefill's; target {record.target} "
        f"(lower bound at {record.confidence:.0%} confidence); {record.seconds:.0f} s",
        *(
            [
                "Probes of "
                + ", ".join(f"{t} ({k})" for t, k in record.tasks.items())
                + ": a policy's lower bound is its worst task's."
            ]
            if len(record.tasks) > 1
            else []
        ),
        "",
        *curve_table(record.curve, record.n),
    ]
    if any(c["n"] < record.n for c in record.curve):
        lines.append(
            "\nPolicies ran cheapest first, each on the hardest probes first: one stopped early could no "
            "longer meet the target, and those costlier than a policy that met it were not run "
            "(calibrate(..., exhaustive=True) runs them all)."
        )
    guards = [c for c in record.curve if c["policy"] == "guard" and c["lower_bound"] >= record.target]
    if guards:
        best = min(guards, key=lambda c: c["cost"])
        lines.append(
            f"\nguard: base {best['ratio']:.2f}, threshold {best['threshold']:.3f} ({best['variant']} settings) "
            f"-> mean ratio "
            f"{best['mean_ratio']:.3f}, agreement {best['agreement']:.3f}, {best['ttft_speedup']:.2f}x"
        )
    if not record.meets_target:
        lines.append(f'\nChosen: full prefill ("auto" runs it): {record.why}. Lower the target, or pass a ratio.')
    elif record.ratio >= 1.0 and record.guard is None:
        lines.append(f'\nChosen: full prefill ("auto" runs it): {record.why}.')
    elif record.guard is not None:
        lines.append(
            f"\nChosen: the guard (base ratio {record.guard.base}, threshold {record.guard.threshold}, "
            f"{settings_label(record.guard_settings or record.settings)} settings)"
            + (
                "; no single ratio below 1.0 meets the target."
                if record.ratio >= 1.0
                else f"; the cheapest single ratio that meets it is {record.ratio}."
            )
        )
    else:
        lines.append(
            f"\nChosen: ratio {record.ratio} ({settings_label(record.settings)} settings), the cheapest meeting "
            "the target."
        )
    return "\n".join(lines)


def write_plot(record: CalibrationRecord, path: str | os.PathLike) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    speed = ax.twinx()
    variants = list(dict.fromkeys(c["variant"] for c in record.curve if c["policy"] == "ratio"))
    for i, v in enumerate(variants):
        rows = [c for c in record.curve if c["policy"] == "ratio" and c["variant"] == v]
        xs = [c["ratio"] for c in rows]
        color = f"C{i}"
        whole = [c for c in rows if c["n"] == record.n]
        stopped = [c for c in rows if c["n"] < record.n]
        ax.plot(
            [c["ratio"] for c in whole],
            [c["agreement"] for c in whole],
            "o-" if i == 0 else "x",
            color=color,
            label=f"agreement ({v})",
        )
        if stopped:  # measured on the hardest probes only, until they ruled the target out
            ax.plot(
                [c["ratio"] for c in stopped],
                [c["agreement"] for c in stopped],
                "v" if i == 0 else "1",
                color=color,
                label=f"stopped early ({v})",
            )
        if i == 0:
            ax.plot(
                [c["ratio"] for c in whole], [c["lower_bound"] for c in whole], ":", color=color, label="lower bound"
            )
            speed.plot(xs, [c["ttft_speedup"] for c in rows], "s--", color="grey", label="TTFT full / blend")
    ax.axhline(record.target, color="red", lw=0.8, label=f"target {record.target}")
    ax.set_xlabel("recompute ratio")
    ax.set_ylabel(f"agrees with full prefill (first {record.tokens} tokens)")
    speed.set_ylabel("TTFT speedup")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{Path(record.model).name}: {record.n} prompts, chosen {record.ratio}", fontsize=9)
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
