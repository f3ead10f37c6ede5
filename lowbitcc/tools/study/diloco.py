"""`lowbitcc study --diloco`: DiLoCo across sites behind an emulated WAN, with 4-bit LoCo outer
synchronisation against the alternatives (docs/wan.md).

Each of ``cfg.world`` local ranks is a site. Two phases:

1. **Loss**: every variant of `DILOCO_VARIANTS` trained for every seed with the study's
   training loop (`lowbitcc.tools.study.run`) on local ranks: DDP every step over gloo fp32
   (``exact``, the reference) and over loco (``mxfp4``); DiLoCo (`lowbitcc.OuterSync`, inner
   AdamW as the study's, outer SGD with Nesterov momentum, lr 0.7, momentum 0.5: DiLoCo's
   0.9 is for H = 500 and long runs, and here ends 8-20 points worse; docs/wan.md) with outer
   sync in fp32, int8 without feedback, 4-bit without feedback and 4-bit LoCo, each at every H
   of `OUTER_EVERY`. A run's loss does not depend on the link, so this phase runs unshaped.
2. **Time at the link** (root, `lowbitcc.tools.netem`): each variant trains a few steps
   (`wan_timing.steps_for`) with every rank in its own namespace behind ``link``; seconds per
   step there, times the study's steps, is the variant's wall time at that link. Without root
   this phase is skipped, and the report says so.

The report (`format_report`): per variant the mean final validation loss over seeds, its gap to
DDP-fp32 with the standard error of the paired differences, bytes each site sends per step and
in all, the wall time at the link and its speed-up over DDP-gloo; then the paired differences
that answer the question: 4-bit LoCo against fp32 and int8 outer sync at the same H, and the
same 4 bits without feedback against with it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

from lowbitcc.tools import netem, study
from lowbitcc.tools.link_spec import PRESETS, Link
from lowbitcc.tools.plotting import pyplot
from lowbitcc.tools.study.variants import (
    DILOCO_VARIANTS,
    OUTER_BITS_VARIANTS,
    OUTER_EVERY,
    StudyConfig,
    wire_bits,
)
from lowbitcc.tools.study.wide_report import GOAL_GAP, mean_se

log = logging.getLogger("lowbitcc.tools.study")

DEFAULT_LINK = PRESETS["cross-continent"]
TIMING_TIMEOUT_S = 1200.0


def run(seeds: list[int], cfg: StudyConfig, link: Link = DEFAULT_LINK,
        out_dir: str | None = None, variants: list[str] | None = None) -> dict[str, Any]:
    """Both phases (module docstring); returns the study's result (`lowbitcc.tools.study.run`)
    with ``"link"`` (its description) and ``"link_seconds_per_step"`` (None where skipped) and
    ``"diloco"`` (`report`'s rows). With ``out_dir``, writes ``diloco.json`` there."""
    names = variants or DILOCO_VARIANTS
    result = study.run(names, seeds, cfg, out_dir=out_dir, extra_seed_variants=names,
                       tracked=[])
    result["link"] = link.describe()
    result["link_seconds_per_step"] = time_at_link(names, cfg, link)
    result["diloco"] = report(result, cfg)
    if out_dir:
        out = Path(out_dir)
        slim = {k: v for k, v in result.items() if k != "runs"}
        (out / "diloco.json").write_text(json.dumps(slim, indent=1))
        plot(result["diloco"], result["link"], out / "diloco.png")
    return result


def time_at_link(names: list[str], cfg: StudyConfig, link: Link) -> dict[str, float] | None:
    """Seconds per training step of each variant with every rank behind ``link`` (None, and a
    warning, where this machine cannot emulate a network)."""
    missing = netem.missing_requirements()
    if missing:
        log.warning("lowbitcc study --diloco: no wall time at the link: needs %s",
                    "; ".join(missing))
        return None
    with tempfile.TemporaryDirectory(prefix="lowbitcc-wan-") as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "seconds.json"
        spec.write_text(json.dumps({"variants": names, "config": dataclasses.asdict(cfg),
                                    "out": str(out)}))
        log.info("timing %d variants behind %s", len(names), link.describe())
        code = netem.run_ranks([sys.executable, "-m", "lowbitcc.tools.study.wan_timing",
                                str(spec)], cfg.world, link, timeout_s=TIMING_TIMEOUT_S)
        if code:
            raise RuntimeError(f"lowbitcc study --diloco: timing at the link failed ({code})")
        return json.loads(out.read_text())


def paired(summary: list[dict[str, Any]], a: str, b: str) -> dict[str, Any] | None:
    """Mean and standard error over seeds of ``(loss of a - loss of b) / loss of b`` (final
    validation loss), over the seeds both ran; None where they share none."""
    loss = {(r["variant"], r["seed"]): r["final_val_loss"] for r in summary}
    seeds = sorted(s for v, s in loss if v == a and (b, s) in loss)
    if not seeds:
        return None
    diffs = [(loss[(a, s)] - loss[(b, s)]) / loss[(b, s)] for s in seeds]
    mean, se = mean_se(diffs)
    return {"a": a, "b": b, "seeds": seeds, "mean": mean, "se": se, "each": diffs}


def report(result: dict[str, Any], cfg: StudyConfig) -> dict[str, Any]:
    """``{"variants": rows, "pairs": paired differences}`` of a finished study (module
    docstring)."""
    summary = result["summary"]
    timing = result.get("link_seconds_per_step") or {}
    names = list(dict.fromkeys(r["variant"] for r in summary))
    rows = []
    for name in names:
        mine = [r for r in summary if r["variant"] == name]
        vs = paired(summary, name, "exact") if name != "exact" else None
        per_step = sum(r["wire_bytes_per_step"] for r in mine) / len(mine)
        row = {"variant": name, "seeds": len(mine),
               "val_loss": sum(r["final_val_loss"] for r in mine) / len(mine),
               "gap": vs["mean"] if vs else 0.0, "gap_se": vs["se"] if vs else 0.0,
               "bytes_per_step": per_step, "bytes_total": per_step * cfg.steps,
               "loopback_s": sum(r["seconds"] for r in mine) / len(mine)}
        if name in timing:
            row["link_s"] = timing[name] * cfg.steps
            if "exact" in timing:
                row["speedup"] = timing["exact"] / timing[name]
        rows.append(row)
    pairs = []
    for h in OUTER_EVERY:
        for a, b in ((f"diloco-loco4-h{h}", f"diloco-fp32-h{h}"),
                     (f"diloco-loco4-h{h}", f"diloco-int8-h{h}"),
                     (f"diloco-4bit-h{h}", f"diloco-loco4-h{h}"),
                     (f"diloco-int8-h{h}", f"diloco-fp32-h{h}")):
            found = paired(summary, a, b)
            if found:
                pairs.append(found)
        for a in (n for n in OUTER_BITS_VARIANTS if n.endswith(f"-h{h}")):
            found = paired(summary, a, f"diloco-fp32-h{h}")
            if found:
                pairs.append(found)
    return {"variants": rows, "pairs": pairs, "fewest_bits": fewest_bits(pairs)}


def fewest_bits(pairs: list[dict[str, Any]]) -> dict[int, dict[str, Any] | None]:
    """Per H, the outer sync of fewest wire bits whose mean paired difference with the fp32
    outer sync at that H is within `GOAL_GAP` (the wide study's 0.3%; None: none measured
    is)."""
    out: dict[int, dict[str, Any] | None] = {}
    for h in OUTER_EVERY:
        within = [p for p in pairs if p["b"] == f"diloco-fp32-h{h}" and p["mean"] <= GOAL_GAP]
        best = min(within, key=lambda p: wire_bits(p["a"]), default=None)
        out[h] = None if best is None else {"variant": best["a"], "bits": wire_bits(best["a"]),
                                            "gap": best["mean"], "se": best["se"]}
    return out


def format_report(diloco: dict[str, Any], link: str, timed: bool) -> str:
    """The two tables of `report` as text."""
    lines = [f"{'variant':<20} {'seeds':>5} {'val loss':>9} {'vs DDP-fp32':>16} "
             f"{'MiB/step':>9} {'MiB in all':>10} {'s at link':>10} {'vs DDP':>7}"]
    for r in diloco["variants"]:
        link_s = f"{r['link_s']:>10.1f}" if "link_s" in r else f"{'-':>10}"
        speed = f"{r['speedup']:>6.2f}x" if "speedup" in r else f"{'-':>7}"
        lines.append(
            f"{r['variant']:<20} {r['seeds']:>5} {r['val_loss']:>9.4f} "
            f"{100 * r['gap']:>+7.2f}% +-{100 * r['gap_se']:.2f}% "
            f"{r['bytes_per_step'] / 2**20:>9.3f} {r['bytes_total'] / 2**20:>10.1f} "
            f"{link_s} {speed}")
    lines.append(f"(time at the link: {link}, measured per step and times the steps)" if timed
                 else "(no time at the link: this machine cannot emulate one; run as root)")
    lines.append("")
    lines.append(f"{'paired difference of final val loss':<44} {'mean':>8} {'se':>7}  per seed")
    for p in diloco["pairs"]:
        each = " ".join(f"{100 * d:+.2f}%" for d in p["each"])
        lines.append(f"{p['a'] + ' - ' + p['b']:<44} {100 * p['mean']:>+7.2f}% "
                     f"{100 * p['se']:>6.2f}%  {each}")
    for h, best in diloco.get("fewest_bits", {}).items():
        lines.append(f"H {h}: fewest bits within {100 * GOAL_GAP:.1f}% of the fp32 outer sync: "
                     + (f"{best['variant']} ({best['bits']:.2f} bits, {100 * best['gap']:+.2f}%)"
                        if best else "none of those run"))
    return "\n".join(lines)


def plot(diloco: dict[str, Any], link: str, path: Path) -> None:
    """Two panels: each variant's final validation loss (mean over seeds) against its time at
    the link (or, untimed, its bytes), and the bytes each site sent in all (log scale)."""
    plt = pyplot("DiLoCo study plot")
    if plt is None:
        return
    rows = diloco["variants"]
    timed = all("link_s" in r for r in rows)
    fig, (ax_loss, ax_bytes) = plt.subplots(1, 2, figsize=(14, 5))
    for i, r in enumerate(rows):
        x = r["link_s"] if timed else r["bytes_total"] / 2**20
        ax_loss.errorbar(x, r["val_loss"], yerr=r["gap_se"] * r["val_loss"], fmt="o",
                         color=f"C{i % 10}", label=r["variant"])
        ax_bytes.barh(r["variant"], r["bytes_total"] / 2**20, color=f"C{i % 10}")
    ax_loss.set(xlabel=f"wall time of the run at {link} (s)" if timed else "MiB sent per site",
                ylabel="final validation loss (mean of seeds; bar: se of the gap)",
                title="loss against time at the link")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(fontsize=8)
    ax_bytes.set(xscale="log", xlabel="MiB each site sent in the run", title="bytes per site")
    ax_bytes.invert_yaxis()
    ax_bytes.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
