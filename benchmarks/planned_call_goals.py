"""The per-call goals of a steady-state compressed all-reduce on a GPU, 2 ranks sharing it: one
PASS/FAIL line per goal, the steady call (a place's plan) against the exact call (loco's, which
is the inner NCCL all-reduce) and NCCL's own (a plain "nccl" group; "gloo" on CPU) measured in
the same run.

Runs as the ``goals`` phase of `benchmarks/gpu_suite.sh` (with ``--graphs``, in the ``graphs``
phase), which docs/gpu.md's "Running the GPU suite" describes; its lines feed "What has run on
which GPU" there and the records of runs under docs/gpu/.

Per rank and size (fp32, default 64 Ki, 1 Mi and 16 Mi elements), steady-state compressed
all-reduces (``lowbitcc.compressed()``, op AVG so that repeated in-place calls stay finite,
past the call schedule's learning; the place's re-agreement every 64 runs included, as in
training): the host time per call (its enqueueing, each call issued to an idle GPU:
``torch.cuda.synchronize`` before each, outside its window; back to back, two ranks sharing a GPU
over NCCL's sockets wait on the transfers' throughput instead, which ``time us`` shows),
and, for the planned run itself (the calls that exchanged a descriptor left out: the place's
re-agreement runs its job, one call in 64), over ``--profiled`` calls with torch.profiler
(CUPTI) the GPU work lowbitcc launched per call (kernels and memsets whose names do not start
with ``nccl``) and the host-to-device copies per call, and per call the caching allocator's
allocations (``torch.cuda.memory_stats()["allocation.all.allocated"]``), the most of any
call. The goals (`GOALS`, lines ``goal-<name>``): host <= 100 us at every size, <= 3 launches,
0 uploads, 0 allocations. Timings of two ranks sharing one GPU over NCCL's socket transport say
little about a real node; the counts hold anywhere. A ``records-host`` line compares the plan's
host records with the same plan run eagerly, a ``cpp-replay-host`` line the records issued by
their C++ replay with the same records issued in Python, an ``nccl-host`` line the plan's host
time with NCCL's own (goal at most 2x, aim 1.2x) (``graphs-host`` likewise graph replay, with
``--graphs``). ``--device cpu`` runs the same calls on CPU tensors (``LOCO_ISSUER=inline`` for
the plans): a check of this script without a GPU (tests/tools/test_planned_call_goals.py), its
GPU columns empty and its goal lines SKIP.

    python benchmarks/planned_call_goals.py [--sizes 65536 1048576 16777216] [--iters 100]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import pstats
import time
from collections.abc import Iterator
from typing import Any

PATHS = ("plan", "python", "eager", "exact", "nccl")
"""The plan (host records, the default: `launch_record`, issued by its C++ replay), the plan
whose records are issued step by step in Python (its places' C++ replays off, another group's),
the plan making its arguments anew every run (its places' records off, another group's), the
exact call, NCCL's own."""
PROFILED = ("plan", "exact", "nccl")
"""The paths whose host time ``--host-profile`` breaks down (rank 0, the largest size)."""
GOALS = {"host_us": 100.0, "launches": 3.0, "uploads": 0.0, "allocations": 0.0}
"""The most each steady-state compressed all-reduce may take (docs/gpu.md)."""


def _gpu_work(prof: Any) -> dict[str, int]:
    """lowbitcc's kernels and memsets (not NCCL's) and the host-to-device copies the GPU ran
    (`cuda_launches.device_events`' names)."""
    from cuda_launches import device_events  # the sibling script's counters

    counts = {"launches": 0, "uploads": 0}
    for name, count in device_events(prof)[1].items():
        name = name.lower()
        if "memcpy" in name:
            counts["uploads"] += count * ("htod" in name)
        elif not name.startswith("nccl"):
            counts["launches"] += count
    return counts


def _exchanges() -> list[int]:
    """This process's descriptor exchanges so far, one entry each (`cuda_launches.agreements`:
    counted from this process's first call on)."""
    from cuda_launches import agreements  # the sibling script's counter

    return agreements()


def _allocated(device: Any) -> float:
    import torch

    if device.type != "cuda":
        return float("nan")
    return torch.cuda.memory_stats(device)["allocation.all.allocated"]


def _host_profile(call, sync, calls: int) -> str:
    """cProfile of ``calls`` calls, each issued to an idle GPU (``sync`` outside the profile):
    the functions by their own time, the 30 costliest."""
    prof = cProfile.Profile()
    for _ in range(calls):
        sync()
        prof.enable()
        call()
        prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    return text.getvalue()


def _path(x: Any, group: Any, mode: Any, iters: int, profiled: int,
          host_profile: int = 0) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import lowbitcc

    agreed = _exchanges()

    def call() -> None:
        with mode():
            dist.all_reduce(x, op=dist.ReduceOp.AVG, group=group)
        lowbitcc.end_step()

    cuda = x.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(70):
        call()
    sync()
    exchanges = len(agreed)
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    sync()
    elapsed = (time.perf_counter() - t0) / iters * 1e6
    host = 0.0
    for _ in range(iters):  # each call issued to an idle GPU: its own enqueueing, no back-pressure
        sync()
        begun = time.perf_counter()
        call()
        host += time.perf_counter() - begun
    host = host / iters * 1e6
    sync()
    allocations = 0.0
    for _ in range(iters):  # per call, outside the timed loop: reading the counter costs
        before, seen = _allocated(x.device), len(agreed)
        call()
        if len(agreed) == seen:
            allocations = max(allocations, _allocated(x.device) - before)
    row: dict[str, Any] = {"host_us": host, "time_us": elapsed, "allocations": allocations,
                           "exchanges": (len(agreed) - exchanges) / (3 * iters),
                           "launches": float("nan"), "uploads": float("nan")}
    if cuda:
        for _ in range(3):  # a window without a re-agreement
            seen = len(agreed)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(profiled):
                    call()
                sync()
            if len(agreed) == seen:
                break
        row.update({k: v / profiled for k, v in _gpu_work(prof).items()})
    if host_profile:
        row["profile"] = _host_profile(call, sync, host_profile)
    return row


@contextlib.contextmanager
def _eager_plans() -> Iterator[None]:
    """Around a whole path: the places made inside never replay (every run eager)."""
    from lowbitcc.backend import place_graph

    of = place_graph.PlaceGraph.of
    place_graph.PlaceGraph.of = staticmethod(lambda plan: None)
    try:
        yield
    finally:
        place_graph.PlaceGraph.of = of


@contextlib.contextmanager
def _python_replays() -> Iterator[None]:
    """Around a whole path: the host records made inside are issued in Python (no C++
    ``LaunchReplay``)."""
    from lowbitcc.backend import launch_record

    made = launch_record.native_replay
    launch_record.native_replay = lambda steps, device: (None, [])
    try:
        yield
    finally:
        launch_record.native_replay = made


SETTINGS = {"eager": _eager_plans, "python": _python_replays}
"""What a path's calls run inside, entered once around the path (not per call: its cost stays
out of the timed calls)."""


def _native_records() -> int:
    """Host records of this process so far whose C++ replay was made (`launch_record`)."""
    from lowbitcc.backend import launch_record

    return sum(r._native is not None for r in gc.get_objects()
               if isinstance(r, launch_record.LaunchRecord))


def _replays() -> int:
    """Graph launches of every place of this process so far (`place_graph.PlaceGraph`)."""
    from lowbitcc.backend import place_graph

    return sum(p.replays for p in gc.get_objects() if isinstance(p, place_graph.PlaceGraph))


def _rank(rank: int, world: int, sizes: list[int], iters: int, profiled: int,
          device_type: str, graphs: bool, host_profile: int) -> dict:
    import torch
    import torch.distributed as dist

    import lowbitcc
    from lowbitcc.tools import spawn

    _exchanges()  # counted from here on
    device = spawn.gpu_device(rank) if device_type == "cuda" else torch.device("cpu")
    config = lowbitcc.LocoConfig.from_env().replace(min_size=1, cost_model=False)
    groups = {"plan": dist.new_group(backend="loco", pg_options=config),
              "python": dist.new_group(backend="loco", pg_options=config),
              "eager": dist.new_group(backend="loco", pg_options=config)}
    groups["exact"] = groups["plan"]
    groups["nccl"] = dist.new_group(backend="nccl" if device.type == "cuda" else "gloo")
    modes = {"plan": lowbitcc.compressed, "python": lowbitcc.compressed,
             "eager": lowbitcc.compressed, "exact": lowbitcc.exact,
             "nccl": contextlib.nullcontext, "graph": lowbitcc.compressed}
    paths = PATHS
    if graphs:
        groups["graph"] = dist.new_group(backend="loco", pg_options=config.replace(
            call_graphs=True))
        paths = (*PATHS, "graph")
    rows = {}
    for numel in sizes:
        x = torch.randn(numel, device=device)
        for path in paths:
            replays = _replays() if path in ("graph", "plan", "python") else 0
            natives = _native_records()
            # every rank issues the profiled calls (collectives); rank 0's profile is printed
            profile = host_profile if numel == sizes[-1] and path in PROFILED else 0
            with SETTINGS.get(path, contextlib.nullcontext)():
                row = rows[f"{numel} {path}"] = _path(x, groups[path], modes[path], iters,
                                                      profiled, profile)
            row["native_records"] = _native_records() - natives
            if path in ("graph", "plan", "python"):
                row["replays"] = _replays() - replays
            if rank == 0:  # as it comes: a run cut by its time limit keeps what it measured
                print(f"rank 0 {numel} {path}: host {row['host_us']:.1f} us, time "
                      f"{row['time_us']:.1f} us, launches {row['launches']}, uploads "
                      f"{row['uploads']}, allocations {row['allocations']}", flush=True)
    return {"format": config.wire_format, "feedback": config.wire_feedback, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1 << 16, 1 << 20, 1 << 24])
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--profiled", type=int, default=10)
    parser.add_argument("--np", type=int, default=2, help="ranks (sharing the GPU, default 2)")
    parser.add_argument("--json", help="write every rank's rows here")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--host-profile", type=int, default=0, metavar="CALLS",
                        help="cProfile this many calls of each of PROFILED (rank 0, largest size)")
    parser.add_argument("--graphs", action="store_true",
                        help="also the place's graph replay (call_graphs), after the others")
    opts = parser.parse_args()
    import torch

    from lowbitcc.tools import spawn

    cuda = opts.device == "cuda"
    env = spawn.gpu_rank_env(opts.np, torch.cuda.device_count()) if cuda else None
    ranks = spawn.run_ranks(_rank, opts.np, opts.sizes, opts.iters, opts.profiled, opts.device,
                            opts.graphs, opts.host_profile, rank_env=env, timeout_s=600,
                            env=None if cuda else {"LOCO_ISSUER": "inline"})
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(ranks, f, indent=1)
    print(f"{torch.cuda.get_device_name(0) if cuda else 'CPU'}, {opts.np} ranks, {ranks[0]['format']} "
          f"(feedback {ranks[0]['feedback']}); per call, the slowest rank")
    print(f"{'elements':>10} {'path':>6} {'host us':>9} {'time us':>9} {'launches':>9} "
          f"{'uploads':>8} {'allocs':>7} {'exch.':>6}")
    worst: dict[str, float] = dict.fromkeys(GOALS, 0.0)
    for key in ranks[0]["rows"]:
        row = {k: max(r["rows"][key][k] for r in ranks) for k in (*GOALS, "time_us", "exchanges")}
        numel, path = key.split()
        print(f"{numel:>10} {path:>6} {row['host_us']:>9.1f} {row['time_us']:>9.1f} {row['launches']:>9.1f} "
              f"{row['uploads']:>8.1f} {row['allocations']:>7.2f} {row['exchanges']:>6.3f}")
        if path == "plan":
            worst = {k: max(worst[k], row[k]) for k in GOALS}
    for key, row in ranks[0]["rows"].items():
        if "profile" in row:
            print(f"--- host profile, rank 0, {key}:\n{row['profile']}")
    for goal, limit in GOALS.items():
        if not cuda:
            print(f"SKIP goal-{goal} (CPU tensors: the goals are a GPU's)")
            continue
        verdict = "PASS" if worst[goal] <= limit else "FAIL"
        print(f"{verdict} goal-{goal} {worst[goal]:.2f} (at most {limit:g}, planned "
              "compressed all-reduce, worst size and rank)")
    _against(ranks, opts.sizes, "plan", "eager", "records-host", cuda,
             "the plan's host records' host time per call over the eager plan's")
    _against_nccl(ranks, opts.sizes, cuda)
    natives = [[r["rows"][f"{n} {p}"]["native_records"] for p in ("plan", "python")
                for n in opts.sizes] for r in ranks]
    print(f"host records with a C++ replay made per rank (plan, then python, per size): "
          f"{natives}")
    issued = all(r["rows"][f"{n} plan"]["native_records"] > 0
                 and r["rows"][f"{n} python"]["native_records"] == 0
                 for r in ranks for n in opts.sizes)
    _against(ranks, opts.sizes, "plan", "python", "cpp-replay-host", cuda,
             "host records issued by C++ over the same records issued in Python, host time",
             also=issued)
    if opts.graphs:  # graph replay against the eager plan, host time, the worst size
        _against(ranks, opts.sizes, "graph", "eager", "graphs-host", cuda,
                 "graph replay's host time per call over the eager plan's")


NCCL_HOST_GOAL, NCCL_HOST_AIM = 2.0, 1.2
"""The most a steady compressed call's host time may be over a plain NCCL group's all-reduce of
the same tensor in the same run (the worst size and rank), and what it aims at."""


def _against_nccl(ranks: list[dict], sizes: list[int], cuda: bool) -> None:
    """PASS/FAIL ``nccl-host``: the planned call's host time over NCCL's own, at most
    `NCCL_HOST_GOAL` (worst size and rank)."""
    ratio = max(max(r["rows"][f"{n} plan"]["host_us"] for r in ranks)
                / max(r["rows"][f"{n} nccl"]["host_us"] for r in ranks) for n in sizes)
    verdict = "SKIP" if not cuda else "PASS" if ratio <= NCCL_HOST_GOAL else "FAIL"
    print(f"{verdict} nccl-host {ratio:.3f} (the planned compressed call's host time over a plain "
          f"NCCL group's all-reduce, worst size; goal <= {NCCL_HOST_GOAL:g}, aim <= "
          f"{NCCL_HOST_AIM:g})")


def _against(ranks: list[dict], sizes: list[int], path: str, base: str, name: str, cuda: bool,
             what: str, also: bool = True) -> None:
    """PASS/FAIL ``name``: ``path``'s host time per call over ``base``'s (the worst size and
    rank), PASS where below 1, every rank replayed at every size on ``path`` (and on ``base``
    where it replays records: "python") and ``also`` holds."""
    ratio = max(max(r["rows"][f"{n} {path}"]["host_us"] for r in ranks)
                / max(r["rows"][f"{n} {base}"]["host_us"] for r in ranks) for n in sizes)
    replaying = [path, base] if base == "python" else [path]
    launches = [[r["rows"][f"{n} {p}"]["replays"] for p in replaying for n in sizes]
                for r in ranks]
    replayed = all(count > 0 for per_rank in launches for count in per_rank)
    print(f"{' and '.join(replaying)} replays per rank and size: {launches}")
    verdict = "SKIP" if not cuda else "PASS" if ratio < 1 and replayed and also else "FAIL"
    print(f"{verdict} {name} {ratio:.3f} ({what}, worst size)")


if __name__ == "__main__":
    main()
