"""The wide study's report (`lowbitcc.tools.study.wide`): per cell (configuration x ranks), each
candidate's final validation-loss gap to the exact run of its seed, its mean and standard error
over the seeds, the paired difference with its no-feedback twin, and the choice of the default:
among the candidates of at most `MAX_BITS` wire bits per element that ran in every cell, the
one whose worst cell (largest mean gap) is best."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from lowbitcc.tools.plotting import pyplot
from lowbitcc.tools.study.variants import VARIANTS, wire_bits

MAX_BITS = 4.6
GOAL_GAP = 0.003
"""The wide study's goal: the default's mean gap within 0.3% of exact in every cell."""
Cell = tuple[str, int]


def bits(variant: str) -> float:
    """`variants.wire_bits` of a study variant; NaN for a name that is none."""
    return wire_bits(variant) if variant in VARIANTS else math.nan


def twin(variant: str) -> str | None:
    """The same format without feedback: ``<variant>-nofb`` where that variant exists, else the
    twin of the variant's format (``nvfp4-nofb`` for ``nvfp4-warm100``); None for a variant
    without feedback."""
    if variant.endswith("-nofb"):
        return None
    own = f"{variant}-nofb"
    if own in VARIANTS or variant not in VARIANTS:
        return own
    fmt = dict(VARIANTS[variant].env).get("LOCO_FORMAT")
    return f"{fmt}-nofb" if f"{fmt}-nofb" in VARIANTS else own


def _final(record: dict[str, Any], key: str) -> float | None:
    series = record.get(key)
    return series[-1][1] if series else None


def gaps(runs: list[dict[str, Any]]) -> dict[Cell, dict[str, dict[int, tuple[float, float | None]]]]:
    """Per cell, variant and seed: ``(gap, accuracy gap)``: the relative final validation-loss
    gap to exact of the same seed and cell, and the final accuracy minus exact's (classifiers;
    else None). Runs without their exact are left out."""
    exact = {(r["configuration"], r["world"], r["seed"]): r for r in runs if r["variant"] == "exact"}
    out: dict[Cell, dict[str, dict[int, tuple[float, float | None]]]] = {}
    for r in runs:
        ref = exact.get((r["configuration"], r["world"], r["seed"]))
        if ref is None or r["variant"] == "exact":
            continue
        loss, ref_loss = _final(r, "val_loss"), _final(ref, "val_loss")
        acc, ref_acc = _final(r, "val_accuracy"), _final(ref, "val_accuracy")
        acc_gap = acc - ref_acc if acc is not None and ref_acc is not None else None
        cell = (r["configuration"], r["world"])
        out.setdefault(cell, {}).setdefault(r["variant"], {})[r["seed"]] = (
            (loss - ref_loss) / ref_loss, acc_gap)
    return out


def mean_se(values: list[float]) -> tuple[float, float]:
    """The mean of ``values`` and its standard error (NaN for a single value)."""
    mean = sum(values) / len(values)
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan
    return mean, se


def cell_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per cell and variant: seeds, per-seed gaps, mean gap and its standard error,
    mean accuracy gap (classifiers), and ``vs_twin`` / ``vs_twin_se``: the paired difference of
    the gap with the no-feedback twin's over the seeds both ran (negative: feedback helps)."""
    rows = []
    for cell, variants in gaps(runs).items():
        for variant, by_seed in variants.items():
            mean, se = mean_se([g for g, _ in by_seed.values()])
            accs = [a for _, a in by_seed.values() if a is not None]
            row: dict[str, Any] = {
                "configuration": cell[0], "world": cell[1], "variant": variant,
                "bits": bits(variant), "seeds": sorted(by_seed),
                "each": [by_seed[s][0] for s in sorted(by_seed)], "mean_gap": mean, "se": se,
                "accuracy_gap": sum(accs) / len(accs) if accs else None}
            other = variants.get(twin(variant) or "")
            paired = [by_seed[s][0] - other[s][0] for s in by_seed if other and s in other]
            if paired:
                row["vs_twin"], row["vs_twin_se"] = mean_se(paired)
            rows.append(row)
    return rows


def choose(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The default by the worst cell: per variant of at most `MAX_BITS` bits that ran in every
    cell, its worst (largest) mean gap; the chosen one has the smallest. Also says whether it
    meets the goals: every cell's mean gap within `GOAL_GAP`, and in every cell no worse than
    its no-feedback twin by more than one standard error of the paired difference."""
    cells = {(r["configuration"], r["world"]) for r in rows}
    by_variant: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_variant.setdefault(r["variant"], []).append(r)
    ranking = []
    for variant, mine in by_variant.items():
        if len(mine) < len(cells) or not bits(variant) <= MAX_BITS:
            continue
        worst = max(mine, key=lambda r: r["mean_gap"])
        ranking.append({"variant": variant, "worst_gap": worst["mean_gap"],
                        "worst_cell": (worst["configuration"], worst["world"]),
                        "mean_of_cells": sum(r["mean_gap"] for r in mine) / len(mine)})
    ranking.sort(key=lambda r: r["worst_gap"])
    if not ranking:
        return {"ranking": [], "chosen": None}
    chosen = ranking[0]["variant"]
    mine = by_variant[chosen]
    within = all(r["mean_gap"] <= GOAL_GAP for r in mine)
    twins_ok = all(r["vs_twin"] <= (0.0 if math.isnan(r["vs_twin_se"]) else r["vs_twin_se"])
                   for r in mine if "vs_twin" in r)
    return {"ranking": ranking, "chosen": chosen, "within_goal": within,
            "no_worse_than_twin": twins_ok,
            "twin_measured": any("vs_twin" in r for r in mine)}


def pct(x: float | None, signed: bool = True) -> str:
    """``x`` as a percentage with two decimals (signed unless ``signed`` is False); "" for
    None or NaN."""
    if x is None or math.isnan(x):
        return ""
    return f"{100 * x:+.2f}%" if signed else f"{100 * x:.2f}"


def format_markdown(runs: list[dict[str, Any]]) -> str:
    """The tables of docs/convergence.md: one per cell, then the ranking by worst cell."""
    rows = cell_rows(runs)
    out = []
    for cell in sorted({(r["configuration"], r["world"]) for r in rows}):
        mine = [r for r in rows if (r["configuration"], r["world"]) == cell]
        classifier = any(r["accuracy_gap"] is not None for r in mine)
        out += [f"**{cell[0]}, {cell[1]} ranks**", "",
                "| variant | bits | per seed | mean gap | ± se | minus no-feedback twin (± se) |"
                + (" accuracy vs exact |" if classifier else ""),
                "|---|---:|---|---:|---:|---:|" + ("---:|" if classifier else "")]
        for r in mine:
            each = " ".join(pct(g) for g in r["each"])
            twin_cell = (f"{pct(r['vs_twin'])} ± {pct(r['vs_twin_se'], False)}"
                         if "vs_twin" in r else "")
            acc = (f" {100 * r['accuracy_gap']:+.2f} points |" if classifier
                   and r["accuracy_gap"] is not None else (" |" if classifier else ""))
            out.append(f"| {r['variant']} | {r['bits']:.2f} | {each} | {pct(r['mean_gap'])} | "
                       f"{pct(r['se'], False)} | {twin_cell} |{acc}")
        out.append("")
    verdict = choose(rows)
    out += ["| variant | worst cell | worst mean gap | mean over cells |", "|---|---|---:|---:|"]
    for r in verdict["ranking"]:
        out.append(f"| {r['variant']} | {r['worst_cell'][0]}, {r['worst_cell'][1]} ranks | "
                   f"{pct(r['worst_gap'])} | {pct(r['mean_of_cells'])} |")
    chosen = verdict["chosen"]
    if chosen:
        if twin(chosen) is None:
            twin_text = "it sends without feedback"
        elif not verdict["twin_measured"]:
            twin_text = "its no-feedback twin was not run"
        else:
            twin_text = ("no worse than its no-feedback twin beyond one standard error: "
                         + ("yes" if verdict["no_worse_than_twin"] else "no"))
        out += ["", f"Best by its worst cell: **{chosen}**; every cell within "
                f"{100 * GOAL_GAP:.1f}%: {'yes' if verdict['within_goal'] else 'no'}; "
                f"{twin_text}."]
    return "\n".join(out)


def plot_frontier(runs: list[dict[str, Any]], path: Path) -> None:
    """Mean gap (with its standard error) against wire bits per element, one panel per cell."""
    plt = pyplot("frontier plot")
    if plt is None:
        return
    rows = cell_rows(runs)
    cells = sorted({(r["configuration"], r["world"]) for r in rows})
    if not cells:
        return
    fig, axes = plt.subplots(1, len(cells), figsize=(4.5 * len(cells), 4), squeeze=False)
    for ax, cell in zip(axes[0], cells, strict=True):
        for r in (r for r in rows if (r["configuration"], r["world"]) == cell):
            se = 0.0 if math.isnan(r["se"]) else 100 * r["se"]
            ax.errorbar(r["bits"], 100 * r["mean_gap"], yerr=se, fmt="o", capsize=3,
                        label=r["variant"])
        finish_panel(ax, cell, "wire bits per element", "final validation loss gap to exact, %",
                     (GOAL_GAP,))
    save(plt, fig, path)


def finish_panel(ax: Any, cell: Cell, xlabel: str, ylabel: str,
                 goals: tuple[float, ...]) -> None:
    """A cell's panel of a gap plot: the zero line, a dashed line at each of ``goals`` (as
    fractions), the cell as title, the axes' labels, a grid and the legend."""
    ax.axhline(0, color="black", linewidth=0.8)
    for goal in goals:
        ax.axhline(100 * goal, color="gray", linewidth=0.8, linestyle="--")
    ax.set(title=f"{cell[0]}, {cell[1]} ranks", xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def save(plt: Any, fig: Any, path: Path) -> None:
    """Lay out ``fig``, write it to ``path`` (100 dpi) and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
