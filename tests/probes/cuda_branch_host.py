"""Host time of a steady-state planned all-reduce on the CUDA code branch, without a GPU.

Feeds docs/gpu.md, "Without a GPU" (the plan's own host work per run, from a host record against
eager), and docs/gpu/cuda-path.md; tests/tools/test_cuda_branch_host.py holds its call counts
to a budget.

The goal on a GPU is at most 100 us of host time per compressed call. Most of what a planned
call does on the host is the same Python whether or not a GPU is there: the plan's
bookkeeping, the codec's argument checks and the kernels' packed arguments. This runs rank
0's `call_plan.CallPlan` (`tests/support/cuda_trace.py`: ``device="meta"`` tensors, the CUDA
kernels' launcher replaced by a no-op and NCCL by a recorder) ``--runs`` times after 3 and
prints the time per run: everything but the launches themselves and NCCL's enqueue. Since
this machine's speed drifts by half within minutes, it also prints what does not drift: the
Python functions and the builtin (C) functions one run calls (``sys.setprofile``'s "call"
and "c_call" events, torch's and numpy's included). To compare revisions, run this script
from a worktree of each in turn (it imports the package of the checkout it lies in; copy it
and ``tests/support/cuda_trace.py`` into a worktree of a revision that lacks them);
``--profile`` prints the runs' cProfile by own time.

Each size runs in three modes, in turn, ``--rounds`` times: ``cpp``, host records issued by
their C++ replay (the default on a GPU, `launch_record`: here with stand-in kernel handles, a
recorder that drops each launch, and torch's C++ ``FakeProcessGroup`` in place of
ProcessGroupNCCL, so no step of the replay is Python's); ``records``, the same records issued
step by step in Python (without lowbitcc's C++ module); ``eager``, records off (every run makes
its arguments anew).

    python tests/probes/cuda_branch_host.py [--worlds 2 4] [--formats nvfp4 mxfp4] [--runs 3000]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
"""This checkout: its package and tests are imported from here (first on ``sys.path``)."""


def calls_per_run(plan: Any, x: Any) -> tuple[int, int]:
    """Python and builtin function calls of one run of ``plan``."""
    import torch.distributed as dist

    events = {"call": 0, "c_call": 0}

    def count(frame, event, arg):
        if event in events:
            events[event] += 1

    sys.setprofile(count)
    try:
        plan.run(x, dist.ReduceOp.SUM)
    finally:
        sys.setprofile(None)
    return events["call"], events["c_call"]


MODES = ("cpp", "records", "eager")
"""How the steady runs are issued (see the module docstring)."""


def per_run(world: int, fmt: str, feedback: bool, runs: int, profile: bool,
            mode: str = "cpp") -> tuple[float, tuple[int, int]]:
    """Microseconds per steady-state run of the plan (after 3 untimed), and its calls; ``mode``
    one of `MODES`."""
    import collections

    import torch.distributed as dist

    from lowbitcc import state
    from lowbitcc.backend import launch_record
    from lowbitcc.codec import cuda
    from lowbitcc.counters import Stats
    from lowbitcc.feedback import FeedbackStore
    from tests.support.cuda_trace import GpuWork, meta_plan

    cuda._launch = lambda name, device, grid, args: None
    cpp = mode == "cpp"
    launch_record.HANDLE = (lambda device, name: 1) if cpp else None
    launch_record.RECORDER = collections.deque(maxlen=0) if cpp else None  # drops each launch
    state.FEEDBACK, state.STATS = FeedbackStore(), Stats()
    plan, x, _ = meta_plan(GpuWork(), world, 1 << 20, fmt, feedback=feedback,
                           replay=mode != "eager", c10d=cpp)
    for _ in range(3):
        plan.run(x, dist.ReduceOp.SUM)
    profiler = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    for _ in range(runs):
        plan.run(x, dist.ReduceOp.SUM)
    if profiler is not None:
        profiler.disable()
    took = (time.perf_counter() - start) / runs * 1e6
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return took, calls_per_run(plan, x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--formats", nargs="+", default=["nvfp4", "mxfp4"])
    parser.add_argument("--feedback", action="store_true", help="an int8 error state too")
    parser.add_argument("--runs", type=int, default=3000)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds alternating the modes")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import lowbitcc
    from lowbitcc.backend import native

    print(f"lowbitcc from {Path(lowbitcc.__file__).parent}")
    modes = MODES if native.load() is not None else tuple(m for m in MODES if m != "cpp")
    if "cpp" not in modes:
        print("no C++ module (LOWBITCC_NATIVE_WORKS=0 or no compiler): no cpp rows")
    for fmt in args.formats:
        for world in args.worlds:
            for _ in range(args.rounds):
                for mode in modes:
                    us, (python, builtin) = per_run(world, fmt, args.feedback, args.runs,
                                                    args.profile, mode)
                    print(f"{fmt:6} world {world} {mode:>7}: "
                          f"{us:7.1f} us per planned run (host, no launch); {python} Python "
                          f"and {builtin} builtin calls")


if __name__ == "__main__":
    main()
