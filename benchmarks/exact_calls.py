"""What an exact all-reduce through "loco" costs against gloo's own, with the default settings
(``--collective all_gather`` or ``broadcast``: an exact data movement's).

Feeds docs/host-time.md (its "Exact calls": loco over gloo at 1 MiB and 16 MiB; its "Data
movements").

Every call place has a schedule entry, so a call that stays exact (here: issued outside
backward, so the policy leaves it exact) exchanges its descriptor on its place's first runs
only; then it is the inner gloo group's own call (`lowbitcc.backend.reductions`), served in C++
(`lowbitcc.backend.steady_runner`). Each rank makes a "loco" group with the environment's
config and plain gloo groups, then times synchronous all-reduces three ways in blocks of
``--block`` calls back to back (each call one step, ``lowbitcc.end_step``), the ways' order
rotated from block to block and reversed every other block (so that no way always follows
another), a barrier on a gloo group of its own before each block. Each way makes the call c10d's C++
callers make (DDP's reducer: ``ProcessGroup.allreduce([tensor])``, then the Work's ``wait``),
without ``dist.all_reduce``'s Python wrapper, which every backend pays alike (27-54 us here,
docs/host-time.md):

- **loco**: the "loco" group's ``allreduce``;
- **direct**: the same call on the "loco" group's own inner gloo group (``_direct``, the one
  its exact entries are issued on): the same sockets and threads as loco's, so loco over
  direct is what lowbitcc adds to the call;
- **gloo**: the same call on ``--groups`` plain gloo groups (``dist.new_group``, their gloo
  backends), in turn; the median over all their blocks.

Two gloo groups made alike can differ by more than two-fold in time per call on a small shared
VM (`tests/probes/gloo_groups.py`; docs/performance.md, "The machine"), so a comparison with
one other group measures the groups, not lowbitcc; the gloo column shows the spread over
several. Printed per size: the
median time per call of each way, the slowest and fastest gloo group's, and loco's over direct
and over gloo (2 local ranks unless ``--np``).

With ``--collective all_gather`` each way's call is ``_allgather_base(output, tensor)`` (what
``dist.all_gather_into_tensor`` and FSDP call; the output ``--np`` times the size), with
``broadcast`` ``broadcast([tensor])`` from rank 0, and **direct** is the "loco" group's inner gloo
group (``_inner``, the one its data movements go to); sizes are per rank.

    python benchmarks/exact_calls.py [--calls 200] [--sizes 262144 4194304] [--np 2] [--groups 3]
        [--collective all_reduce]
"""

from __future__ import annotations

import argparse
import statistics
import time

WARMUP = 4
"""Untimed calls per size first: the place agrees (and the period closes) there."""

COLLECTIVES = {
    "all_reduce": ("_direct", lambda backend, x, gathered: backend.allreduce([x])),
    "all_gather": ("_inner", lambda backend, x, gathered: backend._allgather_base(gathered, x)),
    "broadcast": ("_inner", lambda backend, x, gathered: backend.broadcast([x])),
}
"""Each collective's "direct" group (an attribute of the "loco" group) and the call each way
makes on a backend, of ``x`` (into ``gathered``: an all-gather's output)."""


def _rank(rank: int, world: int, sizes: list[int], calls: int, block: int,
          groups: int, collective: str) -> dict[int, dict[str, float]]:
    import torch
    import torch.distributed as dist

    import lowbitcc

    plain = [dist.new_group(backend="gloo") for _ in range(groups)]
    sync = dist.new_group(backend="gloo")  # (the barrier's: no way's group gets extra calls)
    loco = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig.from_env())
    # each way's C++ backend: the "loco" group, its inner gloo group of its exact entries, and
    # each plain group's gloo backend
    direct, call = COLLECTIVES[collective]
    backends = {"loco": loco, "direct": getattr(loco, direct)}
    for i, group in enumerate(plain):
        backends[f"gloo{i}"] = group._get_backend(torch.device("cpu"))
    names = list(backends)
    out = {}
    for n in sizes:
        x = torch.randn(n)
        gathered = torch.empty(world * n)
        for _ in range(WARMUP):
            call(loco, x.clone(), gathered).wait()
            lowbitcc.end_step()
        times: dict[str, list[float]] = {name: [] for name in names}
        for i in range(calls // block):
            order = names[i % len(names):] + names[:i % len(names)]
            for name in order if i % 2 else order[::-1]:
                y = x.clone()
                dist.barrier(sync)
                start = time.perf_counter()
                for _ in range(block):  # back to back, as training's calls and perf's
                    call(backends[name], y, gathered).wait()
                    lowbitcc.end_step()
                times[name].append((time.perf_counter() - start) / block)
        medians = {name: statistics.median(t) for name, t in times.items()}
        gloo = [medians[f"gloo{i}"] for i in range(groups)]
        out[n] = {"loco": medians["loco"], "direct": medians["direct"],
                  "gloo": statistics.median(sum((times[f"gloo{i}"] for i in range(groups)), [])),
                  "gloo_min": min(gloo), "gloo_max": max(gloo)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1 << 18, 1 << 22],
                        help="elements (fp32): 1 MiB and 16 MiB by default")
    parser.add_argument("--block", type=int, default=10,
                        help="calls timed back to back per block; the ways' blocks alternate")
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--groups", type=int, default=3,
                        help="plain gloo groups the gloo column is the median over")
    parser.add_argument("--collective", choices=sorted(COLLECTIVES), default="all_reduce")
    args = parser.parse_args()
    if args.groups < 1:
        parser.error("--groups must be at least 1")
    from lowbitcc.tools import spawn

    result = spawn.run_ranks(_rank, args.np, args.sizes, args.calls, args.block,
                             args.groups, args.collective)[0]
    print(f"{'bytes':>10} {'loco ms':>9} {'direct ms':>9} {'gloo ms':>9} {'gloo range ms':>15} "
          f"{'loco/direct':>11} {'loco/gloo':>9}")
    for n, r in result.items():
        spread = f"{r['gloo_min'] * 1e3:.3f}-{r['gloo_max'] * 1e3:.3f}"
        print(f"{n * 4:>10} {r['loco'] * 1e3:>9.3f} {r['direct'] * 1e3:>9.3f} "
              f"{r['gloo'] * 1e3:>9.3f} {spread:>15} {r['loco'] / r['direct']:>11.3f} "
              f"{r['loco'] / r['gloo']:>9.3f}")


if __name__ == "__main__":
    main()
