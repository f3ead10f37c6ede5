"""Where the host time of a compressed all-reduce goes, phase by phase, under
``LOCO_ISSUER=inline`` (the CUDA path's issuing logic on CPU tensors): `lowbitcc perf`'s
``host_us`` split up. It measures the Python plan path: the C++ module is off
(``LOWBITCC_NATIVE_WORKS=0``), since a plan's C++ core (`lowbitcc.backend.plan_cores`) runs
none of the Python methods whose phases it marks; `lowbitcc perf` times the core.

Feeds docs/host-time.md (its
"Re-agreements": the calls that exchanged a descriptor among the timed ones);
tests/tools/test_host_phases.py runs it (``-m slow``).

Each rank times ``--calls`` forced all-reduces of ``--elements`` fp32 elements (after 100
untimed; one training step each, as `lowbitcc perf` times them) and marks, with
`time.perf_counter_ns` (inside the policy blocks) around the methods a planned call passes
through, when the call entered
"loco" (`LocoProcessGroup.allreduce`), the issuer (`InlineIssuer.run_plan`), the place's plan
(`CallPlan.run`) and its launches and transfers (`CallPlan.launch`), and when each returned.
A call's codec and wire time (`lowbitcc.stats()`, read between calls) is taken out of the
launch phase, so the phases add up to the call's host time. Printed per rank: the median of
each phase over the planned calls, and the calls that exchanged a descriptor instead (the
place's first agreement: the whole job path, on the worker; since 2026-11-28 its later ones are
renewals in the background, `lowbitcc.backend.renewal`, so none among the timed calls), with
their mean host time and what they add to the mean over all calls. The wrappers cost a few
microseconds per call.

    python tests/probes/host_phases.py --calls 1000
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

PHASES = ("c10d in", "to the issuer", "to the plan", "plan before launch", "launch, no codec/wire",
          "plan after launch", "back to the issuer", "back to loco", "c10d out")
"""A planned call's phases, in order (the spans between `MARKS`' times: `_phases`)."""
MARKS = (("loco", "LocoProcessGroup", "allreduce"), ("issuer", "InlineIssuer", "run_plan"),
         ("plan", "CallPlan", "run"), ("launch", "CallPlan", "launch"))
"""The methods timed: (name, class, method)."""


def _wrap(cls: Any, method: str, name: str, marks: dict[str, int]) -> None:
    """Record ``name >`` and ``name <`` in ``marks`` around every call of ``cls.method``."""
    original = getattr(cls, method)
    clock = time.perf_counter_ns

    def timed(*args: Any, **kwargs: Any) -> Any:
        marks[name + ">"] = clock()
        try:
            return original(*args, **kwargs)
        finally:
            marks[name + "<"] = clock()

    setattr(cls, method, timed)


def _phases(start: int, end: int, marks: dict[str, int], busy_ns: float) -> list[float]:
    """`PHASES` of one planned call (ns), from its ``marks`` and codec and wire time."""
    points = [start, marks["loco>"], marks["issuer>"], marks["plan>"], marks["launch>"],
              marks["launch<"], marks["plan<"], marks["issuer<"], marks["loco<"], end]
    spans = [b - a for a, b in zip(points, points[1:])]
    spans[4] -= busy_ns
    return spans


def probe(rank: int, world: int, elements: int, calls: int) -> dict[str, Any]:
    """This rank's phases per planned call and host time per exchanging call (us)."""
    import torch
    import torch.distributed as dist

    import lowbitcc
    from lowbitcc.backend import call_plan, inline_issue, process_group

    classes = {"LocoProcessGroup": process_group.LocoProcessGroup,
               "InlineIssuer": inline_issue.InlineIssuer, "CallPlan": call_plan.CallPlan}
    marks: dict[str, int] = {}
    for name, cls, method in MARKS:
        _wrap(classes[cls], method, name, marks)

    def busy() -> float:
        s = lowbitcc.stats()["compressed"]
        return (s["codec_s"] + s["wire_s"]) * 1e9

    x = torch.randn(elements, generator=torch.Generator().manual_seed(rank))
    start = x.clone()
    planned: list[list[float]] = []
    exchanged: list[float] = []
    for i in range(calls + 100):
        if i % 50 == 0:  # AVG keeps values finite; a fresh start keeps them varied
            x.copy_(start)
        marks.clear()
        before = busy()
        with lowbitcc.compressed(), lowbitcc.feedback_key("host_phases"):
            t0 = time.perf_counter_ns()
            dist.all_reduce(x, op=dist.ReduceOp.AVG)
            t1 = time.perf_counter_ns()
        lowbitcc.end_step()
        if i < 100:
            continue
        spent = busy() - before
        if "plan>" in marks:
            planned.append([s / 1e3 for s in _phases(t0, t1, marks, spent)])
        else:
            exchanged.append((t1 - t0 - spent) / 1e3)
    return {"planned": planned, "exchanged": exchanged}


def report(rank: int, result: dict[str, Any]) -> str:
    planned, exchanged = result["planned"], result["exchanged"]
    if not planned:
        raise SystemExit(f"host_phases: no call of rank {rank} ran by its place's plan "
                         "(a size under the plans' reach, or plans off)")
    medians = [statistics.median(call[p] for call in planned) for p in range(len(PHASES))]
    hosts = [sum(call) for call in planned]
    lines = [f"rank {rank}: {len(planned)} planned calls, median host "
             f"{statistics.median(hosts):.1f} us (mean {statistics.mean(hosts):.1f})"]
    lines += [f"  {phase:<24} {m:8.1f} us" for phase, m in zip(PHASES, medians)]
    if exchanged:
        total = len(planned) + len(exchanged)
        extra = (sum(exchanged) - len(exchanged) * statistics.mean(hosts)) / total
        lines.append(f"  {len(exchanged)} calls exchanged a descriptor: mean host "
                     f"{statistics.mean(exchanged):.0f} us each, adding {extra:.1f} us to the "
                     f"mean of all {total} calls (against planned calls in their place), "
                     f"which is {(sum(hosts) + sum(exchanged)) / total:.1f} us")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--elements", type=int, default=1 << 18, help="fp32 elements (1 MiB)")
    parser.add_argument("--calls", type=int, default=1000)
    args = parser.parse_args()
    import os

    os.environ["LOCO_ISSUER"] = "inline"
    os.environ["LOWBITCC_NATIVE_WORKS"] = "0"  # the Python plan path (module docstring)
    from lowbitcc.tools import spawn

    results = spawn.run_ranks(probe, args.ranks, args.elements, args.calls, backend="loco")
    for rank, result in enumerate(results):
        print(report(rank, result))


if __name__ == "__main__":
    main()
