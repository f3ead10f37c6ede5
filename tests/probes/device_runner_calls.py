"""Python function calls per steady call that a device runner (`steady_runner.device_runner`: a
CUDA group's, here of "cpu" over the group's direct gloo group, under the inline issuer, which
issues on the calling thread as `CudaIssuer` does) leaves, against the Python path it stands
in for. Feeds docs/gpu.md; counted, not timed, so any load on the machine
leaves the counts as they are.

Each rank runs ``--calls`` synchronous all-reduces of ``--elements`` fp32 elements per way and
kind, each a step (`lowbitcc.end_step`), on a "loco" group with the inline issuer: **exact**
(outside a block: the places agree them exact) and **compressed** (inside
`lowbitcc.compressed()`), first 3 steps to agree the places, then the counted calls. Three
ways: ``python`` (both runners set aside: every call the Python path's), ``device`` (the
group's CPU runner set aside and a device runner in its place: an exact entry served in C++, a
compressed entry's place taken in C++ and its run `Reductions.run`'s), and ``cpu`` (the group's
own CPU runner: an exact entry served in C++, a compressed one by its plan's C++ core). The
Python functions called on the calling thread (``sys.setprofile``'s "call" events, the
block's and `end_step`'s left out) per call are printed per way and kind, with the calls
served by the runner in use.

    python tests/probes/device_runner_calls.py [--calls 200] [--elements 262144]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""This checkout, put first on ``sys.path``: the ranks import its test bed
(`tests.support.device_runners`)."""

WAYS = ("python", "device", "cpu")
KINDS = ("exact", "compressed")


def _counter(counted: list[int]):
    """A ``sys.setprofile`` function that adds each Python call to ``counted[0]``."""

    def count(frame, event, arg):
        if event == "call":
            counted[0] += 1

    return count


def _rank(rank: int, world: int, calls: int, elements: int) -> dict[str, dict[str, float]]:
    import contextlib

    import torch
    import torch.distributed as dist

    import lowbitcc
    from lowbitcc.backend import steady_runner
    from tests.support.device_runners import cpu_device_runner

    out: dict[str, dict[str, float]] = {}
    for way in WAYS:
        group = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(
            issuer="inline", min_size=2))
        runner = group._runner
        if way != "cpu":
            group._runner = steady_runner.NoRunner()
        if way == "device":
            runner = cpu_device_runner(group)
        tensor = torch.ones(elements)
        for kind in KINDS:
            block = lowbitcc.compressed if kind == "compressed" else contextlib.nullcontext
            for _ in range(3):  # the place's agreement: every call after it is its entry
                with block():
                    dist.all_reduce(tensor, group=group)
                lowbitcc.end_step()
            served = runner.served if way != "python" else 0
            counted = [0]
            count = _counter(counted)
            for _ in range(calls):
                with block():
                    sys.setprofile(count)
                    dist.all_reduce(tensor, group=group)
                    sys.setprofile(None)
                lowbitcc.end_step()
            out[f"{way} {kind}"] = {
                "calls": counted[0] / calls,
                "served": (runner.served - served) if way != "python" else 0}
        dist.destroy_process_group(group)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--elements", type=int, default=262144)
    parser.add_argument("--np", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from lowbitcc.tools.spawn import run_ranks

    results = run_ranks(_rank, args.np, args.calls, args.elements, backend="gloo",
                        timeout_s=1200)
    print(f"Python calls per steady all-reduce of {args.elements} fp32 elements on the calling "
          f"thread, {args.np} ranks, {args.calls} calls per way and kind (inline issuer)")
    for rank, res in enumerate(results):
        for kind in KINDS:
            print(f"rank {rank} {kind}: " + ", ".join(
                f"{w} {res[f'{w} {kind}']['calls']:.1f} (served {res[f'{w} {kind}']['served']})"
                for w in WAYS))


if __name__ == "__main__":
    main()
