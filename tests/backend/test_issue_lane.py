"""The issue lane (``backend/csrc/issue_lane.h``): a steady compressed call whose plan core runs
whole (the tree's, the ring's, the hierarchical's, an all-reduce's two phases on more than two
ranks) returns to its
caller once queued, and its run goes on on the group's lane thread, so that the caller (DDP's
backward) computes while it travels, as it does beside a gloo call. Its outputs, statistics and
error states are the Python path's: `test_steady_runner`'s mixed runs compare them; here, that the
caller is free before its peers have even issued theirs, and what waits for the lane."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

import lowbitcc
from lowbitcc.backend import native
from tests.support.ranks import run_ranks, run_script_ranks

pytestmark = pytest.mark.skipif(native.load() is None, reason="the C++ module cannot be built here")

N = 6000
"""Elements of the calls: above ``min_size``, a few groups per rank's row."""


def _returns_before_peers_issue(rank, world, gloo, schedule, feedback):
    store = dist.distributed_c10d._get_default_store()
    config = lowbitcc.LocoConfig(min_size=2, cost_model=False, schedule=schedule,
                                 feedback=feedback)
    pg = dist.new_group(backend="loco", pg_options=config,
                        timeout=datetime.timedelta(seconds=30))
    runner = pg._runner

    def call(value, async_op=False):
        tensor = torch.full((N,), value)
        with lowbitcc.compressed():  # (outside backward the default sends it exact)
            work = dist.all_reduce(tensor, group=pg, async_op=async_op)
        lowbitcc.end_step()
        return tensor, work

    for _ in range(12):  # the place agreed and steady
        call(float(rank + 1))
    before = runner.served_compressed
    # rank 0 calls first; the others call only once rank 0's call has returned to it
    if rank == 0:
        tensor, work = call(float(rank + 1), async_op=True)
        completed_at_return = work.is_completed()
        store.set(f"returned-{schedule}-{feedback}", "1")
    else:
        store.wait([f"returned-{schedule}-{feedback}"], datetime.timedelta(seconds=60))
        tensor, work = call(float(rank + 1), async_op=True)
        completed_at_return = None
    work.wait()
    served = runner.served_compressed - before
    after = [call(float(rank + 1))[0] for _ in range(4)]  # the place goes on
    return completed_at_return, served, tensor, after[-1]


@pytest.mark.parametrize(("schedule", "feedback"), [
    ("direct", False),  # three ranks: the all-reduce's two phases
    ("tree", False),
    ("ring", False),
    ("direct", True),   # with error feedback: its states taken and put back on the lane
])
def test_a_whole_run_returns_to_its_caller_before_its_peers_issue_theirs(schedule, feedback):
    """Rank 0's served call returns with its Work not yet complete although ranks 1 and 2 issue
    theirs only after it returned (before the lane, the run was the caller's: it waited in its
    first transfer for peers that waited for it, until the group's timeout); every rank then
    ends with the same sums, served on every rank."""
    results = run_ranks(_returns_before_peers_issue, 3, schedule, feedback, timeout=180)
    assert results[0][0] is False, "rank 0's Work was complete when its call returned"
    assert [served for _, served, _, _ in results] == [1, 1, 1]
    want = torch.full((N,), 6.0)
    for _, _, tensor, after in results:
        assert torch.equal(tensor, results[0][2]) and torch.equal(after, results[0][3])
        # (two quantizations, each up to 1/8 off where a group's block scale rounds up)
        assert torch.allclose(tensor, want, rtol=0.15)


def _shut_down_with_a_run_queued(rank, world, gloo):
    store = dist.distributed_c10d._get_default_store()
    config = lowbitcc.LocoConfig(min_size=2, cost_model=False, schedule="tree")
    pg = dist.new_group(backend="loco", pg_options=config,
                        timeout=datetime.timedelta(seconds=5))
    for _ in range(12):  # the place agreed and steady
        tensor = torch.full((N,), float(rank + 1))
        with lowbitcc.compressed():
            dist.all_reduce(tensor, group=pg)
        lowbitcc.end_step()
    if rank != 0:  # the peers never issue the next call, and stay until rank 0 is done
        store.wait(["shut-down"], datetime.timedelta(seconds=120))
        return None
    before = pg._runner.served_compressed
    with lowbitcc.compressed():
        work = dist.all_reduce(torch.full((N,), 1.0), group=pg, async_op=True)
    queued = pg._runner.served_compressed - before
    begun = time.monotonic()
    pg.shutdown()
    took = time.monotonic() - begun
    try:
        work.wait()
        raised = None
    except Exception as exc:  # noqa: BLE001 (the test reads its type)
        raised = type(exc).__name__
    store.set("shut-down", "1")
    return queued, took, raised


def test_a_group_shuts_down_within_its_timeout_with_a_run_queued_on_its_lane():
    """Rank 0's served tree call waits on its lane for peers that never issue theirs; its
    group's shutdown returns within about its timeout (5 s: the run's transfers fail by then,
    and the lane is waited for no longer), and the call's Work raises instead of hanging."""
    results = run_ranks(_shut_down_with_a_run_queued, 3, timeout=120)
    queued, took, raised = results[0]
    assert queued == 1, "the call was not served"
    assert took < 30, took
    assert raised is not None


def _synchronous_calls_stay_on_their_thread(rank, world, gloo, schedule):
    config = lowbitcc.LocoConfig(min_size=2, cost_model=False, schedule=schedule)
    pg = dist.new_group(backend="loco", pg_options=config,
                        timeout=datetime.timedelta(seconds=30))
    runner, lane = pg._runner, pg._queue.lane
    value = torch.linspace(-1.0, 1.0, N) * (rank + 1)

    def call(collective, async_op):
        with lowbitcc.compressed():  # (outside backward the default sends it exact)
            if collective == "all_reduce":
                tensor = value.clone()
                work = dist.all_reduce(tensor, group=pg, async_op=async_op)
            else:
                tensor = torch.empty(N // world)
                work = dist.reduce_scatter_tensor(tensor, value.clone(), group=pg,
                                                  async_op=async_op)
        if async_op:
            work.wait()
        lowbitcc.end_step()
        return tensor

    for _ in range(12):  # both places agreed and steady
        call("all_reduce", True)
        call("reduce_scatter", True)
    counted = {}
    for async_op in (False, True):
        before, queued = runner.served_compressed, lane.submitted
        outputs = [call(collective, async_op) for _ in range(3)  # (the places' order)
                   for collective in ("all_reduce", "reduce_scatter")]
        counted[async_op] = (runner.served_compressed - before, lane.submitted - queued, outputs)
    return counted


@pytest.mark.parametrize("schedule", ["direct", "tree"])
def test_a_synchronous_call_runs_whole_on_its_calling_thread(schedule):
    """A call whose caller waits for it at once (``async_op=False``: c10d's ``asyncOp``) gains
    nothing from the lane and would pay its two thread wakes: its whole run (on three ranks the
    direct schedule's all-reduce, the tree's all-reduce and reduce-scatter) is issued on the
    calling thread, served all the same, with the same sums as the lane's runs; the same calls
    made with ``async_op=True`` are queued on the lane, one run each."""
    results = run_ranks(_synchronous_calls_stay_on_their_thread, 3, schedule, timeout=180)
    whole = 6 if schedule == "tree" else 3  # (the direct reduce-scatter never runs whole)
    for counted in results:
        assert counted[False][:2] == (6, 0), counted[False][:2]
        assert counted[True][:2] == (6, whole), counted[True][:2]
        for got, want in zip(counted[False][2], counted[True][2], strict=True):
            assert torch.equal(got, want)
    for counted in results[1:]:
        for got, want in zip(counted[False][2], results[0][False][2], strict=True):
            if got.numel() == N:  # (the all-reduces: every rank's sums are the same)
                assert torch.equal(got, want)


def _served_after_shutdown(rank, world, gloo):
    store = dist.distributed_c10d._get_default_store()
    config = lowbitcc.LocoConfig(min_size=2, cost_model=False, schedule="hierarchical",
                                 node_size=2)
    pg = dist.new_group(backend="loco", pg_options=config,
                        timeout=datetime.timedelta(seconds=10))
    tensor = torch.full((N,), float(rank + 1))
    for _ in range(12):  # the place agreed and steady
        with lowbitcc.compressed():
            dist.all_reduce(tensor, group=pg)
        lowbitcc.end_step()
    subgroups = pg._cpu_links._make  # (`links.KeptSubGroups`: the node's, the rail's)
    shut = []

    class Recorded:  # each made group, its shutdown recorded
        def __init__(self, group):
            self.group = group

        def shutdown(self):
            shut.append(self.group.size())
            self.group.shutdown()

    subgroups.groups = [Recorded(group) for group in subgroups.groups]
    pg.shutdown()
    store.set(f"shut-{rank}", "1")
    store.wait([f"shut-{r}" for r in range(world)], datetime.timedelta(seconds=60))
    before = pg._runner.served_compressed
    begun = time.monotonic()
    try:
        with lowbitcc.compressed():
            dist.all_reduce(tensor, group=pg)  # (synchronous: it would run on this thread)
        raised = None
    except Exception as exc:  # noqa: BLE001 (the test reads its message)
        raised = str(exc)
    return raised, pg._runner.served_compressed - before, time.monotonic() - begun, shut


def test_a_steady_call_on_a_group_that_was_shut_down_raises_at_once():
    """After every rank shut its group down (and with it its node and rail gloo groups, two of
    two ranks each), a steady synchronous hierarchical all-reduce is not run on the calling
    thread: it raises that the group was shut down, at once, on every rank."""
    for raised, _, took, shut in run_ranks(_served_after_shutdown, 4, timeout=120):
        assert raised is not None and "shut down" in raised, raised
        assert took < 5, took
        assert shut == [2, 2], shut


AT_EXIT = r"""
import atexit, datetime, torch, torch.distributed as dist, lowbitcc

def last_call():  # (registered before the group: it runs after the group's lane was closed)
    before = pg._runner.served_compressed
    tensor = torch.full((6000,), float(dist.get_rank() + 1))
    with lowbitcc.compressed():
        dist.all_reduce(tensor, group=pg)  # synchronous: its run on this thread
    print(pg._runner.served_compressed - before, float(tensor[0]), flush=True)

atexit.register(last_call)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
pg = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(min_size=2, cost_model=False))
for _ in range(12):  # the place agreed and steady
    tensor = torch.full((6000,), float(dist.get_rank() + 1))
    with lowbitcc.compressed():
        dist.all_reduce(tensor, group=pg)
    lowbitcc.end_step()
"""


def test_a_synchronous_call_at_exit_after_the_lane_closed_still_runs():
    """At the process's exit the group's lane is closed (``issue_queue._close_at_exit``, which
    waits for its runs) before exit handlers registered earlier run: a steady synchronous call
    made there (three ranks: its run whole) still runs, served, on the calling thread, with
    the same sums on every rank; the group was not shut down."""
    import os

    ranks = run_script_ranks(AT_EXIT, world=3, port=20000 + (os.getpid() * 7) % 20000)
    lines = []
    for code, out, err in ranks:
        assert code == 0 and out.strip(), err[-3000:]
        lines.append(out.split())
    assert all(line[0] == "1" for line in lines), lines
    assert len({line[1] for line in lines}) == 1, lines
