"""What an exact all-reduce through "loco" costs against gloo's own, with the default settings.

Issue 46: every call place has a schedule entry, so a call that stays exact (here: issued
outside backward, so the policy leaves it exact) exchanges its descriptor on its place's first
runs only; then it is the inner gloo group's own call (`lowbitcc.backend.reductions`). Each
rank makes a "loco" group with the environment's config and a plain gloo group, then times
synchronous all-reduces on both, alternating them and which goes first, each after a barrier,
each call one step (``lowbitcc.end_step``), and prints per size the medians after the warm-up
and loco's time over gloo's (2 local ranks unless ``--np``).

    python benchmarks/exact_calls.py [--calls 60] [--sizes 262144 4194304] [--np 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import lowbitcc
from lowbitcc.tools import spawn

WARMUP = 4
"""Calls per size left out of the medians: the place agrees (and the period closes) there."""


def _rank(rank: int, world: int, sizes: list[int], calls: int) -> dict[int, tuple[float, float]]:
    gloo = dist.new_group(backend="gloo")
    loco = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig.from_env())
    out = {}
    for n in sizes:
        x = torch.randn(n)
        times: dict[str, list[float]] = {"loco": [], "gloo": []}
        for i in range(WARMUP + calls):
            pair = [("loco", loco), ("gloo", gloo)]
            for name, group in pair if i % 2 else pair[::-1]:
                y = x.clone()
                dist.barrier(gloo)
                start = time.perf_counter()
                dist.all_reduce(y, group=group)
                times[name].append(time.perf_counter() - start)
            lowbitcc.end_step()
        out[n] = (statistics.median(times["loco"][WARMUP:]),
                  statistics.median(times["gloo"][WARMUP:]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1 << 18, 1 << 22],
                        help="elements (fp32): 1 MiB and 16 MiB by default")
    parser.add_argument("--np", type=int, default=2)
    args = parser.parse_args()
    result = spawn.run_ranks(_rank, args.np, args.sizes, args.calls)[0]
    print(f"{'bytes':>10} {'loco ms':>9} {'gloo ms':>9} {'loco/gloo':>9}")
    for n, (loco_s, gloo_s) in result.items():
        print(f"{n * 4:>10} {loco_s * 1e3:>9.3f} {gloo_s * 1e3:>9.3f} {loco_s / gloo_s:>9.3f}")


if __name__ == "__main__":
    main()
