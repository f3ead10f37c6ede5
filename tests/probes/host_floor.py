"""The least host time a compressed all-reduce can have through a Python process group on this
machine: `lowbitcc perf`'s ``host_us`` of "loco"'s planned call beside a floor that does the
same work with none of lowbitcc's Python (against the goal of <= 150 us per call under
``LOCO_ISSUER=inline``). It measures the Python plan path: the C++ module is off
(``LOWBITCC_NATIVE_WORKS=0``), since a plan's C++ core (`lowbitcc.backend.plan_cores`) calls
none of the Python methods this probe records and replays; `lowbitcc perf` times the core.

Feeds docs/host-time.md (the floor, and the
floor/loco shares of the one steady-state call); tests/tools/test_host_floor.py runs it
(``-m slow``).

Each rank runs ``--calls`` forced all-reduces of ``--elements`` fp32 elements (one training
step each, as `lowbitcc perf` times them) on a "loco" group, ``LOCO_ISSUER=inline``, in rounds
that alternate two ways of running the group's ``allreduce``:

- **loco**: the group's own method (the place's `call_plan.CallPlan`);
- **floor**: the same C++ kernel calls and gloo transfer, with the arguments the plan passed
  them (recorded from one of its runs: `CpuKernels`' ``encode``, ``frame``, ``verify`` and
  ``decode_sum`` and the transport's ``_allgather_base``, replayed as they were, the call
  number included), then a completed `DoneWork` made: c10d's dispatch into a Python process
  group, its Work and the codec's and gloo's own calls, nothing else.

Host time per call is the call's wall time less its codec time (the kernel calls) and wire time
(starting the transfer and waiting for it), as `lowbitcc perf` counts it; the floor times its
kernel calls and transfer the same way around the bare calls. Printed per rank and way: the
median and mean host time per call over every round, and the floor's share of loco's.

    python tests/probes/host_floor.py [--calls 600] [--rounds 4]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from typing import Any

WAYS = ("loco", "floor")


class _Recorder:
    """Wraps the kernel and transfer calls of one planned run, keeping each call's arguments."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def wrap(self, owner: Any, name: str) -> Any:
        original = getattr(owner, name)

        def recorded(*args: Any) -> Any:
            self.calls.append((name, args))
            return original(*args)

        setattr(owner, name, recorded)
        return original


def _floor(calls: list[tuple[str, tuple]], module: Any, gloo: Any, done: Any,
           busy: list[float]) -> Any:
    """An ``allreduce`` that replays ``calls`` (`_Recorder`'s: the C++ ``module``'s functions
    and ``gloo``'s transfer) on the call's tensor, adding its codec and wire time to ``busy``."""
    (_, (encode_args,)), *rest = calls
    clock = time.perf_counter

    def allreduce(self: Any, tensors: list[Any], opts: Any = None) -> Any:
        tensor = tensors[0]
        encode_args.source = tensor.view(-1)
        codec = wire = 0.0
        start = clock()
        module.encode(encode_args)
        codec += clock() - start
        work = None
        for name, args in rest:
            start = clock()
            if name == "_allgather_base":
                work = gloo._allgather_base(*args)
                wire += clock() - start
            elif name == "wait":
                work.wait()
                wire += clock() - start
            else:
                result = getattr(module, name)(*args)
                codec += clock() - start
                if name == "verify" and result < 0:  # the replayed call is a correct one
                    raise RuntimeError("host_floor: a replayed message fails its check")
        busy[0] += codec + wire
        return done(0, tensors)

    return allreduce


def probe(rank: int, world: int, elements: int, calls: int, rounds: int) -> dict[str, list[float]]:
    """Each way's host time per call (us), ``rounds`` alternated rounds of ``calls``."""
    import torch
    import torch.distributed as dist

    import lowbitcc
    from lowbitcc.backend.eager import _EAGER
    from lowbitcc.backend.works import DoneWork
    from lowbitcc.codec import cpu
    from lowbitcc.transports import gloo as gloo_transport

    module = cpu.load()
    x = torch.randn(elements, generator=torch.Generator().manual_seed(rank))
    start_values = x.clone()

    def step() -> None:
        with lowbitcc.compressed(), lowbitcc.feedback_key("host_floor"):
            dist.all_reduce(x, op=dist.ReduceOp.AVG)
        lowbitcc.end_step()

    for _ in range(100):  # the place's plan made, its agreement renewed
        step()
    recorder = _Recorder()
    originals = {name: recorder.wrap(module, name) for name in ("encode", "frame", "verify",
                                                                  "decode_sum")}
    gloo = None
    original_all_gather = gloo_transport.GlooTransport.all_gather_async

    def seen(transport: Any, send: Any, out: Any = None) -> Any:
        nonlocal gloo
        gloo = transport.group
        pending = original_all_gather(transport, send, out)
        recorder.calls.append(("_allgather_base", (pending.recv.view(-1), send.reshape(-1),
                                                   torch._C._distributed_c10d.AllgatherOptions())))
        recorder.calls.append(("wait", ()))
        return pending

    gloo_transport.GlooTransport.all_gather_async = seen
    try:
        step()
    finally:
        gloo_transport.GlooTransport.all_gather_async = original_all_gather
        for name, original in originals.items():
            setattr(module, name, original)
    names = [name for name, _ in recorder.calls]
    if names != ["encode", "frame", "_allgather_base", "wait", "verify", "decode_sum", "verify",
                 "decode_sum"]:
        raise SystemExit(f"host_floor: rank {rank}: a planned call made {names}, not the "
                         "two-rank plan's calls this floor replays")
    busy = [0.0]
    floor = _floor(recorder.calls, module, gloo, DoneWork, busy)
    if _EAGER is not None:  # outside torch.compile's frame evaluation, as the group's methods
        floor = _EAGER(floor)
    group = dist.group.WORLD
    own = group.__dict__.get("allreduce")  # the group's C++ method (`steady_runner.install`)

    def use(method: Any) -> None:
        if method is None:
            group.__dict__.pop("allreduce", None)  # the class's
        else:
            group.allreduce = method

    def stats_busy() -> float:
        s = lowbitcc.stats()["compressed"]
        return s["codec_s"] + s["wire_s"]

    hosts: dict[str, list[float]] = {way: [] for way in WAYS}
    for r in range(rounds):
        for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
            use(own if way == "loco" else functools.partial(floor, group))
            try:
                for i in range(calls):
                    if i % 50 == 0:  # AVG keeps values finite; a fresh start keeps them varied
                        x.copy_(start_values)
                    before = stats_busy() + busy[0]
                    with lowbitcc.compressed(), lowbitcc.feedback_key("host_floor"):
                        t0 = time.perf_counter()
                        dist.all_reduce(x, op=dist.ReduceOp.AVG)
                        t1 = time.perf_counter()
                    lowbitcc.end_step()
                    hosts[way].append((t1 - t0 - (stats_busy() + busy[0] - before)) * 1e6)
            finally:
                use(own)
            dist.barrier()
    return hosts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 18, help="fp32 elements (1 MiB)")
    parser.add_argument("--calls", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    os.environ["LOCO_ISSUER"] = "inline"
    os.environ["LOWBITCC_NATIVE_WORKS"] = "0"  # the Python plan path (module docstring)
    from lowbitcc.tools import spawn

    results = spawn.run_ranks(probe, 2, args.elements, args.calls, args.rounds, backend="loco")
    for rank, hosts in enumerate(results):
        medians = {way: statistics.median(hosts[way]) for way in WAYS}
        means = {way: statistics.mean(hosts[way]) for way in WAYS}
        print(f"rank {rank}: host per call, {args.rounds} rounds of {args.calls} (us): "
              + ", ".join(f"{way} median {medians[way]:.1f} mean {means[way]:.1f}"
                          for way in WAYS)
              + f"; floor/loco medians {medians['floor'] / medians['loco']:.2f}")


if __name__ == "__main__":
    main()
