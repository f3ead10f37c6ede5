"""Leases (`lowbitcc.backend.leases`): the calls the cost model leased to the exact path are
decided in issue order, by the issuing thread where the worker has nothing undecided (then
issued at once on the group's direct gloo group, gloo's own Work returned) and by the worker
otherwise; every rank leases the same calls and the results are gloo's, bit for bit. Leases
are what the cost model grants without the call schedule (``LOCO_CALL_SCHEDULE=0``); under it,
a place's exact entry does their work, so these groups turn the schedule off."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import lowbitcc
from lowbitcc.backend.leases import Leases
from lowbitcc.backend.works import LocoWork
from lowbitcc.cost_model import CostModel
from tests.support.ranks import run_ranks

N = 70_000
CPU = CostModel.size_class("all_reduce", 4 * N)
OTHER = CostModel.size_class("all_reduce", 8 * N)
CUDA = CostModel.size_class("all_reduce", 4 * N, "cuda")


def test_a_lease_is_taken_at_issue_only_while_nothing_of_its_device_is_undecided():
    leases = Leases(CostModel())
    first = leases.begin(CPU)
    assert not first.leased  # no lease yet: the call goes to the worker, undecided
    blocked = leases.begin(OTHER)  # queued behind it, whatever its class
    assert not blocked.leased
    first.settle(3)  # rank 0 leased the next 3 calls of CPU's class
    assert not leases.begin(CPU).leased  # OTHER is still undecided: the worker decides
    assert leases.held() == 3
    blocked.settle()
    cuda = leases.begin(CUDA)  # device types are decided apart
    assert not cuda.leased
    cuda.settle()


def test_the_worker_takes_leases_in_issue_order_and_settling_twice_counts_once():
    model = CostModel()
    leases = Leases(model)
    exchanged = leases.begin(CPU)
    exchanged.settle(2)
    exchanged.settle(5)  # ignored
    now = leases.begin(CPU)
    assert now.leased and leases.held() == 1
    queued = leases.begin(CPU, now=False)
    assert not queued.leased and queued.take() and leases.held() == 0
    queued.settle()
    assert not leases.begin(CPU).leased  # the lease is used up
    assert [row["calls"] for row in model.table()] == [2]  # the two leased calls counted


def _leased_group(rank: int, exact_fast: dict) -> dist.ProcessGroup:
    """A loco group compressing every call, whose cost model has seen exact calls of each
    size (numel) in ``exact_fast`` far faster than compressed ones, or the opposite."""
    group = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(
        policy="always", cost_model=True, call_schedule=False))
    for numel, fast in exact_fast.items():
        for collective in ("all_reduce", "reduce_scatter"):
            cls = CostModel.size_class(collective, 4 * numel)
            for _ in range(3):
                group.cost_model.record(cls, True, 1e-9 if fast else 10.0, 4 * numel)
                group.cost_model.record(cls, False, 10.0 if fast else 1e-9, 4 * numel)
    return group


def _leased_calls_equal_gloo(rank, world, gloo):
    group = _leased_group(rank, {N * world: True})
    x = torch.randn(N * world, generator=torch.Generator().manual_seed(rank))
    kinds, equal = [], []
    first = 2 * group.cost_model.warmup + 1  # the warm-up's compressed and exact calls, the grant
    sum_, avg = dist.ReduceOp.SUM, dist.ReduceOp.AVG
    for op, calls in ((sum_, first), (avg, 5), (sum_, 5)):  # then 10 leased calls
        for _ in range(calls):
            y, expected = x.clone(), x.clone()
            work = dist.all_reduce(y, op=op, group=group, async_op=True)
            work.wait()
            dist.all_reduce(expected, op=op, group=gloo)
            kinds.append(isinstance(work, LocoWork))
            equal.append(torch.equal(y, expected))
    rs = []
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):  # gloo's flat reduce-scatter: no future
        expected = torch.empty(N)
        dist.reduce_scatter_single(expected, x, op=op, group=gloo)
        for _ in range(first + 2 if op == dist.ReduceOp.SUM else 9):  # 9: a timed one too
            out = torch.empty(N)
            work = dist.reduce_scatter_single(out, x, op=op, group=group, async_op=True)
            work.wait()
            rs.append(torch.equal(out, expected))
    return kinds[first:], equal[first:], rs[first:], lowbitcc.stats()["exact"]["model_exact"]


def test_leased_calls_are_issued_at_once_and_equal_gloo_bitwise():
    for kinds, equal, rs, leased in run_ranks(_leased_calls_equal_gloo, 2):
        assert kinds == [False] * 10  # issued at once: gloo's or a future's Work, not queued
        assert all(equal) and all(rs) and len(rs) == 11 and leased >= 20


def _one_rank_lags(rank, world, gloo):
    """Compressed calls of one class (an exchange each) alternate with leased calls of another,
    all async; rank 1's worker is held up now and then, so that the ranks decide the leased
    calls in different places (issuing thread or worker)."""
    group = _leased_group(rank, {N: True, 2 * N: False})
    gen = torch.Generator().manual_seed(rank)
    leased_in, compressed_in = torch.randn(N, generator=gen), torch.randn(2 * N, generator=gen)
    for _ in range(4):  # warm both classes up
        dist.all_reduce(leased_in.clone(), group=group)
        dist.all_reduce(compressed_in.clone(), group=group)
    queued, pending = [], []
    for i in range(24):
        if rank == 1 and i % 3 == 0:
            group._queue.submit(lambda: time.sleep(0.02) or [])
        c, y = compressed_in.clone(), leased_in.clone()
        pending.append((dist.all_reduce(c, group=group, async_op=True), c, y))
        if rank == 0 and i % 2:
            pending[-1][0].wait()  # rank 0 then decides at issue, rank 1 mostly not
        work = dist.all_reduce(y, group=group, async_op=True)
        queued.append(isinstance(work, LocoWork))
        pending[-1] += (work,)
    expected = leased_in.clone()
    dist.all_reduce(expected, group=gloo)
    equal, compressed = [], []
    for cwork, c, y, ywork in pending:
        cwork.wait()
        ywork.wait()
        equal.append(torch.equal(y, expected))
        gathered = [torch.empty_like(c) for _ in range(world)]
        dist.all_gather(gathered, c, group=gloo)
        compressed.append(all(torch.equal(g, gathered[0]) for g in gathered))
    return queued, equal, compressed


def test_lease_decisions_agree_when_one_ranks_worker_lags():
    results = run_ranks(_one_rank_lags, 2)
    for _, equal, compressed in results:
        assert all(equal) and all(compressed)
    queued = [r[0] for r in results]
    assert any(map(any, queued))  # some leased calls were decided on a worker
    assert not all(map(all, queued))  # and some at issue


def _leased_call_statistics(rank, world, gloo):
    """The exact statistics of leased all-reduces: SUMs (issued by the process group's
    shortest path, `_leased_at_issue`) and AVGs (through `_reduce`), each counted once."""
    group = _leased_group(rank, {N: True})
    x = torch.randn(N)
    for _ in range(2 * group.cost_model.warmup + 1):  # the warm-up, the lease granted
        dist.all_reduce(x.clone(), group=group)
    held = group._compressed.leases.held()
    lowbitcc.reset_stats()
    for op in [dist.ReduceOp.SUM] * 5 + [dist.ReduceOp.AVG] * 3:
        dist.all_reduce(x.clone(), op=op, group=group)
    return held, lowbitcc.stats()


@pytest.mark.parametrize("world", [2, 3])
def test_leased_calls_count_their_ring_volume_once(world):
    ring = 2 * (world - 1) / world * 4 * N  # bytes one rank sends in a ring all-reduce
    for held, stats in run_ranks(_leased_call_statistics, world):
        assert held >= 8
        exact, total = stats["exact"], stats["total"]
        assert exact["calls"] == 8 and exact["model_exact"] == 8, exact
        assert exact["tensor_bytes"] == 8 * 4 * N
        assert exact["logical_bytes"] == exact["wire_bytes"] == 8 * round(ring), exact
        assert stats["compressed"]["calls"] == 0 and total["ratio"] == 1.0, stats
