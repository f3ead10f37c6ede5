"""Host records of a call place's run (`launch_record.LaunchRecord`, wherever a place can replay),
without a GPU: a place's `CallPlan` on the CUDA code branch (``device="meta"``, the CUDA
launcher and the NCCL group recorded, `tests.support.cuda_trace`) beside an eager plan of the
same calls; and `PlaceGraph`'s decisions on a stand-in plan with CPU tensors (real addresses).
The bytes a replay writes on a GPU are ``tests/gpu/test_multirank.py``'s."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lowbitcc import state
from lowbitcc.backend.place_graph import CAPTURE_AT, RECORDS_IN_A_ROW, PlaceRecords
from lowbitcc.codec import cuda
from lowbitcc.codec.cuda_build import COUNT_ADD, COUNT_SET
from lowbitcc.compressor import Source
from lowbitcc.config import LocoConfig
from lowbitcc.counters import Stats
from lowbitcc.feedback import FeedbackStore
from tests.codec.test_cuda_launch_budget import _Classified
from tests.support.cuda_trace import GpuWork, meta_plan


@pytest.fixture
def launched(monkeypatch) -> list:
    """Every launch, as (short name, arguments)."""
    out: list = []
    monkeypatch.setattr(cuda, "_launch", lambda name, device, grid, args: out.append(
        (name.split("<")[0].removeprefix("loco_cuda::"), args)))
    monkeypatch.setattr(state, "FEEDBACK", FeedbackStore())
    return out


def _run(plan, x, out, stats: Stats, launched: list, work: GpuWork | None = None) -> list:
    """One run of ``plan`` with its own statistics: its launches (GPU work outside them in
    ``work``, where given)."""
    launched.clear()
    state.STATS = stats
    if work is None:
        plan.run(x, dist.ReduceOp.SUM, out)
    else:
        with _Classified(work):
            plan.run(x, dist.ReduceOp.SUM, out)
    return list(launched)


@pytest.mark.parametrize("world,collective", [(2, "all_reduce"), (4, "all_reduce"),
                                              (4, "reduce_scatter")])
def test_a_place_issues_its_eager_runs_launches_and_transfers_from_its_record(
        world, collective, launched, monkeypatch):
    """From its third run a place records its run once per verdict word and then issues the
    record: the eager plan's launches, in order, with the same transfers and statistics, the
    call number read from the place's counter and the stride added there; a replay makes no
    packed argument, kernel, allocation or upload of its own."""
    monkeypatch.setattr(state, "STATS", Stats())
    work, eager_work = GpuWork(), GpuWork()
    stats, eager_stats = Stats(), Stats()  # each plan's, its metered transfers' included
    plan, x, out = meta_plan(work, world, 1 << 16, "nvfp4", collective, feedback=False,
                             stats=stats)
    eager, y, out_e = meta_plan(eager_work, world, 1 << 16, "nvfp4", collective, feedback=False,
                                replay=False, stats=eager_stats)
    assert plan.graph.recorded and eager.graph is None
    records: dict[int, list] = {}
    for run in range(1, 9):
        work.nccl.clear()
        eager_work.nccl.clear()
        replays = plan.graph.replays
        steady = GpuWork() if run > CAPTURE_AT + 1 else None
        mine = _run(plan, x, out, stats, launched, steady)
        theirs = _run(eager, y, out_e, eager_stats, launched)
        assert [n for n, _ in mine] == [n for n, _ in theirs] and work.nccl == eager_work.nccl
        counts = [args[-1]["count"] for name, args in mine if not name.startswith("encode")]
        if run < CAPTURE_AT:
            assert plan.graph.replays == 0 and all(int(c["read"]) == 0 for c in counts)
            continue
        assert plan.graph.replays == replays + 1
        assert all(int(c["read"]) == 1 for c in counts)
        assert int(counts[-1]["mode"]) == COUNT_ADD and int(counts[-1]["value"]) == 1
        assert int(theirs[-1][1][-1]["count"]["mode"]) == COUNT_SET
        if run <= CAPTURE_AT + 1:
            records[plan.turn] = mine
        else:  # the very values recorded, issued again
            assert all(a is b for (_, a), (_, b) in zip(mine, records[plan.turn], strict=True))
            assert not steady.kernels and steady.allocations == 0
            assert steady.host_to_device == 0
        assert stats.sent("compressed") == eager_stats.sent("compressed")  # after every run
    assert stats.sent("compressed")["wire_bytes"] > 0
    assert plan.graph.replays == 6 and plan.seq == eager.seq == 8


def test_a_place_whose_calls_came_further_apart_runs_eagerly_until_its_counter_holds_the_number(
        launched, monkeypatch):
    """A replay reads its call number from the place's counter, which the run before left at
    its own number plus its stride: where other calls of the group came between since, the run
    goes eagerly (its call number by value, the counter set for the next run); so the headers
    are an eager run's, whichever runs on a rank."""
    monkeypatch.setattr(state, "STATS", Stats())
    plan, x, _ = meta_plan(GpuWork(), 2, 1 << 16, "nvfp4", feedback=False)
    next_seq = plan.group.agreement.next_seq
    replayed, counter = [], None  # the place's counter word, as the launches leave it
    for between in (0, 0, 0, 0, 2, 0, 0, 0, 1, 1, 1, 1):
        for _ in range(between):
            next_seq()
        before = plan.graph.replays
        mine = _run(plan, x, None, state.STATS, launched)
        replayed.append(plan.graph.replays > before)
        for _, args in mine:
            if "count" not in args[-1].dtype.names:  # the encode: framed by its own header
                continue
            count = args[-1]["count"]
            if int(count["read"]):  # the call number every reading launch writes and expects
                assert counter == plan.seq, (counter, plan.seq)
            mode, value = int(count["mode"]), int(count["value"])
            counter = value if mode == COUNT_SET else counter + value if mode == COUNT_ADD else counter
        count = mine[-1][1][-1]["count"]
        if not replayed[-1] and plan.runs >= CAPTURE_AT:  # eager, the number for the next run
            assert int(count["read"]) == 0 and int(count["mode"]) == COUNT_SET
            assert int(count["value"]) == plan.seq + plan.stride
    # a lasting stride of 2: one eager run sets the counter, then records of that stride
    assert replayed == [False, False, True, True, False, False, True, True,
                        False, True, True, True]
    assert plan.seq == 18


def _record_plan():
    """`test_place_graphs`' stand-in plan, its counter holding each run's number, over a
    transport that a record replaces while it records."""
    from tests.backend.test_place_graphs import _Plan

    plan = _Plan()
    plan.counter_holds_seq, plan.transport = True, object()
    return plan


def test_a_rank_whose_tensor_moved_records_again_alone_and_stops_where_it_moves_every_call():
    """A record holds the addresses it was made on: a run whose tensor lies elsewhere records
    again (on its own rank: a record issues nothing, and its replay the eager run's transfers),
    with the run's own stride; a tensor at the recorded address replays; a run whose counter
    does not hold its number runs eagerly; a place whose tensor moved `RECORDS_IN_A_ROW` times
    in a row stops recording."""
    plan, graph = _record_plan(), PlaceRecords()
    x = torch.arange(8.0)
    assert graph.run(plan, Source(x, 2, 4, 1.0), None)
    assert plan.launched == [(x, True, 1, None)] and plan.comp.codec.count.value == 5
    assert graph.run(plan, Source(x.view(2, 4).view(-1), 2, 4, 1.0), None)  # the same memory
    assert len(plan.launched) == 1 and graph.replays == 2
    plan.counter_holds_seq = False
    assert not graph.run(plan, Source(x, 2, 4, 1.0), None) and not graph.off
    plan.counter_holds_seq, plan.stride = True, 3
    assert graph.run(plan, Source(x, 2, 4, 1.0), None)  # another stride: recorded again
    assert plan.launched[-1] == (x, True, 3, None)  # no address word
    assert graph.run(plan, Source(x, 2, 4, 0.5), None)  # another input factor: likewise
    for i in range(RECORDS_IN_A_ROW - 2):
        assert graph.run(plan, Source(torch.full((8,), float(i)), 2, 4, 0.5), None)
    assert len(plan.launched) == 1 + RECORDS_IN_A_ROW
    assert not graph.run(plan, Source(torch.zeros(8), 2, 4, 0.5), None) and graph.off
    assert graph.replays == 2 + RECORDS_IN_A_ROW


def test_a_run_that_queues_work_of_its_own_is_never_recorded():
    """A record repeats only launches and transfers: a launch path that runs any other torch
    operation (here a fill of the call's tensor) is refused before that operation runs; the
    call then runs eagerly, the compressor as before the record, and the place stops."""
    plan, graph = _record_plan(), PlaceRecords()
    x = torch.ones(8)
    plan.launch = lambda source, output: source.tensor.fill_(7.0)
    assert not graph.run(plan, Source(x, 2, 4, 1.0), None)
    assert graph.off and plan.comp.rebinds == 1 and torch.equal(x, torch.ones(8))


def test_places_record_where_they_can_replay_and_graphs_take_its_place(monkeypatch, launched):
    with pytest.raises(ValueError, match="LOCO_CALL_REPLAY"):  # no switch: records always
        LocoConfig.from_env({"LOCO_CALL_REPLAY": "0"})
    monkeypatch.setattr(state, "STATS", Stats())
    recorded, _, _ = meta_plan(GpuWork(), 2, 1 << 16, "nvfp4", feedback=False)
    assert recorded.graph is not None and recorded.graph.recorded
    graphs, _, _ = meta_plan(GpuWork(), 2, 1 << 16, "nvfp4", feedback=False, graphs=True)
    assert graphs.graph is not None and not graphs.graph.recorded
    fed, _, _ = meta_plan(GpuWork(), 2, 1 << 16, "nvfp4", feedback=True)
    assert fed.graph is None  # an error state changes every run
