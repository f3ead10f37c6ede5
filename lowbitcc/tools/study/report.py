"""The study's report: per-run and across-seed summaries, tables and the plot."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from lowbitcc.tools.plotting import pyplot


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per run: final validation loss, its gap to the exact run of the same seed, the distance of
    the final weights from exact's (relative L2), mean |train loss - exact's|, bytes, time."""
    exact = {r["seed"]: r for r in runs if r["variant"] == "exact"}
    rows = []
    for r in runs:
        ref = exact.get(r["seed"])
        final = r["val_loss"][-1][1]
        row = {"variant": r["variant"], "seed": r["seed"], "final_val_loss": final,
               "seconds": r["seconds"], "wire_bytes_per_step": r["wire_bytes_per_step"]}
        if ref is not None:
            ref_final = ref["val_loss"][-1][1]
            row["gap_to_exact"] = (final - ref_final) / ref_final
            a, b = r["final_params"], ref["final_params"]
            row["weight_distance"] = float((a - b).norm() / b.norm())
            n = min(len(r["train_loss"]), len(ref["train_loss"]))
            row["train_curve_distance"] = sum(
                abs(x - y) for x, y in zip(r["train_loss"][:n], ref["train_loss"][:n])) / n
            row["bytes_vs_exact"] = r["wire_bytes_per_step"] / ref["wire_bytes_per_step"]
        rows.append(row)
    return rows


def across_seeds(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per compared variant (in first-seen order): the seeds it ran, the mean, sample standard
    deviation, lowest and highest gap to exact, and the mean of ``gap - loco4's gap`` over the
    seeds both ran (positive: worse than 4-bit LoCo)."""
    gaps: dict[str, dict[int, float]] = {}
    for row in summary:
        if "gap_to_exact" in row and row["variant"] != "exact":
            gaps.setdefault(row["variant"], {})[row["seed"]] = row["gap_to_exact"]
    loco = gaps.get("loco4", {})
    rows = []
    for variant, by_seed in gaps.items():
        values = list(by_seed.values())
        row = {"variant": variant, "seeds": sorted(by_seed), "mean_gap": sum(values) / len(values),
               "sd_gap": statistics.stdev(values) if len(values) > 1 else 0.0,
               "min_gap": min(values), "max_gap": max(values)}
        paired = [by_seed[s] - loco[s] for s in by_seed if s in loco]
        if paired and variant != "loco4":
            row["vs_loco4"] = sum(paired) / len(paired)
            row["vs_loco4_each"] = paired
        rows.append(row)
    return rows


def format_table(summary: list[dict[str, Any]]) -> str:
    lines = [f"{'variant':<22} {'seed':>4} {'val loss':>9} {'gap':>8} {'w dist':>7} "
             f"{'MiB/step':>9} {'vs exact':>8} {'s':>7}"]
    for r in summary:
        lines.append(
            f"{r['variant']:<22} {r['seed']:>4} {r['final_val_loss']:>9.4f} "
            f"{100 * r.get('gap_to_exact', float('nan')):>7.2f}% "
            f"{r.get('weight_distance', float('nan')):>7.4f} "
            f"{r['wire_bytes_per_step'] / 2**20:>9.3f} {r.get('bytes_vs_exact', float('nan')):>8.3f} "
            f"{r['seconds']:>7.1f}")
    return "\n".join(lines)


def format_across_seeds(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'variant':<22} {'seeds':>6} {'mean gap':>9} {'sd':>6} {'min':>7} {'max':>7} "
             f"{'vs loco4':>9}  per seed"]
    for r in rows:
        each = " ".join(f"{100 * d:+.2f}%" for d in r.get("vs_loco4_each", []))
        vs = f"{100 * r['vs_loco4']:+8.2f}%" if "vs_loco4" in r else f"{'':>9}"
        lines.append(f"{r['variant']:<22} {len(r['seeds']):>6} {100 * r['mean_gap']:>8.2f}% "
                     f"{100 * r['sd_gap']:>5.2f}% "
                     f"{100 * r['min_gap']:>6.2f}% {100 * r['max_gap']:>6.2f}% {vs}  {each}")
    return "\n".join(lines)



def plot(runs: list[dict[str, Any]], summary: list[dict[str, Any]], path: Path) -> None:
    """Three panels: train loss and validation loss of the first seed's runs (the curve is the
    ``eval_batches`` evaluations, the cross the final one on ``final_eval_batches``), and every
    run's final gap to exact of its seed (``summary``, from `summarize`)."""
    plt = pyplot("study plot")
    if plt is None:
        return
    fig, (ax_train, ax_val, ax_gap) = plt.subplots(
        1, 3, figsize=(18, 4.8), gridspec_kw={"width_ratios": [1, 1, 0.8]})
    seed0 = runs[0]["seed"]
    for r in runs:
        if r["seed"] != seed0:
            continue
        k = 10
        smooth = [sum(r["train_loss"][max(0, i - k + 1):i + 1])
                  / len(r["train_loss"][max(0, i - k + 1):i + 1])
                  for i in range(len(r["train_loss"]))]
        ax_train.plot(smooth, label=r["variant"], linewidth=1)
        steps, losses = zip(*r["val_loss"][:-1])
        line, = ax_val.plot(steps, losses, marker=".", label=r["variant"], linewidth=1)
        ax_val.plot(*r["val_loss"][-1], marker="x", color=line.get_color())
    ax_train.set(title=f"train loss (10-step mean), seed {seed0}", xlabel="step",
                 ylabel="nats/byte")
    ax_val.set(title=f"validation loss, seed {seed0} (x: final, larger sample)", xlabel="step",
               ylabel="nats/byte")
    for ax in (ax_train, ax_val):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    lows = [min(loss for _, loss in r["val_loss"]) for r in runs]
    ax_val.set_ylim(min(lows) - 0.05, min(lows) + 1.0)

    gaps: dict[str, list[float]] = {}
    for row in summary:
        if row["variant"] != "exact" and "gap_to_exact" in row:
            gaps.setdefault(row["variant"], []).append(100 * row["gap_to_exact"])
    shown = {v: g for v, g in gaps.items() if max(abs(x) for x in g) < 5}
    for i, values in enumerate(shown.values()):
        ax_gap.plot([i] * len(values), values, "o", color="C0", alpha=0.6)
        mean = sum(values) / len(values)
        ax_gap.plot([i - 0.25, i + 0.25], [mean, mean], color="C3", linewidth=2)
    ax_gap.axhline(0, color="black", linewidth=0.8)
    ax_gap.axhline(1, color="gray", linewidth=0.8, linestyle="--")
    ax_gap.set_xticks(range(len(shown)), list(shown), rotation=30, ha="right", fontsize=8)
    off = ", ".join(f"{v} {sum(g) / len(g):+.1f}%" for v, g in gaps.items() if v not in shown)
    ax_gap.set(title="final validation loss vs exact, each seed (bar: mean)", ylabel="gap %",
               xlabel=f"off scale: {off}" if off else "")
    ax_gap.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

