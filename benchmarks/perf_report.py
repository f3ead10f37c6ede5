#!/usr/bin/env python3
"""Benchmark report of docs/performance.md: `lowbitcc perf all_reduce` on 2 and 4 ranks, on
loopback and on emulated 1 Gbit/s and 10 Gbit/s links, loco 4-bit, loco 8-bit, gloo fp32 and
gloo with bf16 tensors side by side.

    sudo python3 benchmarks/perf_report.py            # root: the emulated links need namespaces

Writes docs/perf/<ranks>r-<link>.json, docs/perf/perf.png, and rewrites the section between
the ``perf-report`` markers of docs/performance.md (tables of busbw ratios at 64 MiB and the
crossover size where loco 4-bit starts to beat gloo fp32). Drives the installed package.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINKS = ("loopback", "10gbit", "1gbit")
BACKENDS = ("loco4", "loco8", "gloo", "gloo-bf16")


def run(ranks: int, link: str, out: Path, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "lowbitcc", "perf", "all_reduce", "-b", args.min, "-e", args.max,
           "-f", "4", "-n", str(args.iters), "-w", "1", "--backend", "loco", "gloo", "gloo-bf16",
           "--bits", "4", "8", "--np", str(ranks), "--json", str(out)]
    if link != "loopback":
        cmd += ["--link", link]
    print("$", " ".join(cmd[1:]), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"failed: {done.stderr[-3000:]}")
    print("\n".join(line for line in done.stdout.splitlines() if not line.startswith("#  ")))
    return json.loads(out.read_text())


def crossover(result: dict) -> int | None:
    """Smallest size from which loco4's busbw beats gloo's at every larger size."""
    busbw = {(r["backend"], r["size"]): r["out_of_place"]["busbw"] for r in result["rows"]}
    sizes = sorted({r["size"] for r in result["rows"]})
    winning = None
    for size in reversed(sizes):
        if busbw[("loco4", size)] > busbw[("gloo", size)]:
            winning = size
        else:
            break
    return winning


def human(size: int | None) -> str:
    if size is None:
        return "never"
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size} B"


def report(results: dict[tuple[int, str], dict], command: str) -> str:
    lines = [f"Command: `{command}` ({platform.node()}, 2 cores, one rank per core or two per core "
             "at 4 ranks; each rank uses cpu_count/ranks threads).", "",
             "busbw (GB/s, logical fp32 bytes, out-of-place) at the largest size, ratio to gloo "
             "fp32 measured in the same run, and the crossover (smallest size from which loco "
             "4-bit beats gloo fp32 at every larger size):", "",
             "| ranks | link | gloo fp32 | gloo bf16 | loco 8-bit | loco 4-bit | loco4 / gloo | "
             "crossover |", "|---|---|---|---|---|---|---|---|"]
    for (ranks, link), result in sorted(results.items(), key=lambda kv: (kv[0][0], LINKS.index(kv[0][1]))):
        largest = max(r["size"] for r in result["rows"])
        bw = {r["backend"]: r["out_of_place"]["busbw"] for r in result["rows"] if r["size"] == largest}
        lines.append(
            f"| {ranks} | {link} | {bw['gloo']:.3f} | {bw['gloo-bf16']:.3f} "
            f"({bw['gloo-bf16'] / bw['gloo']:.2f}x) "
            f"| {bw['loco8']:.3f} ({bw['loco8'] / bw['gloo']:.2f}x) | {bw['loco4']:.3f} "
            f"| **{bw['loco4'] / bw['gloo']:.2f}x** | {human(crossover(result))} |")
    largest = max(r["size"] for result in results.values() for r in result["rows"])
    lines += ["", f"Largest size: {human(largest)}. Raw tables: `docs/perf/*.json`; plot: "
              "![busbw vs size](perf/perf.png)"]
    return "\n".join(lines)


def plot(results: dict[tuple[int, str], dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted({k[0] for k in results})
    links = [link for link in LINKS if any(k[1] == link for k in results)]
    fig, axes = plt.subplots(len(ranks), len(links), figsize=(4.2 * len(links), 3.4 * len(ranks)),
                             squeeze=False, sharex=True)
    for i, n in enumerate(ranks):
        for j, link in enumerate(links):
            ax = axes[i][j]
            result = results.get((n, link))
            if result is None:
                continue
            for name in BACKENDS:
                rows = [r for r in result["rows"] if r["backend"] == name]
                ax.plot([r["size"] for r in rows], [r["out_of_place"]["busbw"] for r in rows],
                        marker="o", ms=3, label=name)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{n} ranks, {link}", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            if j == 0:
                ax.set_ylabel("busbw (GB/s)")
            if i == len(ranks) - 1:
                ax.set_xlabel("size (bytes)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("lowbitcc perf all_reduce: busbw on logical fp32 bytes", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--links", nargs="+", default=list(LINKS), choices=LINKS)
    parser.add_argument("--min", default="64K")
    parser.add_argument("--max", default="64M")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "perf")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "performance.md")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for ranks in args.ranks:
        for link in args.links:
            results[(ranks, link)] = run(ranks, link, args.out / f"{ranks}r-{link}.json", args)
    plot(results, args.out / "perf.png")
    command = "sudo python3 benchmarks/perf_report.py " + " ".join(sys.argv[1:])
    text = report(results, command.strip())
    print(text)
    doc = args.doc.read_text()
    begin, end = "<!-- perf-report:begin -->", "<!-- perf-report:end -->"
    if begin in doc:
        doc = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: f"{begin}\n{text}\n{end}",
                     doc, flags=re.S)
        args.doc.write_text(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
