"""A group's data movements served in C++ (``backend/csrc/runner_moves.h``: ``_allgather_base``,
``allgather``, ``broadcast`` and ``alltoall_base`` of one tensor, ``send``, ``recv`` and
``recv_anysource``) against the Python path they stand in for
(`data_movement.DataMovements.exact`, on the group's worker). Each rank runs the same calls on
fresh "loco" groups: every call through Python (no runner), every call the runner can serve
served, the runner declining at random (half its calls, a different draw per rank, so the ranks'
paths differ call by call), and a device runner of "cpu" (the CPU test bed of a CUDA group's)
serving all it can or half. Between the data movements run compressed all-reduces (their
places' first runs on the worker, the steady ones by the plan core) and exact ones, so a data
movement meets the worker busy, where it must wait its turn. All must leave the same outputs
(gloo's), tags, call numbers, schedule index and statistics, and the runner must have served
most data movements; a served one runs no more Python calls than gloo's own."""

from __future__ import annotations

import datetime
import gc
import time

import pytest
import torch
import torch.distributed as dist

import lowbitcc
from lowbitcc.backend import native, steady_runner
from lowbitcc.tools import spawn
from lowbitcc.transports import gloo as gloo_transport
from tests.probes import movement_calls
from tests.support.device_runners import cpu_device_runner
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.skipif(native.load() is None, reason="the C++ module cannot be built here")

STEPS = 24
MOVES_PER_STEP = 10
"""The data movements `_moves` issues each step: two all-gathers into a tensor, an all-gather
into a list, two broadcasts, an all-to-all, two sends, a receive and a receive from any
source."""


def _moves(rank, world, gloo, variant, config):
    """One run of ``variant`` (see the module docstring) on a fresh group of ``config``: its
    outputs, what it leaves on the group and in the statistics, and its runner's served data
    movements."""
    lowbitcc.reset_stats()
    pg = dist.new_group(backend="loco", pg_options=config)
    runner = pg._runner
    if variant.startswith("device"):
        runner = cpu_device_runner(pg)
    if variant == "python":
        pg._runner = steady_runner.NoRunner()
    elif variant.endswith("mixed"):
        runner.decline_at_random(0.5, 1000 * world + rank)
    gen = torch.Generator().manual_seed(rank)
    outputs = []
    all_to_alls = points = 0  # (served: all-to-alls, point-to-point calls)
    for step in range(STEPS):
        x = torch.randn(1000 + step % 3, generator=gen)  # (three sizes: new places, then steady)
        out = torch.empty(world * x.numel())
        dist.all_gather_into_tensor(out, x, group=pg)
        outputs.append(out)
        with lowbitcc.compressed():  # a place's first runs queue their exchange on the worker
            g = torch.randn(4096 + step % 3, generator=gen)
            work = dist.all_reduce(g, group=pg, async_op=True)
        out2 = torch.empty(world * 7, dtype=torch.float64)
        gathered = dist.all_gather_into_tensor(
            out2, torch.full((7,), float(rank + step), dtype=torch.float64), group=pg,
            async_op=True)
        # a Python caller's future: the outputs (the device runner's test bed hands back gloo's
        # own Work, whose value is the output's pieces: NCCL's, as the CUDA Python path's, is not)
        value = gathered.get_future().wait()
        assert gathered.wait()
        work.wait()
        outputs += [out2, g, torch.cat(value)]
        parts = [torch.empty(5, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(parts, torch.arange(5) * (rank + 1) + step, group=pg)
        outputs += parts
        b = torch.full((33,), float(rank * 100 + step)) if rank == step % world else torch.zeros(33)
        dist.broadcast(b, src=step % world, group=pg)
        small = torch.full((8,), float(rank))
        dist.all_reduce(small, group=pg)  # exact: below min_size
        h = torch.randn(2048, generator=gen).to(torch.bfloat16)
        dist.broadcast(h, src=0, group=pg, async_op=True).wait()
        outputs += [b, small, h]
        # even steps: equal splits; odd ones: rank r sends 2r + j + 1 rows to rank j (a rank j=0
        # among them receives none where it is told to), as a mixture of experts' tokens
        sends = [2 * rank + j + 1 for j in range(world)] if step % 2 else None
        receives = [2 * j + rank + 1 for j in range(world)] if step % 2 else None
        sent = torch.randn(sum(sends) if sends else 2 * world, 3, generator=gen)
        received = torch.empty(sum(receives) if receives else 2 * world, 3)
        before = getattr(runner, "served_moves", 0)
        dist.all_to_all_single(received, sent, receives, sends, group=pg)
        all_to_alls += getattr(runner, "served_moves", 0) - before
        outputs.append(received)
        # a pipeline's stages: each rank sends to the next and receives from the one before
        # (tagged by step), then receives from any source what the one before sends
        after, before = (rank + 1) % world, (rank - 1) % world
        before_points = getattr(runner, "served_moves", 0)
        got = torch.empty(17)
        sending = dist.isend(torch.full((17,), float(rank * 10 + step)), after, group=pg,
                             tag=step)
        dist.irecv(got, before, group=pg, tag=step).wait()
        sending.wait()
        anywhere = torch.empty(3, dtype=torch.int64)
        sending = dist.isend(torch.arange(3) + rank + step, after, group=pg)
        source = dist.recv(anywhere, group=pg)
        sending.wait()
        points += getattr(runner, "served_moves", 0) - before_points
        outputs += [got, anywhere, torch.tensor(source)]
    state = {
        "tag": next(pg._queue._issued),
        "next_seq": pg._compressed.agreement.next_seq(),
        "index": pg._compressed.call_schedules["cpu"]._next,
        "stats": {cat: {k: v for k, v in lowbitcc.stats()[cat].items()
                        if k in ("calls", "tensor_bytes", "logical_bytes", "wire_bytes")}
                  for cat in ("exact", "compressed")},
    }
    return {"outputs": outputs, "state": state,
            "served": getattr(runner, "served_moves", 0), "all_to_alls": all_to_alls,
            "points": points}


def _runs(rank, world, gloo, config):
    runs = {v: _moves(rank, world, gloo, v, config)
            for v in ("python", "native", "mixed", "device", "device-mixed")}
    # the gloo group's own all-gather into a tensor, for the outputs' values
    x = torch.full((3,), float(rank))
    out = torch.empty(3 * world)
    dist.all_gather_into_tensor(out, x, group=gloo)
    return runs, out


@pytest.mark.parametrize(("world", "issuer"), [
    (2, "auto"),
    (3, "auto"),  # the all-reduce's two phases on the issue lane: a data movement waits its turn
    (2, "inline"),
])
def test_data_movements_served_in_cpp_and_by_python_at_random_leave_the_same_state(world, issuer):
    config = lowbitcc.LocoConfig(min_size=1024, issuer=issuer)
    for rank, (runs, gathered) in enumerate(run_ranks(_runs, world, config, timeout=300)):
        assert torch.equal(gathered, torch.arange(world).repeat_interleave(3).float())
        want = runs["python"]
        assert want["served"] == 0
        for variant in ("native", "mixed", "device", "device-mixed"):
            run = runs[variant]
            assert len(run["outputs"]) == len(want["outputs"])
            for i, (got, expected) in enumerate(zip(run["outputs"], want["outputs"])):
                assert torch.equal(got, expected), (rank, variant, i)
            state, expected = dict(run["state"]), dict(want["state"])
            if variant.startswith("device"):  # (a CUDA Work has no tag: nor has its test bed's)
                del state["tag"], expected["tag"]
            assert state == expected, (rank, variant)
        moves = STEPS * MOVES_PER_STEP
        # served: all but those that met the worker busy (a place's first runs, renewals)
        for whole, mixed in (("native", "mixed"), ("device", "device-mixed")):
            assert moves // 2 < runs[whole]["served"] <= moves, (rank, whole)
            assert STEPS // 2 < runs[whole]["all_to_alls"] <= STEPS, (rank, whole)
            assert 2 * STEPS < runs[whole]["points"] <= 4 * STEPS, (rank, whole)
            assert 0 < runs[mixed]["served"] < runs[whole]["served"], (rank, mixed)


def _point_to_point(rank, world, gloo):
    """Point-to-point Works, the Python path's (queued) and the runner's (served), as a caller
    sees them: a receive complete once its message is in, unwaited; its sender read before any
    wait; waited for twice; its future's value; a send's; a receive waited for with a bound
    before its message is sent, then without; a send whose Work is dropped at once."""
    seen = {}
    for way in ("python", "native"):
        pg = dist.new_group(backend="loco")
        if way == "python":
            pg._runner = steady_runner.NoRunner()
        after, before = (rank + 1) % world, (rank - 1) % world
        got = torch.empty(4)
        receiving = dist.irecv(got, before, group=pg, tag=7)
        sending = dist.isend(torch.arange(4.0) * (rank + 1), after, group=pg, tag=7)
        deadline = time.monotonic() + 30
        while not receiving.is_completed() and time.monotonic() < deadline:
            time.sleep(0.01)
        unwaited = receiving.is_completed()
        source = receiving._source_rank()
        waits = [receiving.wait(), receiving.wait(), sending.wait(), sending.wait()]
        value = [t.tolist() for t in receiving.get_future().wait()]
        late = torch.empty(2)
        receiving = dist.irecv(late, before, group=pg, tag=8)
        try:
            receiving.wait(timeout=datetime.timedelta(seconds=0.3))
            timed_out = False
        except dist.DistBackendError as exc:
            timed_out = "timed out" in str(exc)
        dist.barrier(group=gloo)  # (every rank's bounded wait over before any sends)
        sending = dist.isend(torch.full((2,), float(rank)), after, group=pg, tag=8)
        late_waits = [receiving.wait(), sending.wait()]
        dropped = torch.empty(3)
        receiving = dist.irecv(dropped, before, group=pg, tag=9)
        dist.isend(torch.arange(3.0) + rank, after, group=pg, tag=9)  # (its Work let go of)
        gc.collect()
        receiving.wait()
        seen[way] = {"unwaited": unwaited, "waits": waits, "completed": [
                         receiving.is_completed(), sending.is_completed()],
                     "value": value, "got": got.tolist(), "source": source,
                     "success": receiving.is_success() and sending.exception() is None,
                     "timed out": timed_out, "late": late.tolist(), "late waits": late_waits,
                     "dropped": dropped.tolist(),
                     "served": getattr(pg._runner, "served_moves", 0)}
    return seen


def test_a_served_point_to_point_call_is_waited_for_once_and_keeps_the_python_paths_work():
    """gloo's own receive waits for another message at each ``wait``, and completes only in a
    ``wait``: a served one is waited for once, by the runner's completer, and its Work reads as
    the Python path's."""
    for rank, seen in enumerate(run_ranks(_point_to_point, 3)):
        assert seen["native"]["served"] == 6 and seen["python"]["served"] == 0
        del seen["native"]["served"], seen["python"]["served"]
        assert seen["native"] == seen["python"], rank
        before = (rank - 1) % 3
        assert seen["native"]["unwaited"] and seen["native"]["timed out"]
        assert seen["native"]["got"] == [i * (before + 1) for i in range(4)]
        assert seen["native"]["value"] == [seen["native"]["got"]]
        assert seen["native"]["source"] == before
        assert seen["native"]["late"] == [float(before)] * 2
        assert seen["native"]["dropped"] == [before + i for i in range(3)]


def _kept(rank, world, gloo):
    """How many gloo Works the runner keeps: after ten served all-gathers, after four
    point-to-point exchanges (none kept), and after one more all-gather past `RETAIN_S`."""
    pg = dist.new_group(backend="loco")
    out, x = torch.empty(world * 64), torch.ones(64)
    for _ in range(10):
        dist.all_gather_into_tensor(out, x, group=pg)
    kept = [pg._runner.kept_works]
    for _ in range(4):
        sending = dist.isend(x, (rank + 1) % world, group=pg)
        dist.recv(torch.empty(64), (rank - 1) % world, group=pg)
        sending.wait()
    kept.append(pg._runner.kept_works)
    time.sleep(gloo_transport.RETAIN_S + 0.1)
    dist.all_gather_into_tensor(out, x, group=pg)
    return kept + [pg._runner.kept_works, pg._runner.served_moves]


def test_the_runner_keeps_its_served_calls_gloo_works_a_while():
    """As the Python path's transport (`GlooTransport.retire`): a served call's gloo Work is let
    go of by the calling thread once older than `RETAIN_S`, never while among the last
    `RETAIN_LAST` (``backend/csrc/retired_works.h``); a point-to-point call's is not kept."""
    for first, after_points, later, served in run_ranks(_kept, 2):
        assert served == 10 + 8 + 1
        assert gloo_transport.RETAIN_LAST <= first <= 10 and after_points == first
        assert later == gloo_transport.RETAIN_LAST + 1


def _not_served(rank, world, gloo):
    """Data movements the runner must leave to the Python path: under ``check_all`` (each
    exchanges a descriptor; a point-to-point call exchanges none, and is served), a
    ``param_bits`` all-gather, a non-contiguous output, sizes or peers gloo refuses; their
    served counts and what each call raised."""
    counts = {}
    pg = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(min_size=16, check_all=True))
    x, out = torch.ones(64), torch.empty(64 * world)
    dist.all_gather_into_tensor(out, x, group=pg)
    dist.broadcast(x, src=0, group=pg)
    counts["check_all"] = pg._runner.served_moves
    after, before = (rank + 1) % world, (rank - 1) % world
    sending = dist.isend(x, after, group=pg)
    dist.recv(torch.empty(64), before, group=pg)
    sending.wait()
    counts["check_all point to point"] = pg._runner.served_moves
    pg = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(min_size=16, param_bits=8))
    dist.all_gather_into_tensor(out, x, group=pg)
    counts["param_bits"] = pg._runner.served_moves
    dist.broadcast(x, src=0, group=pg)
    counts["param_bits broadcast"] = pg._runner.served_moves
    pg = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(min_size=16))
    parts = [torch.empty(64, 2)[:, 0] for _ in range(world)]  # (strided)
    dist.all_gather(parts, x, group=pg)
    counts["strided"] = pg._runner.served_moves
    raised = {}
    rows = torch.ones(4 * world, 2)
    calls = {  # (an all-gather's output gloo cuts into pieces of the wrong shape)
        "wrong size": lambda: dist.all_gather_into_tensor(torch.empty(64 * world + 1), x,
                                                          group=pg, async_op=True),
        "stacked": lambda: dist.all_gather_into_tensor(torch.empty(world, 64), x, group=pg,
                                                       async_op=True),
        # an all-to-all's splits: one too many; not the rows there are
        "splits of too many ranks": lambda: dist.all_to_all_single(
            torch.empty_like(rows), rows, [1] * (world + 1), [1] * (world + 1), group=pg,
            async_op=True),
        "splits of other rows": lambda: dist.all_to_all_single(
            torch.empty_like(rows), rows, [1] * world, [1] * world, group=pg, async_op=True),
        # a send to this rank itself; of a strided tensor (c10d's wrapper lets both through)
        "send to itself": lambda: pg.send([x], rank, 0),
        "strided send": lambda: pg.send([torch.ones(64, 2)[:, 0]], after, 0),
        "negative tag": lambda: pg.send([x], after, -1),
    }
    for case, call in calls.items():
        try:  # the Python path's error (gloo's, at the Work's wait; or torch's wrapper's)
            call().wait()
        except Exception as exc:  # noqa: BLE001 (whatever gloo raises)
            raised[case] = type(exc).__name__
        counts[case] = pg._runner.served_moves
    return counts, raised, torch.equal(torch.cat(parts), torch.ones(64 * world))


def test_data_movements_the_runner_cannot_serve_take_the_python_path():
    for counts, raised, gathered in run_ranks(_not_served, 2):
        assert counts == {"check_all": 0, "check_all point to point": 2, "param_bits": 0,
                          "param_bits broadcast": 1, "strided": 0, "wrong size": 0,
                          "stacked": 0, "splits of too many ranks": 0,
                          "splits of other rows": 0, "send to itself": 0, "strided send": 0,
                          "negative tag": 0}
        assert set(raised) == set(counts) - {"check_all", "check_all point to point",
                                             "param_bits", "param_bits broadcast",
                                             "strided"}, raised
        assert gathered


def test_a_served_data_movement_runs_no_more_python_than_gloo_does():
    """Python calls per served data movement on every thread (`tests/probes/movement_calls.py`'s
    count, 20 calls of each): gloo's own, and fewer than the Python path's."""
    for result in spawn.run_ranks(movement_calls._rank, 2, 20, 256, backend="gloo",
                                  timeout_s=120):
        for name in movement_calls.COLLECTIVES:
            loco, gloo = result[f"{name} loco"], result[f"{name} gloo"]
            assert loco["served"] == 20 * movement_calls.CALLS_PER_ISSUE.get(name, 1), (
                name, result)
            assert loco["calls"] <= gloo["calls"] < result[f"{name} python"]["calls"], (
                name, result)
