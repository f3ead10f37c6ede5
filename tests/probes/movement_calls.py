"""Python function calls per exact data movement on every Python thread of the process, on a
"loco" group against the gloo group's own call: an all-gather into one tensor
(``dist.all_gather_into_tensor``: FSDP's parameter gathers), an all-gather into a list
(``dist.all_gather``), a broadcast (``dist.broadcast``: DDP's buffers), an all-to-all
(``dist.all_to_all_single``: a mixture of experts' tokens), each of one tensor, and a pipeline
stage's exchange (``send_recv``: ``dist.isend`` to the next rank and ``dist.irecv`` from the one
before, both waited for: two calls, whose Python calls are counted together).
Feeds docs/host-time.md ("Data movements"); counted, not timed, so any load on the machine
leaves the counts as they are; tests/tools/test_movement_calls.py runs it (``-m slow``).

A group's runner serves them in C++ (``backend/csrc/runner_moves.h``: the inner gloo group's own
call from the calling thread); a call it declines goes to the group's worker and waiter threads
(`data_movement.DataMovements.exact`), whose Python is counted too: the profile function is set
for every thread (``threading.setprofile``) before the groups and their threads are made, and
for the calling thread while it counts. Each rank runs ``--calls`` synchronous calls of
``--elements`` fp32 elements per rank, per collective and group, after 20 uncounted, three ways:
``gloo`` (a plain gloo group), ``loco`` (a "loco" group, the default settings) and ``python``
(the same with its runner set aside: every call the Python path's). Printed per rank and
collective: the Python calls ("call" events) per call of each way, with the calls the runner
served (``send_recv``: two per exchange).

    python tests/probes/movement_calls.py [--calls 200] [--elements 65536]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
"""This checkout, put first on ``sys.path`` (the ranks import its package)."""

WAYS = ("gloo", "loco", "python")
COLLECTIVES = ("all_gather_into_tensor", "all_gather", "broadcast", "all_to_all_single",
               "send_recv")
CALLS_PER_ISSUE = {"send_recv": 2}
"""The calls of the group one issue of a collective makes, where not one."""


def _rank(rank: int, world: int, calls: int, elements: int) -> dict[str, dict[str, float]]:
    import threading

    import torch
    import torch.distributed as dist

    from lowbitcc.backend import steady_runner

    counting = [False, 0]

    def count(frame, event, arg):
        if counting[0] and event == "call":
            counting[1] += 1

    threading.setprofile(count)  # (every thread started from here on: the groups' threads)
    groups = {"gloo": dist.new_group(backend="gloo"), "loco": dist.new_group(backend="loco"),
              "python": dist.new_group(backend="loco")}
    runners = {"loco": groups["loco"]._runner}
    groups["python"]._runner = steady_runner.NoRunner()
    x, out = torch.ones(elements), torch.empty(world * elements)
    parts = [torch.empty(elements) for _ in range(world)]
    rows, received = torch.ones(world, elements), torch.empty(world, elements)
    after, before, got = (rank + 1) % world, (rank - 1) % world, torch.empty(elements)

    def send_recv(group: Any) -> None:
        sending = dist.isend(x, after, group=group)
        dist.irecv(got, before, group=group).wait()
        sending.wait()

    issue = {
        "all_gather_into_tensor": lambda g: dist.all_gather_into_tensor(out, x, group=g),
        "all_gather": lambda g: dist.all_gather(parts, x, group=g),
        "broadcast": lambda g: dist.broadcast(x, src=0, group=g),
        "all_to_all_single": lambda g: dist.all_to_all_single(received, rows, group=g),
        "send_recv": send_recv,
    }
    result: dict[str, dict[str, float]] = {}
    for collective in COLLECTIVES:
        for way in WAYS:
            group = groups[way]
            for _ in range(20):
                issue[collective](group)
            dist.barrier(groups["gloo"])
            served = runners["loco"].served_moves
            counting[:] = [True, 0]
            sys.setprofile(count)
            for _ in range(calls):
                issue[collective](group)
            sys.setprofile(None)
            counting[0] = False
            result[f"{collective} {way}"] = {
                "calls": counting[1] / calls,
                "served": runners["loco"].served_moves - served if way == "loco" else 0}
    threading.setprofile(None)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--elements", type=int, default=65536)
    parser.add_argument("--np", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from lowbitcc.tools.spawn import run_ranks

    results = run_ranks(_rank, args.np, args.calls, args.elements, backend="gloo",
                        timeout_s=1200)
    print(f"Python calls per data movement of {args.elements} fp32 elements per rank on every "
          f"thread, {args.np} ranks, {args.calls} calls per way")
    for rank, res in enumerate(results):
        for collective in COLLECTIVES:
            print(f"rank {rank} {collective}: " + ", ".join(
                f"{w} {res[f'{collective} {w}']['calls']:.1f}" for w in WAYS)
                + f" (served {res[f'{collective} loco']['served']})")


if __name__ == "__main__":
    main()
