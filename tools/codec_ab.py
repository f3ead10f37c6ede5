"""A/B of the C++ CPU codec: another git revision's kernels against this checkout's, timed
interleaved in one process, so a change in the kernels is measured without the run-to-run
drift of a shared machine (which moves a single run's GB/s by 30% and more).

Builds ``lowbitcc/codec/csrc`` of ``--rev`` (default HEAD) next to this checkout's build, then
alternates the two, ``--rounds`` times each, timing the steady-state encode (LoCo with an int8
error state, beta 0.8, into a preallocated message) and decode_sum of two messages, of
``--mib`` MiB of fp32 input per format and thread count. Prints the best GB/s of each and
their ratio (> 1: this checkout is faster). The two builds must share Python's ABI for
``EncodeArgs`` (``encode_args_layout``): compare revisions with the same argument layout.

    python tools/codec_ab.py --rev HEAD --mib 64 --threads 1 2
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils import cpp_extension

from lowbitcc.codec import cpu, kernels
from lowbitcc.codec.error_state import ErrorState
from lowbitcc.codec.shard_codec import ShardCodec
from lowbitcc.config import DEFAULT_GROUP_SIZES

REPO = Path(__file__).resolve().parents[1]


def build_revision(rev: str) -> object:
    """The codec module built from ``rev``'s sources (cached by torch under a name per commit)."""
    commit = subprocess.run(["git", "rev-parse", rev], cwd=REPO, check=True, capture_output=True,
                            text=True).stdout.strip()
    src = Path(tempfile.mkdtemp(prefix=f"lowbitcc-ab-{commit[:12]}-"))
    for source in [*cpu.SOURCES, cpu.HEADER]:
        rel = source.resolve().relative_to(REPO)
        text = subprocess.run(["git", "show", f"{commit}:{rel}"], cwd=REPO, check=True,
                              capture_output=True).stdout
        (src / source.name).write_bytes(text)
    return cpp_extension.load(name=f"lowbitcc_ab_{commit[:12]}",
                              sources=[str(src / cpu.SOURCES[0].name)],
                              extra_include_paths=[str(src)], extra_cflags=cpu.CFLAGS,
                              extra_ldflags=["-fopenmp"])


def _best(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def compare(modules: dict[str, object], fmt: str, threads: int, size: int, rounds: int,
            repeats: int) -> dict[tuple[str, str], float]:
    """Best seconds per (module name, "encode" | "decode"), the modules alternated per round."""
    torch.set_num_threads(threads)
    group = DEFAULT_GROUP_SIZES[fmt]
    n = size // 4
    src = torch.randn(n)
    codec = ShardCodec(bits=4, group_size=group, dtype_code=0, seq=1, world=2, signature=0,
                       kernels=kernels.select("cpu", "cpu", group), fmt=fmt)
    holder = {"state": ErrorState.encode(torch.randn(codec.padded(n)) * 0.01, "int8", group)}
    sent = torch.empty(1, codec.message_bytes(n), dtype=torch.uint8)
    half = n // 2
    pair = codec.encode(src, 2, half, 1.0, None, 0.8, [0, 0], None).messages
    total = torch.empty(half)

    def encode() -> None:
        holder["state"] = codec.encode(src, 1, n, 1.0, holder["state"], 0.8, [0], "int8",
                                       out=sent).error

    def decode() -> None:
        codec.decode_sum(pair, half, 0, total)

    best: dict[tuple[str, str], float] = {}
    loaded = cpu.load
    try:
        for _ in range(rounds):
            for name, module in modules.items():
                cpu.load = lambda module=module: module  # CpuKernels calls cpu.load() per call
                for what, fn in (("encode", encode), ("decode", decode)):
                    t = _best(fn, repeats)
                    best[(name, what)] = min(best.get((name, what), t), t)
    finally:
        cpu.load = loaded
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", default="HEAD", help="git revision to compare against")
    parser.add_argument("--mib", type=int, default=64, help="MiB of fp32 input (default 64)")
    parser.add_argument("--formats", nargs="+", default=["mxfp4", "int"],
                        choices=sorted(DEFAULT_GROUP_SIZES))
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    modules = {args.rev: build_revision(args.rev), "checkout": cpu.load()}
    size = args.mib << 20
    print(f"{'format':>7} {'thr':>3} {'size':>9} {'what':>6} {args.rev + ' GB/s':>14} "
          f"{'checkout GB/s':>14} {'ratio':>6}")
    for fmt in args.formats:
        for threads in args.threads:
            best = compare(modules, fmt, threads, size, args.rounds, args.repeats)
            for what in ("encode", "decode"):
                old, new = best[(args.rev, what)], best[("checkout", what)]
                label = f"{args.mib} MiB"
                print(f"{fmt:>7} {threads:>3} {label:>9} {what:>6} {size / old / 1e9:>14.3f} "
                      f"{size / new / 1e9:>14.3f} {old / new:>6.2f}")


if __name__ == "__main__":
    main()
