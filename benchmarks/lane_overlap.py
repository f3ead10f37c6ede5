"""How much of a compressed all-reduce the caller's own work hides, against gloo's in the same run.

Feeds docs/host-time.md, "The issue lane".

A call served by a plan core whose runs are whole (the tree's, the ring's, an all-reduce's two
phases on more than two ranks) runs on the group's issue lane (``backend/csrc/issue_lane.h``):
the call returns once queued and the caller computes while it travels, as beside a gloo call.
Each rank runs, in turn per round: the call alone (issued, then waited for), the compute alone
(matrix products of about ``--compute-ms``), and the two together (the call issued with
``async_op=True``, the compute, then the wait), for a "loco" group (``lowbitcc.compressed()``:
the call compressed, ``--schedule``'s plan) and for gloo. Printed per group (rank 0's clock,
medians of ``--rounds``): the time its call takes to return (``issue``), the call alone, the
compute alone, together, and ``hidden``: the part of the shorter of the two that overlapping
saved, ``(call + compute - together) / min(call, compute)`` (1: all of it; 0: none). A
whole run on the calling thread (before the lane) returned only once its first transfers
were done, so its ``issue`` was most of its ``call`` and its ``hidden`` near 0.

    python benchmarks/lane_overlap.py [--np 3] [--elements 1048576] [--schedule direct]
        [--compute-ms 20] [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def _rank(rank: int, world: int, elements: int, schedule: str, compute_ms: float,
          rounds: int) -> dict[str, dict[str, float]]:
    import torch
    import torch.distributed as dist

    import lowbitcc

    groups = {"loco": dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(
                  min_size=2, cost_model=False, schedule=schedule)),
              "gloo": dist.new_group(backend="gloo")}
    a = torch.randn(256, 256)
    for _ in range(4):
        a @ a
    begun = time.perf_counter()
    for _ in range(16):
        a @ a
    each_ms = (time.perf_counter() - begun) * 1e3 / 16
    loops = torch.tensor(max(1.0, compute_ms / each_ms))  # (the ranks agree on the most)
    dist.all_reduce(loops, op=dist.ReduceOp.MAX)
    loops = int(loops.item())

    def compute() -> None:
        for _ in range(loops):
            a @ a

    def call(group: Any, overlap: bool) -> tuple[float, float]:
        tensor = torch.full((elements,), float(rank + 1))
        dist.barrier(group=groups["gloo"])
        begun = time.perf_counter()
        with lowbitcc.compressed():
            work = dist.all_reduce(tensor, group=group, async_op=True)
        issued = time.perf_counter()
        if overlap:
            compute()
        work.wait()
        lowbitcc.end_step()
        return issued - begun, time.perf_counter() - begun

    for group in groups.values():  # (the places agreed and steady)
        for _ in range(12):
            call(group, False)
    seen: dict[str, dict[str, list[float]]] = {
        name: {"issue": [], "call": [], "compute": [], "together": []} for name in groups}
    for _ in range(rounds):
        for name, group in groups.items():
            issue, alone = call(group, False)
            dist.barrier(group=groups["gloo"])
            begun = time.perf_counter()
            compute()
            computed = time.perf_counter() - begun
            _, together = call(group, True)
            for key, value in (("issue", issue), ("call", alone), ("compute", computed),
                               ("together", together)):
                seen[name][key].append(value)
    return {name: {key: statistics.median(values) for key, values in kinds.items()}
            for name, kinds in seen.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, default=3)
    parser.add_argument("--elements", type=int, default=1 << 20)
    parser.add_argument("--schedule", default="direct", choices=["direct", "tree", "ring"])
    parser.add_argument("--compute-ms", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    from lowbitcc.tools import spawn

    result = spawn.run_ranks(_rank, args.np, args.elements, args.schedule, args.compute_ms,
                             args.rounds, backend="gloo")[0]
    print(f"{args.np} ranks, {args.elements} fp32 elements, schedule {args.schedule}, "
          f"{args.rounds} rounds (medians, rank 0)")
    print(f"{'group':>6} {'issue ms':>9} {'call ms':>8} {'compute ms':>11} {'together ms':>12} "
          f"{'hidden':>7}")
    for name, t in result.items():
        hidden = (t["call"] + t["compute"] - t["together"]) / min(t["call"], t["compute"])
        print(f"{name:>6} {t['issue'] * 1e3:>9.3f} {t['call'] * 1e3:>8.2f} "
              f"{t['compute'] * 1e3:>11.2f} {t['together'] * 1e3:>12.2f} {hidden:>7.2f}")
    loco, gloo = result["loco"], result["gloo"]
    print(f"loco over gloo: call {loco['call'] / gloo['call']:.3f}x, together "
          f"{loco['together'] / gloo['together']:.3f}x")


if __name__ == "__main__":
    main()
