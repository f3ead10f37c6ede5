"""What an exact all-reduce through "loco" costs against gloo's own, with the default settings.

Feeds docs/host-time.md (its "Exact calls":
loco over gloo at 1 MiB and 16 MiB).

Every call place has a schedule entry, so a call that stays exact (here: issued outside
backward, so the policy leaves it exact) exchanges its descriptor on its place's first runs
only; then it is the inner gloo group's own call (`lowbitcc.backend.reductions`). Each rank
makes a "loco" group with the environment's config and a plain gloo group, then times
synchronous all-reduces on both in blocks of ``--block`` calls back to back (each call one
step, ``lowbitcc.end_step``), alternating the two and which goes first, a barrier before each
block, and prints per size the median time per call and loco's over gloo's (2 local ranks
unless ``--np``).

    python benchmarks/exact_calls.py [--calls 200] [--sizes 262144 4194304] [--np 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

WARMUP = 4
"""Untimed calls per size first: the place agrees (and the period closes) there."""


def _rank(rank: int, world: int, sizes: list[int], calls: int,
          block: int) -> dict[int, tuple[float, float]]:
    import torch
    import torch.distributed as dist

    import lowbitcc

    gloo = dist.new_group(backend="gloo")
    loco = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig.from_env())
    out = {}
    for n in sizes:
        x = torch.randn(n)
        for _ in range(WARMUP):
            dist.all_reduce(x.clone(), group=loco)
            lowbitcc.end_step()
        times: dict[str, list[float]] = {"loco": [], "gloo": []}
        for i in range(calls // block):
            pair = [("loco", loco), ("gloo", gloo)]
            for name, group in pair if i % 2 else pair[::-1]:
                y = x.clone()
                dist.barrier(gloo)
                start = time.perf_counter()
                for _ in range(block):  # back to back, as training's calls and perf's
                    dist.all_reduce(y, group=group)
                    lowbitcc.end_step()
                times[name].append((time.perf_counter() - start) / block)
        out[n] = (statistics.median(times["loco"]), statistics.median(times["gloo"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1 << 18, 1 << 22],
                        help="elements (fp32): 1 MiB and 16 MiB by default")
    parser.add_argument("--block", type=int, default=10,
                        help="calls timed back to back, alternating loco's and gloo's blocks")
    parser.add_argument("--np", type=int, default=2)
    args = parser.parse_args()
    from lowbitcc.tools import spawn

    result = spawn.run_ranks(_rank, args.np, args.sizes, args.calls, args.block)[0]
    print(f"{'bytes':>10} {'loco ms':>9} {'gloo ms':>9} {'loco/gloo':>9}")
    for n, (loco_s, gloo_s) in result.items():
        print(f"{n * 4:>10} {loco_s * 1e3:>9.3f} {gloo_s * 1e3:>9.3f} {loco_s / gloo_s:>9.3f}")


if __name__ == "__main__":
    main()
