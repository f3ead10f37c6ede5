#!/usr/bin/env python3
"""The alpha-beta-gamma model of docs/scaling.md: fitted and checked against runs here, then
projected to large GPU clusters on paper.

    sudo python3 benchmarks/scaling_report.py --measure   # root: the emulated links need namespaces
    python3 benchmarks/scaling_report.py                  # the report from the saved runs

``--measure`` runs, on 2 and 4 local ranks, over loopback and emulated 10 and 1 Gbit/s links,
``lowbitcc perf all_reduce -b 1M -e 64M -f 4 --backend loco gloo`` (loco: 4 bits, the direct
schedule, every call compressed) and ``lowbitcc codec-bench --threads 1``, into
docs/perf/scaling-*.json. The report fits, per rank count and link, the latency ``alpha`` and
bandwidth ``B`` of gloo's ring all-reduce (``T = 2(n-1) alpha + 2(n-1)/n S / B``), fits
loco's fixed cost per call and its codec's slowdown in the ranks on loopback, predicts loco's
time on every link from them and the codec's throughput measured alone, prints predicted
against measured, then the projection table and docs/perf/scaling.png. Drives the installed
package.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PERF = ROOT / "docs" / "perf"
WORLDS = (2, 4)
LINKS = ("loopback", "10gbit", "1gbit")
CORES = os.cpu_count() or 2

# 4-bit codes with one fp32 scale per 128 elements, per fp32 input byte (the wire ratio)
WIRE_RATIO = (0.5 + 4 / 128) / 4

# On paper (docs/scaling.md): one H100 per rank. Codec kernels as measured alone on an H100
# (docs/gpu.md: encode 444, decode 510 GB/s of fp32 at 256 MiB); host cost per compressed call
# as measured there today (about 2.5 ms), and without it (the kernels' bound).
GPU_ENCODE = 444e9
GPU_DECODE = 510e9
GPU_HOST_S = 2.5e-3
ALPHA_NET = 10e-6  # assumed: per-message latency of an inter-node network
NODE = 8  # GPUs per node
NVLINK = 300e9  # assumed: bytes/s one GPU moves to the others of its node (H100 NVLink, derated)
NVLINK_ALPHA = 2e-6  # assumed: per-message latency inside a node


def _run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    print("$", " ".join(cmd[1:]), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if done.returncode:
        sys.exit(f"failed: {done.stderr[-3000:]}")


def measure(iters: int) -> None:
    _run([sys.executable, "-m", "lowbitcc", "codec-bench", "-b", "1M", "-e", "64M", "-f", "4",
          "--threads", "1", "--reference-max", "1M", "--min-time", "0.2",
          "--json", str(PERF / "scaling-codec.json")])
    for n in WORLDS:
        for link in LINKS:
            cmd = [sys.executable, "-m", "lowbitcc", "perf", "all_reduce", "-b", "1M", "-e",
                   "64M", "-f", "4", "-n", str(iters), "-w", "1", "--np", str(n), "--backend",
                   "loco", "gloo", "--json", str(PERF / f"scaling-{n}r-{link}.json")]
            if link != "loopback":
                cmd += ["--link", link]
            _run(cmd, {"LOCO_COST_MODEL": "0"})


def _times(n: int, link: str) -> dict[str, dict[int, float]]:
    """Seconds per call by backend and size: the faster of out-of-place and in-place."""
    report = json.loads((PERF / f"scaling-{n}r-{link}.json").read_text())
    out: dict[str, dict[int, float]] = {}
    for row in report["rows"]:
        t = min(row["out_of_place"]["time_us"], row["in_place"]["time_us"]) * 1e-6
        out.setdefault(row["backend"], {})[row["size"]] = t
    return out


def _codec() -> tuple[float, float]:
    """This machine's fused CPU codec on one thread: encode and decode, fp32 bytes per second,
    at the largest size measured."""
    report = json.loads((PERF / "scaling-codec.json").read_text())
    rows = [r for r in report["rows"] if r["impl"] != "reference" and r["threads"] == 1]
    last = max(rows, key=lambda r: r["size_bytes"])
    return last["encode_GBps"] * 1e9, last["decode_GBps"] * 1e9


def fit_ring(times: dict[int, float], n: int) -> tuple[float, float]:
    """``(alpha, B)`` of ``T = 2(n-1) alpha + 2(n-1)/n S / B`` by least squares."""
    import numpy as np

    sizes = np.array(sorted(times), dtype=float)
    t = np.array([times[int(s)] for s in sizes])
    slope, intercept = np.polyfit(sizes, t, 1)
    return max(intercept, 0.0) / (2 * (n - 1)), 2 * (n - 1) / n / slope


def loco_direct(n: int, size: float, alpha: float, bandwidth: float, encode: float,
                decode: float, fixed_s: float = 0.0, overlap: bool = False) -> float:
    """Seconds of loco's direct all-reduce of ``size`` fp32 bytes per rank (docs/scaling.md):
    a fixed cost per call (host work, thread hand-offs), the descriptor exchange and two phases
    of n-1 messages (3 (n-1) latencies), codes of the wire ratio, an encode of the whole input
    and of the reduced shard, decodes of n shards twice; on two ranks one all-gather instead
    (2 latencies, the same bytes, one encode of the input, decodes of both ranks' inputs); the
    wire and the codec one after the other, or with the wire hidden behind the codec where
    ``overlap``."""
    latency = (2 if n == 2 else 3 * (n - 1)) * alpha
    wire = 2 * (n - 1) / n * size * WIRE_RATIO / bandwidth
    codec = (1 if n == 2 else 1 + 1 / n) * size / encode + 2 * size / decode
    return fixed_s + latency + (max(wire, codec) if overlap else wire + codec)


def ring_exact(n: int, size: float, alpha: float, bandwidth: float) -> float:
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * size / bandwidth


def fit_loco(times: dict[int, float], n: int, alpha: float, bandwidth: float, encode: float,
             decode: float) -> tuple[float, float]:
    """``(fixed_s, k)``: loco's fixed cost per call and the factor by which its codec runs
    slower in the ranks than alone (ranks share cores and memory bandwidth), least squares
    on ``times`` (loopback, where the wire is cheapest)."""
    import numpy as np

    sizes = sorted(times)
    codec = [loco_direct(n, s, 0.0, float("inf"), encode, decode) for s in sizes]
    rest = [times[s] - loco_direct(n, s, alpha, bandwidth, float("inf"), float("inf"))
            for s in sizes]
    k, fixed = np.polyfit(codec, rest, 1)
    return max(fixed, 0.0), k


def validate() -> list[dict]:
    encode1, decode1 = _codec()
    rows = []
    print(f"codec here, alone on one thread: encode {encode1 / 1e9:.2f} GB/s, decode "
          f"{decode1 / 1e9:.2f} GB/s of fp32; {CORES} cores")
    for n in WORLDS:
        share = min(1.0, CORES / n)  # the cores each rank's codec gets
        encode, decode = encode1 * share, decode1 * share
        loop = _times(n, "loopback")
        fixed, k = fit_loco(loop["loco4"], n, *fit_ring(loop["gloo"], n), encode, decode)
        print(f"\n{n} ranks: fitted on loopback: fixed {fixed * 1e3:.1f} ms per call, codec "
              f"{k:.2f}x slower than alone (x {share:g} core per rank)")
        print(f"{'link':>9} {'alpha us':>9} {'B GB/s':>7} {'size':>6} {'gloo ms':>8} "
              f"{'loco ms':>8} {'serial':>8} {'err':>5} {'overlap':>8} {'err':>5} "
              f"{'loco/gloo':>9}")
        for link in LINKS:
            times = _times(n, link)
            alpha, bandwidth = fit_ring(times["gloo"], n)
            for size in sorted(times["loco4"]):
                serial, overlap = (loco_direct(n, size, alpha, bandwidth, encode / k, decode / k,
                                               fixed, overlap=o) for o in (False, True))
                gloo, loco = times["gloo"][size], times["loco4"][size]
                rows.append({"n": n, "link": link, "size": size, "alpha": alpha,
                             "bandwidth": bandwidth, "gloo": gloo, "loco": loco,
                             "serial": serial, "overlap": overlap})
                print(f"{link:>9} {alpha * 1e6:>9.0f} {bandwidth / 1e9:>7.3f} "
                      f"{size >> 20:>5}M {gloo * 1e3:>8.2f} {loco * 1e3:>8.2f} "
                      f"{serial * 1e3:>8.2f} {serial / loco - 1:>+5.0%} {overlap * 1e3:>8.2f} "
                      f"{overlap / loco - 1:>+5.0%} {gloo / loco:>8.2f}x")
    return rows


def exact_allreduce(n: int, size: float, alpha: float, bandwidth: float) -> float:
    """An exact all-reduce as NCCL would give it at scale, favourably: a tree's latency
    (2 log2 n hops) with a ring's bandwidth term."""
    return 2 * math.log2(n) * alpha + 2 * (n - 1) / n * size / bandwidth


def hierarchical(n: int, size: float, alpha: float, bandwidth: float,
                 host_s: float | None) -> float:
    """An all-reduce over nodes of ``NODE`` GPUs: exact fp32 reduce-scatter and all-gather
    inside the node (NVLink), and across the ``n / NODE`` nodes, on the ``size / NODE`` rows of
    each rail (one NIC per GPU, all rails at once), loco's direct schedule (kernels overlapped
    with the wire, ``host_s`` per call) or, for ``host_s`` None, an exact all-reduce."""
    inside = 2 * (NODE - 1) * NVLINK_ALPHA + 2 * (NODE - 1) / NODE * size / NVLINK
    nodes = n // NODE
    if nodes <= 1:
        return inside
    if host_s is None:
        return inside + exact_allreduce(nodes, size / NODE, alpha, bandwidth)
    return inside + loco_direct(nodes, size / NODE, alpha, bandwidth, GPU_ENCODE, GPU_DECODE,
                                host_s, overlap=True)


def project(plot_path: Path | None) -> None:
    """Speed of loco's all-reduces over exact ones on GPUs, on paper: flat (direct against an
    exact all-reduce over all ranks) and hierarchical (both exact inside the node)."""
    sizes = {"25 MiB (DDP bucket)": 25 << 20, "256 MiB": 256 << 20}
    links = {"25 Gbit/s": 25e9 / 8, "100 Gbit/s": 100e9 / 8, "400 Gbit/s": 400e9 / 8}
    worlds = [16, 64, 256, 1024, 4096]
    curves: dict[tuple[str, str, float], list[float]] = {}
    for host in (GPU_HOST_S, 0.0):
        print(f"\nprojection, host cost {host * 1e3:.1f} ms per compressed call: speed of loco "
              "over exact, flat (direct / exact) and hierarchical (nodes of 8, both)")
        print(f"{'size':>20} {'link':>11} " + " ".join(f"{n:>11}" for n in worlds))
        for sname, size in sizes.items():
            for lname, bw in links.items():
                cells, hier = [], []
                for n in worlds:
                    direct = exact_allreduce(n, size, ALPHA_NET, bw) / loco_direct(
                        n, size, ALPHA_NET, bw, GPU_ENCODE, GPU_DECODE, host, overlap=True)
                    hier.append(hierarchical(n, size, ALPHA_NET, bw, None)
                                / hierarchical(n, size, ALPHA_NET, bw, host))
                    cells.append(f"{direct:.2f}/{hier[-1]:.2f}")
                curves[(sname, lname, host)] = hier
                print(f"{sname:>20} {lname:>11} " + " ".join(f"{c:>11}" for c in cells))
    print("\ncrossover (large n, direct): compression pays below this link rate per GPU")
    for sname, size in sizes.items():
        for host in (GPU_HOST_S, 0.0):
            codec = size / GPU_ENCODE + 2 * size / GPU_DECODE + host
            rate = 2 * size * (1 - WIRE_RATIO) / codec
            print(f"  {sname}, host {host * 1e3:.1f} ms: {rate * 8 / 1e9:.0f} Gbit/s")
    if plot_path is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sizes), figsize=(11, 4), sharey=True)
    for ax, sname in zip(axes, sizes):
        for lname in links:
            line, = ax.plot(worlds, curves[(sname, lname, 0.0)], "-",
                            label=f"{lname}, kernels only")
            ax.plot(worlds, curves[(sname, lname, GPU_HOST_S)], "--", color=line.get_color(),
                    label=f"{lname}, host {GPU_HOST_S * 1e3:.1f} ms/call")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"hierarchical all-reduce of {sname}")
        ax.set_xlabel("ranks (one H100 each, 8 per node)")
    axes[0].set_ylabel("speed over the exact hierarchical all-reduce")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(plot_path, dpi=120)
    print(f"wrote {plot_path.relative_to(ROOT)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="run the measurements first")
    parser.add_argument("--iters", type=int, default=5, help="timed calls per size")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    if args.measure:
        measure(args.iters)
    validate()
    project(None if args.no_plot else PERF / "scaling.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
