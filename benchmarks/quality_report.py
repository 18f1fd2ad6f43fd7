"""Benchmarks: the answer-quality table as Markdown, the BlendConfig defaults
it recommends (``recommended_defaults``, the rules the defaults follow) and
its plot against the recompute ratio; ``benchmarks/quality.py`` measures it."""

from __future__ import annotations

from pathlib import Path

from blend_integrations.config import SELECTIONS

COLUMNS = (
    ("agree", "agrees with full"),
    ("kl", "first-token KL vs full"),
    ("contains_1hop", "contains 1-hop"),
    ("contains_2hop", "contains 2-hop"),
    ("em_1hop", "EM 1-hop"),
    ("em_2hop", "EM 2-hop"),
    ("f1_1hop", "F1 1-hop"),
    ("f1_2hop", "F1 2-hop"),
)


def markdown(report: dict) -> str:
    """The table, led by what is measured against full prefill (agreement and
    KL), then the answers' accuracy; columns a report lacks are left out."""
    c = report["config"]
    name = c["model"] if "/" not in c["model"] else f"`{Path(c['model']).name}`"
    docs = f", of {c['doc_tokens'][0]}-{c['doc_tokens'][1]} words" if "doc_tokens" in c else ""
    lines = [
        (
            f"Model {name} ({c['layers']} layers); {c['questions']} held-out questions "
            f"({c['questions_1hop']} 1-hop, {c['questions_2hop']} 2-hop), {c['documents_per_question'][0]}-"
            f"{c['documents_per_question'][1]} documents each{docs} in shuffled order, {c['mean_prompt_tokens']} prompt "
            f"tokens on average; greedy, at most {c['max_tokens']} tokens; "
            + (f"{c['device']}, {c['dtype']}; " if "device" in c else "")
            + f"{c['date']}."
        ),
        "",
    ]
    if c.get("system_prompt"):
        lines += [f'System prompt: "{c["system_prompt"]}"', ""]
    first = next(iter(report["modes"].values()))
    columns = [(key, title) for key, title in COLUMNS if key in first]
    lines += ["| mode | " + " | ".join(title for _, title in columns) + " |", "|---|" + "---:|" * len(columns)]
    for mode, m in report["modes"].items():
        cells = ["-" if m[key] is None else f"{m[key]:.4f}" if key == "kl" else f"{m[key]:.3f}" for key, _ in columns]
        lines.append(f"| {mode} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


EM_TOLERANCE = 0.02  # the exact-match loss against full prefill that blending may cost (issue 6)
KL_LIMIT = 0.01  # first-token KL a default ratio must stay under: EM on a few hundred questions is coarse


ACCURACY = {"em": "exact match", "contains": "answer contained"}


def recommended_defaults(modes: dict, accuracy: str = "em") -> dict[str, tuple[object, str]]:
    """BlendConfig defaults worked out from the table: {field: (value, why)}.
    ``accuracy``: the metric the rules read, ``"em"`` (exact match) or
    ``"contains"`` (the answer contained in the reply), on both question sets.

    The ratio: the smallest measured one (of deviation selection, CacheBlend's)
    within EM_TOLERANCE accuracy of full prefill on both sets whose first-token
    KL is under KL_LIMIT. The variants, measured at 0.15 against blend@0.15:
    key deviation costs the same, so it wins when its accuracy is at least as
    high on both sets and its KL lower; gradual filtering and sink tokens
    compute more, so they win only when they raise accuracy by more than
    EM_TOLERANCE on a set without lowering the other; query and mixed
    selection compute a reuse pass more, so one wins when its agreement with
    full prefill and its KL are both at least as good as blend@0.15's and its
    accuracy is not more than EM_TOLERANCE lower on either set (the better of
    the two when both do)."""
    keys, label = (f"{accuracy}_1hop", f"{accuracy}_2hop"), ACCURACY[accuracy]
    full, base = modes["full"], modes.get("blend@0.15")
    out: dict[str, tuple[object, str]] = {}
    for ratio, name in series(modes, "deviation")[1 if "reuse" in modes else 0 :]:
        gaps = [round(full[k] - modes[name][k], 6) for k in keys]  # 0.9 - 0.88 is not 0.02 in floats
        if max(gaps) <= EM_TOLERANCE and modes[name]["kl"] <= KL_LIMIT:
            why = (
                f"{name}: {label} {-gaps[0]:+.3f} (1-hop) and {-gaps[1]:+.3f} (2-hop) against full prefill, "
                f"first-token KL {modes[name]['kl']:.4f}"
            )
            out["recompute_ratio"] = (ratio, why)
            break
    if base is None:
        return out

    def gains(variant: str) -> list[float]:
        return [round(modes[variant][k] - base[k], 6) for k in keys]

    for field, variant, value, default in (
        ("deviation", "blend@0.15 k-deviation", "k", "v"),
        ("check_layers", "blend@0.15 gradual", (1, 2, 3), (1,)),
        ("sink_tokens", "blend@0.15 sink4", 4, 0),
    ):
        if variant not in modes:
            continue
        g, kl_ratio = gains(variant), modes[variant]["kl"] / max(base["kl"], 1e-12)
        measured = (
            f"{variant}: {label} {g[0]:+.3f} (1-hop) and {g[1]:+.3f} (2-hop), "
            f"first-token KL {kl_ratio:.2f}x blend@0.15's"
        )
        if field == "deviation":
            wins = min(g) >= 0 and kl_ratio < 1
        else:
            wins = max(g) > EM_TOLERANCE and min(g) >= 0
        out[field] = (value if wins else default, measured)
    chosen, reasons = "deviation", []
    for selection in SELECTIONS[1:]:
        variant = f"blend@0.15 {selection}"
        if variant not in modes:
            continue
        m, g = modes[variant], gains(variant)
        reasons.append(
            f"{variant}: agrees with full {m['agree'] - base['agree']:+.3f}, first-token KL "
            f"{m['kl'] / max(base['kl'], 1e-12):.2f}x blend@0.15's, {label} {g[0]:+.3f} (1-hop) and {g[1]:+.3f} (2-hop)"
        )
        good = m["agree"] >= base["agree"] and m["kl"] <= base["kl"] and min(g) >= -EM_TOLERANCE
        if good and (chosen == "deviation" or m["kl"] < modes[f"blend@0.15 {chosen}"]["kl"]):
            chosen = selection
    if reasons:
        out["selection"] = (chosen, "; ".join(reasons))
    return out


def defaults_note(report: dict) -> str:
    """BlendConfig's defaults against what the table recommends."""
    m, d = report["modes"], report["config"]["defaults"]
    if "full" not in m:
        return ""
    accuracy = report["config"].get("accuracy", "em")
    keys, label = (f"{accuracy}_1hop", f"{accuracy}_2hop"), ACCURACY[accuracy]
    actual = {
        "recompute_ratio": d["recompute_ratio"],
        "deviation": d["deviation"],
        "check_layers": tuple(d["check_layers"]),
        "sink_tokens": d["sink_tokens"],
        "selection": d.get("selection", "deviation"),
    }
    rec = recommended_defaults(m, accuracy)
    rules = (
        f"How BlendConfig's defaults follow from this table (`recommended_defaults` in "
        f"benchmarks/quality_report.py): the ratio is the smallest within {EM_TOLERANCE} {label} of "
        f"full prefill on both sets whose first-token KL is under {KL_LIMIT}; key deviation (same cost) must "
        f"match value deviation's {label} and lower its KL; gradual filtering and sink tokens (more "
        f"computed tokens) must raise {label} by more than {EM_TOLERANCE} on a set; query and mixed selection (a "
        f"reuse pass more) must match blend@0.15's agreement with full prefill and KL, losing at most "
        f"{EM_TOLERANCE} {label} on a set."
    )
    lines = [rules, ""]
    if "recompute_ratio" not in rec:
        lines.append("- `recompute_ratio`: no measured ratio qualifies.")
    for field, (value, why) in rec.items():
        lines.append(f"- `{field}`: {value!r}; {why}.")
    differ = [k for k, (v, _) in rec.items() if actual[k] != v]
    lines.append("")
    lines.append(
        "BlendConfig defaults: "
        + ", ".join(f"{k}={v!r}" for k, v in actual.items())
        + ": "
        + (
            "set from this table."
            if not differ and len(rec) == len(actual)
            else "they differ from this table in " + ", ".join(differ or ["fields not measured"]) + "."
        )
    )
    if "reuse" in m and "blend@0.15" in m:
        gaps = [round(m["full"][k] - m["reuse"][k], 3) for k in keys]
        worse = sum(m["reuse"][k] for k in keys) < sum(m["blend@0.15"][k] for k in keys)
        lines.append(
            f"Reuse (nothing recomputed) is {gaps[0]} (1-hop) and {gaps[1]} (2-hop) {label} "
            f"below full prefill, first-token KL {m['reuse']['kl']:.4f}: "
            + ("worse than" if worse else "not worse than")
            + f" blend@0.15 in {label} on this model."
        )
    return "\n".join(lines) + "\n"


def series(modes: dict, selection: str) -> list[tuple[float, str]]:
    """(ratio, mode name) of the blend modes of one selection, reuse as ratio 0."""
    suffix = "" if selection == "deviation" else f" {selection}"
    points = sorted(
        (float(n.split("@")[1].split(" ")[0]), n)
        for n in modes
        if n.startswith("blend@") and n.removeprefix("blend@").partition(" ")[2] == suffix.strip()
    )
    return ([(0.0, "reuse")] if "reuse" in modes else []) + points


def plot(report: dict, path: Path) -> None:
    """Exact match and first-token KL against the recompute ratio; reuse is ratio 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = report["modes"]
    accuracy = report["config"].get("accuracy", "em")
    points = series(modes, "deviation")
    x = [r for r, _ in points]
    fig, (em_ax, kl_ax) = plt.subplots(1, 2, figsize=(9, 3.6))
    for metric, colour in ((f"{accuracy}_1hop", "tab:blue"), (f"{accuracy}_2hop", "tab:orange")):
        hops = metric.split("_")[1]
        em_ax.plot(x, [modes[n][metric] for _, n in points], "o-", color=colour, label=f"blend, {hops}")
        if "full" in modes:
            em_ax.axhline(
                modes["full"][metric], color=colour, linestyle="--", linewidth=1, label=f"full prefill, {hops}"
            )
    if modes[points[0][1]].get("agree") is not None:
        em_ax.plot(x, [modes[n]["agree"] for _, n in points], "s-", color="tab:purple", label="agrees with full")
    em_ax.set_xlabel("recompute ratio (0: reuse)")
    em_ax.set_ylabel(ACCURACY[accuracy])
    em_ax.set_ylim(0, 1.05)
    for selection, colour in (("deviation", "tab:green"), ("query", "tab:red"), ("mixed", "tab:brown")):
        line = series(modes, selection)
        if selection != "deviation" and len(line) > 1:
            em_ax.plot(
                [r for r, _ in line],
                [modes[n]["agree"] for _, n in line],
                "^:",
                color=colour,
                label=f"agrees with full, {selection}",
            )
        kl = [(r, modes[n]["kl"]) for r, n in line if modes[n]["kl"]]
        if len(kl) > 1 or selection == "deviation":
            kl_ax.plot([r for r, _ in kl], [v for _, v in kl], "o-", color=colour, label=selection)
    kl_ax.legend(fontsize=7)
    em_ax.legend(fontsize=6, loc="center right")
    kl_ax.set_yscale("log")
    kl_ax.set_xlabel("recompute ratio (0: reuse)")
    kl_ax.set_ylabel("first-token KL vs full prefill")
    fig.suptitle(f"Answer quality against the recompute ratio ({report['config']['questions']} questions)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
