"""What Python is left in a steady compressed call that the C++ runner serves: the time to
issue it three ways, each served by the same C++ path:

- **dist**: ``dist.all_reduce(..., async_op=True)``, as a user's code calls it: torch's own
  Python wrapper (argument checks, loggers; gloo's calls pay it too), then as **c10d**;
- **c10d**: the group's C++ ``ProcessGroup.allreduce`` (called as
  ``dist.ProcessGroup.allreduce(group, ...)``), as DDP's reducer calls it: c10d's dispatch into
  the Python process group (pybind's trampoline), which finds the group's C++ ``allreduce`` in
  its instance dict (`steady_runner.install`; before it, the class's Python method and its
  torch.compile guard), then the runner;
- **runner**: the group's ``SteadyRunner.serve_all_reduce`` called directly: no dispatch, no
  Python frame of lowbitcc's.

c10d minus runner bounds what a C++ ``c10d::Backend`` in place of the Python group could take
off a DDP bucket call (it would still pay c10d's dispatch into a C++ backend, so it saves
less); dist minus c10d is torch's, paid by every backend. Feeds docs/host-time.md, "The floor,
re-agreements, reduce-scatters, exact calls".

Two ranks, one place (each call a training step, as `lowbitcc perf` times them: the place's
entry compressed, its plan's C++ core serving it), ``--calls`` all-reduces of ``--elements``
fp32 elements per way and round, the ways alternated in blocks of 10 calls; each call's issue
timed (its return, before ``wait``). Printed per rank: the median per way over every round.

    python tests/probes/python_left.py [--calls 400] [--rounds 4] [--elements 262144]
"""

from __future__ import annotations

import argparse
import statistics
import time

WAYS = ("dist", "c10d", "runner")


def _rank(rank: int, world: int, calls: int, rounds: int, elements: int) -> dict:
    import torch
    import torch.distributed as dist

    import lowbitcc

    pg = dist.new_group(backend="loco",
                        pg_options=lowbitcc.LocoConfig(min_size=2, cost_model=False))
    runner = pg._runner
    opts = dist.AllreduceOptions()
    tensor = torch.full((elements,), float(rank + 1))

    def through_dist() -> object:
        return dist.all_reduce(tensor, group=pg, async_op=True)

    def through_c10d() -> object:
        return dist.ProcessGroup.allreduce(pg, [tensor], opts)

    def direct() -> object:
        return runner.serve_all_reduce([tensor], opts)

    ways = {"dist": through_dist, "c10d": through_c10d, "runner": direct}
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    with lowbitcc.compressed():
        for _ in range(20):  # the place agreed, its plan and core made
            through_dist().wait()
            lowbitcc.end_step()
        served = runner.served_compressed
        for _ in range(rounds):
            for block in range(calls // 10):
                way = WAYS[block % len(WAYS)]
                for _ in range(10):
                    tensor.fill_(rank + 1.0)
                    begun = time.perf_counter()
                    work = ways[way]()
                    issued = time.perf_counter()
                    assert work is not None, "the runner declined a steady call"
                    work.wait()
                    lowbitcc.end_step()
                    times[way].append(issued - begun)
        served = runner.served_compressed - served
    return {"served": served, "calls": sum(len(t) for t in times.values()),
            **{way: statistics.median(t) * 1e6 for way, t in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--elements", type=int, default=262144)
    args = parser.parse_args()
    from lowbitcc.tools.spawn import run_ranks

    for rank, r in enumerate(run_ranks(_rank, 2, args.calls, args.rounds, args.elements,
                                       backend="gloo", timeout_s=1200)):
        print(f"rank {rank}: {r['served']} of {r['calls']} calls served in C++; issue, median: "
              + ", ".join(f"{way} {r[way]:.1f} us" for way in WAYS)
              + f"; c10d - runner {r['c10d'] - r['runner']:.1f} us, dist - c10d "
              f"{r['dist'] - r['c10d']:.1f} us")


if __name__ == "__main__":
    main()
