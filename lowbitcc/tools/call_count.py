"""Python calls per DDP gradient-bucket call: what one steady-state call costs in Python.

Local ranks (two; ``--np``) train a one-bucket model (``nn.Linear(512, 512)``: 262,656 fp32 elements, one
DDP bucket after its rebuild) over a group of the backend under test and over a gloo group in
the same processes. Each rank installs a profile function on every Python thread of the
process (``threading.setprofile`` before the groups are made, so that their worker, waiter and
completer threads carry it; ``sys.setprofile`` on the calling thread) and counts the ``call``
events (Python functions) and ``c_call`` events (builtins) during ``loss.backward()`` of the
steady steps. A bucket call's cost beyond gloo's is then the difference of the two counts per
step: gloo's own backward runs the same DDP Python (hooks, the reducer's callbacks).

Not counted: Python run by threads the interpreter did not start (gloo's own threads, which
complete futures and run callbacks added to gloo's futures, as ``exact.when_done`` adds).

Modes (`MODES`): ``compressed`` (the cost model off: every bucket call compressed),
``loco`` (so, with error feedback: LoCo on the default format), ``exact`` (the steps under
`lowbitcc.exact`: every bucket call runs its place's exact entry) and ``default`` (the settings
as they are: on loopback the cost model sends the call exact once it has timed both paths).
``lowbitcc calls`` prints the table (docs/host-time.md); ``--by-function`` also lists, per
mode, the Python functions one loco bucket call runs (per
step, by module and thread): where the calls go.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

from lowbitcc.tools import spawn

MODES = {
    "compressed": {"LOCO_COST_MODEL": "0"},
    "loco": {"LOCO_COST_MODEL": "0", "LOCO_FEEDBACK": "1"},
    "exact": {"LOCO_COST_MODEL": "0"},
    "default": {},
}
"""Each mode's environment for the ranks (`count_calls`)."""


class _Counter:
    """Counts profile events of every thread while `on`; with ``functions`` (a Counter), also
    each Python function called, as ``module.py:function [thread]``."""

    def __init__(self, functions: collections.Counter | None = None) -> None:
        self.on = False
        self.calls = 0
        self.builtins = 0
        self.functions = functions

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if self.on:
            if event == "call":
                self.calls += 1
                if self.functions is not None:
                    code = frame.f_code
                    thread = threading.current_thread().name.split("-")[-1]
                    self.functions[f"{os.path.basename(code.co_filename)}:{code.co_name} "
                                   f"[{thread}]"] += 1
            elif event == "c_call":
                self.builtins += 1

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        self.on = True
        try:
            yield
        finally:
            self.on = False


def _rank(rank: int, world: int, mode: str, warmup: int, steps: int,
          by_function: bool = False) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    import lowbitcc

    counter = _Counter()
    threading.setprofile(counter)  # every thread started from here on carries it
    sys.setprofile(counter)
    try:
        groups = {"gloo": dist.new_group(backend="gloo"), "loco": dist.new_group(backend="loco")}
        out: dict[str, Any] = {}
        for name, group in groups.items():
            counter.functions = collections.Counter() if by_function and name == "loco" else None
            torch.manual_seed(0)
            model = DistributedDataParallel(nn.Linear(512, 512), process_group=group)
            x = torch.randn(8, 512)
            block = lowbitcc.exact if (mode == "exact" and name == "loco") else (
                contextlib.nullcontext)
            calls = builtins = 0
            for step in range(warmup + steps):
                model.zero_grad(set_to_none=True)
                loss = model(x).square().mean()
                with block():
                    if step < warmup:
                        loss.backward()
                        continue
                    before = counter.calls, counter.builtins
                    with counter.counting():
                        loss.backward()
                    # the bucket's Work is complete once backward returns (DDP waits for it)
                calls += counter.calls - before[0]
                builtins += counter.builtins - before[1]
            out[name] = calls / steps
            out[f"{name} builtins"] = builtins / steps
            if counter.functions is not None:
                out["functions"] = {f: n / steps for f, n in counter.functions.items()}
            dist.barrier(group=group)
        return out
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def count_calls(mode: str = "compressed", warmup: int = 140, steps: int = 60,
                env: dict[str, str] | None = None, world: int = 2,
                by_function: bool = False) -> dict[str, Any]:
    """Python calls (``call`` events) and builtins per steady bucket call on rank 0, over gloo
    and over "loco" in ``mode`` (`MODES`), and loco's beyond gloo's (``extra``, ``extra
    builtins``): means over ``steps`` steps after ``warmup``; ``by_function``: also
    ``functions``, each function loco's steps called and its calls per step."""
    ranks = spawn.run_ranks(_rank, world, mode, warmup, steps, by_function, backend="gloo",
                            threads=1, env={**MODES[mode], **(env or {})}, timeout_s=600)
    out = dict(ranks[0])
    out["extra"] = out["loco"] - out["gloo"]
    out["extra builtins"] = out["loco builtins"] - out["gloo builtins"]
    return out


def add_arguments(parser: Any) -> None:
    """``lowbitcc calls``' arguments; the command prints one table row per mode."""
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES),
                        help="what the bucket calls do (default: every mode)")
    parser.add_argument("--warmup", type=int, default=140, help="steps before counting")
    parser.add_argument("--steps", type=int, default=60, help="steps counted")
    parser.add_argument("--np", type=int, default=2, help="local ranks (default 2)")
    parser.add_argument("--by-function", action="store_true",
                        help="also list the Python functions of one loco bucket call per mode")
    parser.set_defaults(func=command)


def command(args: Any) -> int:
    """Print the table of `count_calls` per mode (Markdown, as docs/host-time.md holds it)."""
    print("| mode | gloo calls | loco calls | extra calls | extra builtins |")
    print("|---|---|---|---|---|")
    listed = {}
    for mode in args.modes:
        r = count_calls(mode, args.warmup, args.steps, world=args.np,
                        by_function=args.by_function)
        print(f"| {mode} | {r['gloo']:.1f} | {r['loco']:.1f} | {r['extra']:.1f} | "
              f"{r['extra builtins']:.1f} |", flush=True)
        listed[mode] = r.get("functions", {})
    for mode, functions in listed.items() if args.by_function else ():
        print(f"\n{mode}: calls per step of the loco group's backward, by function")
        for name, n in sorted(functions.items(), key=lambda kv: (kv[0].split("[")[-1], kv[0])):
            print(f"{n:7.2f}  {name}")
    return 0
