"""A/B of the C++ CPU codec: another git revision's kernels against this checkout's, timed
interleaved in one process, so a change in the kernels is measured without the run-to-run
drift of a shared machine (which moves a single run's GB/s by 30% and more).

Feeds docs/performance.md, "Codec bandwidth (CPU)" (the encode and decode GB/s of the formats,
and NVFP4's against MXFP4's, also quoted in docs/convergence.md), and CHANGELOG.md's before and
after of each change to the C++ kernels.

Builds ``lowbitcc/codec/csrc`` of ``--rev`` (default HEAD) next to this checkout's build, then
runs `lowbitcc codec-bench`'s measurement (`codec_bench.measure`: steady-state encode with an
int8 error state into a preallocated message, decode-sum of 4 messages of a quarter each) on
each in turn, ``--rounds`` times, at ``--mib`` MiB of fp32 input per format and thread count.
Prints the best GB/s of each and their ratio (> 1: this checkout is faster). The two builds
must share Python's ABI for ``EncodeArgs`` (``encode_args_layout``): compare revisions with the
same argument layout.

    python benchmarks/codec_ab.py --rev HEAD --mib 64 --threads 1 2
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def build_revision(rev: str) -> object:
    """The codec module built from ``rev``'s sources (cached by torch under a name per commit)."""
    from torch.utils import cpp_extension

    from lowbitcc.codec import cpu

    commit = subprocess.run(["git", "rev-parse", rev], cwd=REPO, check=True, capture_output=True,
                            text=True).stdout.strip()
    src = Path(tempfile.mkdtemp(prefix=f"lowbitcc-ab-{commit[:12]}-"))
    csrc = cpu.CSRC.resolve().relative_to(REPO)
    names = subprocess.run(["git", "ls-tree", "--name-only", commit, f"{csrc}/"], cwd=REPO,
                           check=True, capture_output=True, text=True).stdout.split()
    for rel in names:  # every file of the revision's csrc: its sources and headers
        text = subprocess.run(["git", "show", f"{commit}:{rel}"], cwd=REPO, check=True,
                              capture_output=True).stdout
        (src / Path(rel).name).write_bytes(text)
    return cpp_extension.load(name=f"lowbitcc_ab_{commit[:12]}",
                              sources=[str(p) for p in sorted(src.glob("cpu_*.cpp"))],
                              extra_include_paths=[str(src)], extra_cflags=cpu.CFLAGS,
                              extra_ldflags=["-fopenmp"])


def compare(modules: dict[str, Any], fmt: str, threads: int, size: int, rounds: int,
            min_time: float) -> dict[tuple[str, str], float]:
    """Best GB/s per (module name, "encode" | "decode"), `codec_bench.measure` run on each
    module in turn, ``rounds`` times."""
    from lowbitcc.codec import cpu
    from lowbitcc.tools import codec_bench

    best: dict[tuple[str, str], float] = {}
    loaded = cpu.load
    try:
        for _ in range(rounds):
            for name, module in modules.items():
                cpu.load = lambda module=module: module  # CpuKernels calls cpu.load() per call
                result = codec_bench.measure(size, "cpu", threads, fmt=fmt, min_time=min_time)
                for what in ("encode", "decode"):
                    best[(name, what)] = max(best.get((name, what), 0.0), result[f"{what}_GBps"])
    finally:
        cpu.load = loaded
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", default="HEAD", help="git revision to compare against")
    parser.add_argument("--mib", type=int, default=64, help="MiB of fp32 input (default 64)")
    parser.add_argument("--formats", nargs="+", default=["mxfp4", "int"],
                        help="wire formats (names of lowbitcc.codec.formats.FORMATS; default "
                             "mxfp4 int)")
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--min-time", type=float, default=0.2,
                        help="seconds per measurement (codec-bench's --min-time)")
    args = parser.parse_args()
    from lowbitcc.codec import cpu
    from lowbitcc.codec.formats import FORMATS

    unknown = [f for f in args.formats if f not in FORMATS]
    if unknown:
        parser.error(f"unknown format(s) {', '.join(unknown)} (choose from {', '.join(FORMATS)})")
    modules = {args.rev: build_revision(args.rev), "checkout": cpu.load()}
    size = args.mib << 20
    print(f"{'format':>7} {'thr':>3} {'size':>9} {'what':>6} {args.rev + ' GB/s':>14} "
          f"{'checkout GB/s':>14} {'ratio':>6}")
    for fmt in args.formats:
        for threads in args.threads:
            best = compare(modules, fmt, threads, size, args.rounds, args.min_time)
            for what in ("encode", "decode"):
                old, new = best[(args.rev, what)], best[("checkout", what)]
                label = f"{args.mib} MiB"
                print(f"{fmt:>7} {threads:>3} {label:>9} {what:>6} {old:>14.3f} {new:>14.3f} "
                      f"{new / old:>6.2f}")


if __name__ == "__main__":
    main()
