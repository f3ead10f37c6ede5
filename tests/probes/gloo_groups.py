"""How much gloo groups made alike differ in time per call: the noise under every "x gloo" ratio
at small sizes.

Each rank of a local process pair makes ``--groups`` plain gloo groups (``dist.new_group``, in
turn, on the same store) and times synchronous all-reduces of ``--elements`` fp32 elements on
each group's C++ backend (``allreduce([tensor]).wait()``, no Python of lowbitcc's), ``--calls``
calls per group and round, in ``--rounds`` rounds whose group order alternates, a barrier
before each block (on a gloo group of its own). Printed per rank: each group's median time per
call over the rounds, with the lowest and highest of its rounds' medians (in the order the
groups were made), and the slowest group's median over the fastest's. The ranks' default group
is a plain gloo group too. A group that keeps its speed
from round to round while another made alike keeps another one says that a comparison with
one other group measures the two groups (docs/performance.md, "The machine"; the reason why
`benchmarks/exact_calls.py` times "loco" against its own inner gloo group and over three plain
ones).

    python tests/probes/gloo_groups.py [--groups 6] [--elements 262144] [--calls 100] [--rounds 6]
"""

from __future__ import annotations

import argparse
import statistics
import time


def _rank(rank: int, world: int, groups: int, elements: int, calls: int,
          rounds: int) -> list[tuple[float, float, float]]:
    import torch
    import torch.distributed as dist

    made = [dist.new_group(backend="gloo") for _ in range(groups)]
    sync = dist.new_group(backend="gloo")
    backends = [group._get_backend(torch.device("cpu")) for group in made]
    x = torch.randn(elements)
    times: list[list[float]] = [[] for _ in range(groups)]
    for r in range(rounds):
        for i in range(groups) if r % 2 else reversed(range(groups)):
            y = x.clone()
            dist.barrier(sync)
            took = []
            for _ in range(calls):
                begun = time.perf_counter()
                backends[i].allreduce([y]).wait()
                took.append(time.perf_counter() - begun)
            times[i].append(statistics.median(took))
    return [(statistics.median(t) * 1e6, min(t) * 1e6, max(t) * 1e6) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=6)
    parser.add_argument("--elements", type=int, default=1 << 18)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    if args.groups < 1:
        parser.error("--groups must be at least 1")
    from lowbitcc.tools import spawn

    results = spawn.run_ranks(_rank, 2, args.groups, args.elements, args.calls, args.rounds,
                              backend="gloo")
    print(f"{args.groups} gloo groups, 2 ranks, {args.elements} fp32 elements, {args.calls} "
          f"calls x {args.rounds} rounds per group (median us per call [its rounds' lowest-"
          "highest], in making order)")
    for rank, groups in enumerate(results):
        cells = ", ".join(f"{m:.0f} [{lo:.0f}-{hi:.0f}]" for m, lo, hi in groups)
        medians = [m for m, _, _ in groups]
        print(f"rank {rank}: {cells}; slowest over fastest {max(medians) / min(medians):.2f}x")


if __name__ == "__main__":
    main()
