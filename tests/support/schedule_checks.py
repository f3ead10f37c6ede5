"""Per-rank checks of every compressed schedule, shared by the gloo (spawned ranks) and MPI
(mpiexec) runs of tests/schedules/test_schedules.py.

``check_schedules(rank, world, gloo, transport)`` returns one dict per case; the test asserts
on them. ``python -m tests.support.schedule_checks TRANSPORT`` under mpiexec prints rank 0's cases as
JSON (every rank checks its own; any failure exits non-zero).
"""

from __future__ import annotations

import json
import math
import sys

import torch
import torch.distributed as dist

import lowbitcc
from lowbitcc.schedules import tree
from tests.support.numerics import codec_step, group_amax, identical_everywhere, rank_input

SCHEDULES = ("direct", "ring", "tree", "hierarchical")
NODE_SIZE = {2: 2, 3: 1, 4: 2, 5: 5}  # one node; one rank per node; 2 x 2; one node
EPS = {torch.float32: 2.0**-22, torch.bfloat16: 2.0**-7}
GROUP, Q = codec_step(lowbitcc.LocoConfig())  # the groups below use the default codes


def quantizations(schedule: str, collective: str, world: int) -> int:
    """Quantizations on an element's path (docs/algorithms.md)."""
    nodes = world // NODE_SIZE[world]
    two = collective == "all_reduce"
    # direct's all-reduce on two ranks (and hierarchical's over two nodes) is one all-gather
    return {
        "direct": 2 if two and world > 2 else 1,
        "ring": world if two else world - 1,
        "tree": tree.depth(world) + 1,
        "hierarchical": 0 if nodes == 1 else (2 if two and nodes > 2 else 1),
    }[schedule]


def bound_factor(hops: int) -> float:
    """Worst error over ``A`` after ``hops`` quantizations, each of at most half a step of the
    group max of a value that already carries the earlier errors: (1 + 1/2q)^hops - 1."""
    return (1 + 1 / (2 * Q)) ** hops - 1


def _group(schedule: str, transport: str, world: int, **changes) -> dist.ProcessGroup:
    cfg = lowbitcc.LocoConfig(schedule=schedule, transport=transport, node_size=NODE_SIZE[world],
                              policy="always", cost_model=False, min_size=1, chunk_size=4096,
                              max_chunks=0, **changes)
    return dist.new_group(backend="loco", pg_options=cfg)


def _all_reduce_cases(rank, world, gloo, schedule, group) -> list[dict]:
    hops = quantizations(schedule, "all_reduce", world)
    cases = []
    for size in (100_003, 1001):
        for dtype in (torch.float32, torch.bfloat16):
            for op, factor in ((dist.ReduceOp.SUM, 1.0), (dist.ReduceOp.AVG, 1.0 / world)):
                x = rank_input(rank, size, size, dtype)
                out = x.clone()
                with lowbitcc.feedback_key(f"ar-{size}-{dtype}-{op}"):
                    dist.all_reduce(out, op=op, group=group)
                ref = x.double() * factor
                dist.all_reduce(ref, group=gloo)
                amax = group_amax(x.double() * factor, world, GROUP)
                dist.all_reduce(amax, group=gloo)
                bound = amax * bound_factor(hops) * 1.001 + ref.abs() * EPS[dtype] + 1e-6
                err = (out.double() - ref).abs()
                cases.append({
                    "case": ("all_reduce", schedule, size, str(dtype), str(op)),
                    "identical": identical_everywhere(out, gloo),
                    "worst": float((err / bound).max()),
                    "rel": float((out.double() - ref).norm() / ref.norm()),
                })
    return cases


def _reduce_scatter_cases(rank, world, gloo, schedule, group) -> list[dict]:
    hops = quantizations(schedule, "reduce_scatter", world)
    cases = []
    for per_rank in (7001, 300):
        x = rank_input(rank, per_rank * world, per_rank)
        out = torch.empty(per_rank)
        with lowbitcc.feedback_key(f"rs-{per_rank}"):
            dist.reduce_scatter_single(out, x, group=group)
        full = x.double()
        dist.all_reduce(full, group=gloo)
        ref = full.view(world, -1)[rank]
        amax = group_amax(x.double(), world, GROUP)
        dist.all_reduce(amax, group=gloo)
        bound = amax.view(world, -1)[rank] * bound_factor(hops) * 1.001 + ref.abs() * EPS[
            torch.float32] + 1e-6
        err = (out.double() - ref).abs()
        cases.append({
            "case": ("reduce_scatter", schedule, per_rank),
            "identical": True,
            "worst": float((err / bound).max()),
            "rel": float((out.double() - ref).norm() / ref.norm()),
        })
    return cases


def _feedback_case(rank, world, gloo, schedule, transport) -> dict:
    """30 all-reduces of a slowly varying input: |cumsum(out) - cumsum(exact)| / |cumsum(exact)|
    with LoCo feedback and without; feedback must keep the gap several times smaller."""
    gaps = {}
    for name, changes in (("loco", {"feedback": True}), ("none", {"feedback": False})):
        group = _group(schedule, transport, world, **changes)
        n = 30_000
        base = rank_input(rank, n, 5)
        noise = torch.Generator().manual_seed(100 + rank)
        cum_out = torch.zeros(n, dtype=torch.float64)
        cum_ref = torch.zeros(n, dtype=torch.float64)
        for _ in range(30):
            x = base + 0.01 * torch.randn(n, generator=noise)
            ref = x.double()
            dist.all_reduce(ref, group=gloo)
            out = x.clone()
            with lowbitcc.feedback_key("track"):
                dist.all_reduce(out, group=group)
            cum_out += out.double()
            cum_ref += ref
        gaps[name] = float((cum_out - cum_ref).norm() / cum_ref.norm())
    exact = quantizations(schedule, "all_reduce", world) == 0
    return {"case": ("feedback", schedule), "identical": True, "worst": 0.0, "rel": 0.0,
            "gaps": gaps, "feedback_helps": exact or gaps["loco"] * 3 <= gaps["none"]}


def check_schedules(rank: int, world: int, gloo, transport: str) -> list[dict]:
    cases = []
    for schedule in SCHEDULES:
        group = _group(schedule, transport, world)
        links = group._compressed.route(torch.device("cpu")).links  # the LocoProcessGroup itself
        cases.append({"case": ("transport", schedule), "identical": True, "worst": 0.0,
                      "rel": 0.0, "transport": type(links.world.inner).__name__,
                      "transport_ok": type(links.world.inner).__name__.lower().startswith(transport)})
        cases += _all_reduce_cases(rank, world, gloo, schedule, group)
        cases += _reduce_scatter_cases(rank, world, gloo, schedule, group)
        cases.append(_feedback_case(rank, world, gloo, schedule, transport))
    return cases


def failures(cases: list[dict]) -> list[dict]:
    return [c for c in cases if not c["identical"] or c["worst"] > 1.0 or c["rel"] > 0.3
            or not c.get("feedback_helps", True) or not c.get("transport_ok", True)
            or math.isnan(c["worst"])]


if __name__ == "__main__":
    dist.init_process_group("loco")
    gloo = dist.new_group(backend="gloo")
    results = check_schedules(dist.get_rank(), dist.get_world_size(), gloo, sys.argv[1])
    bad = failures(results)
    if dist.get_rank() == 0 or bad:
        print(json.dumps({"rank": dist.get_rank(), "cases": len(results), "failures": bad}),
              flush=True)
    dist.destroy_process_group()
    sys.exit(1 if bad else 0)
