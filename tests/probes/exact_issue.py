"""Host time to issue a steady exact all-reduce: a "loco" group's call served by the C++ runner
(`lowbitcc.backend.steady_runner`), the same group's call through the Python path (the runner
set aside), and gloo's own call, in rounds that alternate the three ways.

Feeds docs/host-time.md;
tests/tools/test_exact_issue.py runs it (``-m slow``).

Each rank issues ``--calls`` asynchronous all-reduces of ``--elements`` fp32 elements per
round and way, outside backward (so "loco" agrees them exact and each becomes its place's
exact entry after the first), timing only ``dist.all_reduce(..., async_op=True)``'s return on
the calling thread, then waits for the Work. Printed per rank and way: the median over rounds
of each round's median issue time in microseconds, and the ratio to gloo's.

    python tests/probes/exact_issue.py [--calls 400] [--rounds 6] [--elements 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

WAYS = ("runner", "python", "gloo")


def _rank(rank: int, world: int, calls: int, rounds: int, elements: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    import lowbitcc
    from lowbitcc.backend import steady_runner

    loco = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(min_size=2))
    gloo = dist.new_group(backend="gloo")
    runner = loco._runner
    python = steady_runner.NoRunner()
    tensor = torch.ones(elements)
    per_way: dict[str, list[float]] = {w: [] for w in WAYS}
    for _ in range(3):  # the places' agreement: every call after it is its place's entry
        dist.all_reduce(tensor, group=loco)
        lowbitcc.end_step()
    for r in range(rounds):
        order = WAYS if r % 2 == 0 else tuple(reversed(WAYS))
        for way in order:
            loco._runner = runner if way == "runner" else python
            group = gloo if way == "gloo" else loco
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                work = dist.all_reduce(tensor, group=group, async_op=True)
                times.append(time.perf_counter() - start)
                work.wait()
                lowbitcc.end_step()
            per_way[way].append(statistics.median(times) * 1e6)
    loco._runner = runner
    return {**{w: statistics.median(v) for w, v in per_way.items()}, "served": runner.served}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--elements", type=int, default=256)
    parser.add_argument("--np", type=int, default=2)
    args = parser.parse_args()
    from lowbitcc.tools.spawn import run_ranks

    results = run_ranks(_rank, args.np, args.calls, args.rounds, args.elements, backend="gloo",
                        timeout_s=1200)
    print(f"issue time of a steady exact all-reduce of {args.elements} fp32 elements, "
          f"{args.np} ranks, {args.calls} calls x {args.rounds} rounds per way (median us)")
    for rank, res in enumerate(results):
        gloo = res["gloo"]
        print(f"rank {rank}: " + ", ".join(
            f"{w} {res[w]:.1f} ({res[w] / gloo:.2f}x gloo)" for w in WAYS)
            + f"; runner served {res['served']}")


if __name__ == "__main__":
    main()
