#!/usr/bin/env python3
"""Measured table of docs/algorithms.md: time per all-reduce of every schedule on 4 ranks at
64 KiB, 1 MiB and 64 MiB, on loopback and on an emulated 1 Gbit/s link.

    sudo python3 benchmarks/algorithms_report.py      # root: the emulated link needs namespaces

Runs `lowbitcc perf all_reduce` twice per link: direct, ring, tree and auto on one node, then
hierarchical and auto with LOCO_NODE_SIZE=2 (two emulated nodes of two ranks). LOCO_MIN_SIZE=1
so that 64 KiB is compressed too. Writes docs/perf/algorithms-<link>[-nodes].json and rewrites
the section between the ``algorithms-report`` markers of docs/algorithms.md. Drives the
installed package.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = (64 << 10, 1 << 20, 64 << 20)
FLAT = ("direct", "ring", "tree", "auto")
NODES = ("hierarchical", "auto")


def run(link: str, schedules: tuple[str, ...], node_size: int, out: Path, iters: int) -> dict:
    cmd = [sys.executable, "-m", "lowbitcc", "perf", "all_reduce", "-b", "64K", "-e", "64M",
           "-f", "4", "-n", str(iters), "-w", "1", "--np", "4", "--backend", "loco", "gloo",
           "--schedule", *schedules, "--json", str(out)]
    if link != "loopback":
        cmd += ["--link", link]
    env = {**os.environ, "LOCO_MIN_SIZE": "1", "LOCO_NODE_SIZE": str(node_size)}
    print(f"$ LOCO_MIN_SIZE=1 LOCO_NODE_SIZE={node_size}", " ".join(cmd[1:]), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        sys.exit(f"failed: {done.stderr[-3000:]}")
    print("\n".join(line for line in done.stdout.splitlines() if not line.startswith("#  ")))
    return json.loads(out.read_text())


def times(result: dict, prefix: str) -> dict[tuple[str, int], float]:
    """(row label, size) -> out-of-place time in ms; loco rows are labelled by schedule."""
    out = {}
    for r in result["rows"]:
        name = r["backend"]
        label = name.split("-", 1)[1] if name.startswith("loco") else name
        out[(prefix + label, r["size"])] = r["out_of_place"]["time_us"] / 1000
    return out


def table(link: str, flat: dict, nodes: dict) -> str:
    labels = [*FLAT, "gloo", *(f"2x2 {s}" for s in NODES)]
    merged = {**flat, **{(f"2x2 {k[0]}", k[1]): v for k, v in nodes.items() if k[0] in NODES}}
    lines = [f"**{link}**, 4 ranks, ms per all-reduce (fp32, out of place):", "",
             "| schedule | " + " | ".join(f"{s >> 10} KiB" if s < 1 << 20 else f"{s >> 20} MiB"
                                           for s in SIZES) + " |",
             "|---|" + "---:|" * len(SIZES)]
    for label in labels:
        cells = [f"{merged[(label, s)]:.1f}" if (label, s) in merged else "-" for s in SIZES]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", nargs="+", default=["loopback", "1gbit"])
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    out_dir = ROOT / "docs" / "perf"
    out_dir.mkdir(parents=True, exist_ok=True)
    sections = []
    for link in args.links:
        flat = run(link, FLAT, 0, out_dir / f"algorithms-{link}.json", args.iters)
        nodes = run(link, NODES, 2, out_dir / f"algorithms-{link}-nodes.json", args.iters)
        sections.append(table(link, times(flat, ""), times(nodes, "")))
    doc = ROOT / "docs" / "algorithms.md"
    text = doc.read_text()
    body = "\n\n".join(sections)
    new = re.sub(r"(<!-- algorithms-report:begin -->\n).*?(<!-- algorithms-report:end -->)",
                 lambda m: m.group(1) + body + "\n" + m.group(2), text, flags=re.S)
    doc.write_text(new)
    print(body)


if __name__ == "__main__":
    main()
