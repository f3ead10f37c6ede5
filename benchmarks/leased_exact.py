"""What an exact all-reduce that the cost model leased to the exact path costs against gloo's.

Each rank makes a "loco" group compressing every call the policy allows (``policy="always"``,
the cost model on) whose model has already seen exact calls of every size far faster than
compressed ones, so that after its warm-up (``warmup`` compressed and exact calls each, one
exchanged with the lease) every call is leased: since issue 35 the calling thread issues it at
once on the group's direct gloo group and returns gloo's Work. It then times synchronous
all-reduces on that group and on a plain gloo group, alternating them and which goes first,
after a barrier, and prints the medians and gloo's time over loco's per size (2 local ranks).

    python benchmarks/leased_exact.py [--calls 40] [--sizes 65536 1048576 16777216]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import lowbitcc
from lowbitcc.cost_model import CostModel
from lowbitcc.tools import spawn


def _rank(rank: int, world: int, sizes: list[int], calls: int) -> dict[int, tuple[float, float]]:
    gloo = dist.new_group(backend="gloo")
    loco = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(
        policy="always", cost_model=True, call_schedule=False))
    out = {}
    for n in sizes:
        size_class = CostModel.size_class("all_reduce", n * 4)
        for _ in range(3):
            loco.cost_model.record(size_class, True, 1e-9, n * 4)
            loco.cost_model.record(size_class, False, 10.0, n * 4)
        x = torch.randn(n)
        times: dict[str, list[float]] = {"loco": [], "gloo": []}
        warmup = 2 * loco.cost_model.warmup + 1
        for i in range(warmup + calls):
            pair = [("loco", loco), ("gloo", gloo)]
            for name, group in pair if i % 2 else pair[::-1]:
                y = x.clone()
                dist.barrier(gloo)
                start = time.perf_counter()
                dist.all_reduce(y, group=group)
                times[name].append(time.perf_counter() - start)
        out[n] = (statistics.median(times["loco"][warmup:]),
                  statistics.median(times["gloo"][warmup:]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--sizes", type=int, nargs="+", default=[65536, 1 << 20, 1 << 24],
                        help="elements (fp32)")
    args = parser.parse_args()
    result = spawn.run_ranks(_rank, 2, args.sizes, args.calls)[0]
    print(f"{'elements':>10} {'loco ms':>9} {'gloo ms':>9} {'gloo/loco':>9}")
    for n, (loco_s, gloo_s) in result.items():
        print(f"{n:>10} {loco_s * 1e3:>9.3f} {gloo_s * 1e3:>9.3f} {gloo_s / loco_s:>9.2f}")


if __name__ == "__main__":
    main()
