"""The frontier of wire cost against quality, from one or more `lowbitcc study` outputs.

Feeds docs/convergence.md, "Every format and feedback setting measured": its table and
docs/study/formats/frontier.{png,json} (the commands that made the studies are in that doc).

Reads each ``study.json`` given (their ``summary`` rows: variant, seed, gap to the exact run of
the same seed, bytes against exact), merges them by (variant, seed), and prints per variant its
bits per element (averaged over the phases of a direct all-reduce, scales included), the mean
gap over seeds with its sample standard deviation and standard error, and the mean paired
difference from loco4 on the seeds both ran (`lowbitcc.tools.study.report.across_seeds`).
``loco4`` and ``lab-int4-g128`` are the same arithmetic (tests/tools/test_formats.py), so
either stands in for the other.

With ``--plot``, writes the frontier (bits per element against mean gap, one standard error
bars, the lower envelope) as a PNG; with ``--json``, the table.

    python benchmarks/format_frontier.py docs/study/study.json docs/study/formats/sweep-*.json \\
        --plot docs/study/formats/frontier.png --json docs/study/formats/frontier.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

SAME = {"lab-int4-g128": "loco4", "lab-int4-g128-nofb": "loco4-nofb", "lab-int4-g64": "loco4-g64"}


def load(paths: list[Path]) -> tuple[list[dict], dict[str, float]]:
    """The studies' summary rows (lab variants that are loco's arithmetic renamed to loco's
    variant), and bits per element by variant."""
    from lowbitcc.tools.study.formats import LAB_VARIANTS

    rows: list[dict] = []
    bits: dict[str, float] = {}
    for path in paths:
        for row in json.loads(path.read_text())["summary"]:
            if "gap_to_exact" not in row or row["variant"] == "exact":
                continue
            name = SAME.get(row["variant"], row["variant"])
            rows.append({**row, "variant": name})
            spec = LAB_VARIANTS.get(row["variant"])
            bits[name] = spec.bits_per_element if spec else 32 * row["bytes_vs_exact"]
    return rows, bits


def table(summary: list[dict], bits: dict[str, float]) -> list[dict]:
    """`across_seeds` of the merged rows (a later study's run of the same variant and seed
    replaces an earlier one), with bits per element and standard errors."""
    from lowbitcc.tools.study.report import across_seeds

    rows = []
    for r in across_seeds(summary):
        n = len(r["seeds"])
        sd = r["sd_gap"] if n > 1 else float("nan")
        row = {"variant": r["variant"], "bits_per_element": bits[r["variant"]],
               "seeds": r["seeds"], "mean_gap": r["mean_gap"], "sd": sd, "se": sd / math.sqrt(n)}
        paired = r.get("vs_loco4_each", [])
        if paired:
            row["vs_baseline"] = r["vs_loco4"]
            row["vs_baseline_se"] = (statistics.stdev(paired) / math.sqrt(len(paired))
                                     if len(paired) > 1 else float("nan"))
            row["vs_baseline_n"] = len(paired)
        rows.append(row)
    return sorted(rows, key=lambda r: (r["bits_per_element"], r["mean_gap"]))


def show(rows: list[dict]) -> str:
    lines = [f"{'variant':<24} {'bits':>6} {'n':>2} {'mean gap':>9} {'sd':>6} {'se':>6} "
             f"{'vs loco4':>16}"]
    for r in rows:
        vs = ""
        if "vs_baseline" in r:
            vs = f"{100 * r['vs_baseline']:+6.2f}% ± {100 * r['vs_baseline_se']:.2f} " \
                 f"({r['vs_baseline_n']})"
        lines.append(f"{r['variant']:<24} {r['bits_per_element']:>6.3f} {len(r['seeds']):>2} "
                     f"{100 * r['mean_gap']:>8.2f}% {100 * r['sd']:>5.2f}% {100 * r['se']:>5.2f}% "
                     f"{vs:>16}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r["bits_per_element"] <= 9 and len(r["seeds"]) > 1]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for i, r in enumerate(sorted(shown, key=lambda r: (r["bits_per_element"], r["mean_gap"]))):
        nofb = "nofb" in r["variant"]
        ax.errorbar(r["bits_per_element"], 100 * r["mean_gap"], yerr=100 * r["se"],
                    fmt="s" if nofb else "o", color="tab:gray" if nofb else "tab:blue",
                    capsize=3, markersize=5)
        ax.annotate(f"{r['variant']} {100 * r['mean_gap']:+.2f}%",
                    (r["bits_per_element"], 100 * r["mean_gap"]), fontsize=7,
                    xytext=(6 + 90 * (i % 2), 0), textcoords="offset points", va="center")
    envelope, best = [], math.inf
    for r in sorted(shown, key=lambda r: r["bits_per_element"]):
        if r["mean_gap"] < best:
            best = r["mean_gap"]
            envelope.append((r["bits_per_element"], 100 * best))
    if envelope:
        ax.step(*zip(*envelope), where="post", color="tab:red", alpha=0.5, label="frontier")
    ax.axhline(0.5, color="tab:green", linestyle="--", alpha=0.6, label="goal: within 0.5%")
    ax.axvline(4.5, color="tab:orange", linestyle=":", alpha=0.6, label="4.5 bits/element")
    off = [r["variant"] for r in shown if 100 * r["mean_gap"] > 2]
    ax.set_ylim(-0.8, 2.0)
    if off:
        ax.text(0.01, 0.97, "off the top: " + ", ".join(off), transform=ax.transAxes,
                fontsize=8, va="top")
    ax.set(xlabel="bits per element on the wire (mean of the two phases, scales included)",
           ylabel="final validation loss gap to exact, % (mean over seeds, ±1 s.e.)",
           title="4-bit formats and feedback: wire cost against quality (2 ranks, 300 steps)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("studies", nargs="+", type=Path, help="study.json files")
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    summary, bits = load(args.studies)
    rows = table(summary, bits)
    print(show(rows))
    if args.plot:
        plot(rows, args.plot)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
