"""The long form's report (``lowbitcc study --wide long``): the gap to exact over the whole run.

A run records its validation loss every ``eval_every`` steps on a few fixed batches and after
the last step on more (`training.train_rank`); exact's run of the same seed and cell is
evaluated at the same steps on the same batches. Per cell, variant and evaluation step the gap
is ``(loss - exact's) / exact's``, averaged over the seeds that reached that step (with its
standard error): the curves show whether a format's gap drifts as the run goes on (what a
300-step run cannot show), and where two variants' curves cross.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from lowbitcc.tools.plotting import pyplot
from lowbitcc.tools.study.variants import THE_DEFAULT
from lowbitcc.tools.study.wide_report import GOAL_GAP, finish_panel, mean_se, pct, save

Cell = tuple[str, int]
Curve = list[tuple[int, float, float, int]]
"""``(step, mean gap, standard error, seeds)`` per evaluation step, in step order."""


def gap_curves(runs: list[dict[str, Any]]) -> dict[Cell, dict[str, Curve]]:
    """Per cell and variant, the gap to exact at every evaluation step that the variant's run
    and exact's run of the same seed both recorded (a run's final evaluation included)."""
    exact = {(r["configuration"], r["world"], r["seed"]): dict(map(tuple, r["val_loss"]))
             for r in runs if r["variant"] == "exact"}
    per_step: dict[Cell, dict[str, dict[int, list[float]]]] = {}
    for r in runs:
        ref = exact.get((r["configuration"], r["world"], r["seed"]))
        if ref is None or r["variant"] == "exact":
            continue
        steps = per_step.setdefault((r["configuration"], r["world"]), {}).setdefault(
            r["variant"], {})
        for step, loss in r["val_loss"]:
            if step in ref:
                steps.setdefault(step, []).append((loss - ref[step]) / ref[step])
    out: dict[Cell, dict[str, Curve]] = {}
    for cell, variants in per_step.items():
        for variant, steps in variants.items():
            curve = []
            for step in sorted(steps):
                curve.append((step, *mean_se(steps[step]), len(steps[step])))
            out.setdefault(cell, {})[variant] = curve
    return out


def crossings(a: Curve, b: Curve) -> list[int]:
    """The evaluation steps at which curve ``a``'s mean gap passes ``b``'s (the sign of their
    difference changes from the previous common step; a zero difference takes no side)."""
    other = {step: gap for step, gap, _, _ in b}
    steps, sign = [], 0
    for step, gap, _, _ in a:
        if step not in other or gap == other[step]:
            continue
        now = 1 if gap > other[step] else -1
        if sign and now != sign:
            steps.append(step)
        sign = now
    return steps


def format_markdown(runs: list[dict[str, Any]], every: int = 500) -> str:
    """Per cell: the mean gap of each variant at every ``every``-th step and at the last (the
    final evaluation, on more batches), the seeds behind it, and where the variants' curves
    cross the first variant's (the default's, when it ran)."""
    out = []
    for cell, variants in sorted(gap_curves(runs).items()):
        names = sorted(variants, key=lambda v: (v != THE_DEFAULT, not v.endswith("-nofb"), v))
        last = max(step for curve in variants.values() for step, *_ in curve)
        shown = sorted({step for curve in variants.values() for step, *_ in curve
                        if step % every == 0 or step == last} - {0})
        out += [f"**{cell[0]}, {cell[1]} ranks** (gap to exact's validation loss, mean over "
                "the seeds; their count in brackets)", "",
                "| step | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
        for step in shown:
            cells = []
            for name in names:
                point = next((p for p in variants[name] if p[0] == step), None)
                cells.append("" if point is None else f"{pct(point[1])} ({point[3]})")
            out.append(f"| {step} | " + " | ".join(cells) + " |")
        for name in names[1:]:
            crossed = crossings(variants[name], variants[names[0]])
            out.append(f"\n{name} against {names[0]}: "
                       + (f"the curves cross at steps {', '.join(map(str, crossed))}"
                          if crossed else "the curves do not cross"))
        out.append("")
    return "\n".join(out)


def plot_gaps(runs: list[dict[str, Any]], path: Path) -> None:
    """Gap to exact against step, one line per variant (its standard error shaded where there
    are seeds enough), one panel per cell."""
    plt = pyplot("gap plot")
    curves = gap_curves(runs)
    if plt is None or not curves:
        return
    cells = sorted(curves)
    fig, axes = plt.subplots(1, len(cells), figsize=(5 * len(cells), 4), squeeze=False)
    for ax, cell in zip(axes[0], cells, strict=True):
        for variant, curve in sorted(curves[cell].items()):
            steps = [p[0] for p in curve]
            means = [100 * p[1] for p in curve]
            ax.plot(steps, means, marker=".", label=variant)
            if all(not math.isnan(p[2]) for p in curve):
                ax.fill_between(steps, [m - 100 * p[2] for m, p in zip(means, curve, strict=True)],
                                [m + 100 * p[2] for m, p in zip(means, curve, strict=True)],
                                alpha=0.2)
        finish_panel(ax, cell, "step", "validation loss gap to exact, %", (GOAL_GAP, -GOAL_GAP))
    save(plt, fig, path)
