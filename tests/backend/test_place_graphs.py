"""Graph replay of a call place (`place_graph.PlaceGraph`, ``LocoConfig.call_graphs``), without
a GPU: a place's `CallPlan` on the CUDA code branch (``device="meta"``, the CUDA launcher and
the NCCL group recorded, `tests.support.cuda_trace`) with a fake graph that records what its
capture issues and counts its replays. What a real capture and replay do on a GPU is
``benchmarks/gpu_suite.sh graphs``'."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lowbitcc import state
from lowbitcc.backend import place_graph
from lowbitcc.backend.place_graph import CAPTURE_AT, PlaceGraph
from lowbitcc.codec import cuda
from lowbitcc.codec.cuda_build import COUNT_ADD, COUNT_SET
from lowbitcc.compressor import Source
from lowbitcc.counters import Stats
from lowbitcc.feedback import FeedbackStore
from tests.codec.test_cuda_launch_budget import _Classified
from tests.support.cuda_trace import GpuWork, meta_plan


class FakeGraph:
    """Records the launches and NCCL calls its capture issues, and counts its replays."""

    made: list[FakeGraph] = []
    fail = False
    during_replay = None
    during_capture = None

    def __init__(self) -> None:
        self.captured: list = []
        self.replays = 0
        self.reset_ = False
        FakeGraph.made.append(self)

    def capture(self, body) -> None:
        if FakeGraph.fail == "before its launches":
            raise RuntimeError("operation not permitted when stream is capturing")
        self.capturing = True
        try:
            body()
            if FakeGraph.during_capture is not None:
                FakeGraph.during_capture()
        finally:
            self.capturing = False
        if FakeGraph.fail:
            raise RuntimeError("operation failed due to a previous error during capture")

    def replay(self, stream) -> None:
        assert not self.reset_, "a destroyed graph replayed"
        self.replays += 1
        if FakeGraph.during_replay is not None:  # what another thread does meanwhile
            FakeGraph.during_replay()
            assert not self.reset_, "destroyed while it launched"

    def reset(self) -> None:
        self.reset_ = True


@pytest.fixture
def traced(monkeypatch):
    """(work, launched): the GPU work outside graphs, and every launch with its arguments (in
    the capturing graph's list while one captures)."""
    work, launched = GpuWork(), []

    def launch(name, device, grid, args):
        short = name.split("<")[0].removeprefix("loco_cuda::")
        capturing = [g for g in FakeGraph.made if getattr(g, "capturing", False)]
        (capturing[-1].captured if capturing else launched).append((short, args))
        work.launches[short] += not capturing

    monkeypatch.setattr(cuda, "_launch", launch)
    monkeypatch.setattr(state, "FEEDBACK", FeedbackStore())
    monkeypatch.setattr(state, "STATS", Stats())
    monkeypatch.setattr(place_graph, "GRAPH", FakeGraph)
    FakeGraph.made, FakeGraph.fail = [], False
    FakeGraph.during_replay = FakeGraph.during_capture = None
    return work, launched


def _graph_plan(work: GpuWork, world: int, collective: str = "all_reduce"):
    return meta_plan(work, world, 1 << 16, "nvfp4", collective, feedback=False, graphs=True)


def _done_capturing() -> None:
    for graph in FakeGraph.made:
        graph.capturing = False


@pytest.mark.parametrize("world,collective", [(2, "all_reduce"), (4, "all_reduce"),
                                              (4, "reduce_scatter")])
def test_a_place_captures_one_graph_per_verdict_word_and_then_only_replays(world, collective,
                                                                         traced):
    work, launched = traced
    plan, x, out = _graph_plan(work, world, collective)
    last = {2: "decode_rows", 4: "decode_into"}[world] if out is None else "decode_sum"
    for run in range(1, 9):
        launched.clear()
        work.nccl.clear()
        if run > CAPTURE_AT + 1:
            with _Classified(work):
                plan.run(x, dist.ReduceOp.SUM, out)
        else:
            plan.run(x, dist.ReduceOp.SUM, out)
        _done_capturing()
        if run < CAPTURE_AT:  # eager: every launch, the second writing the next call number
            assert launched and launched[-1][0] == last and not FakeGraph.made
            assert int(launched[-1][1][-1]["count"]["mode"]) == (COUNT_SET if run == 2 else 0)
            assert int(launched[-1][1][-1]["count"]["out_at"]) == 0
        elif run <= CAPTURE_AT + 1:  # a capture, the call run by its replay
            graph = FakeGraph.made[run - CAPTURE_AT]
            assert not launched and graph.replays == 1
            names = [name for name, _ in graph.captured]
            assert names[-1] == last and work.nccl  # the transfers captured too
            checks = [args[-1]["count"] for name, args in graph.captured if name != "encode"]
            assert all(int(c["read"]) == 1 for c in checks)
            assert int(checks[-1]["mode"]) == COUNT_ADD and int(checks[-1]["value"]) == 1
            # the last writes its output where the place's word says (meta: address 0)
            assert int(checks[-1]["out_at"]) == plan.addresses().data_ptr() + 8
            assert all(int(c["out_at"]) == 0 for c in checks[:-1])
        else:  # replays only: no launch, transfer, kernel or allocation of their own
            assert not launched and not work.nccl and not work.kernels
            assert work.allocations == 0 and work.host_to_device == 0
    first, second = FakeGraph.made
    assert (first.replays, second.replays) == (3, 3)  # the two words in turn
    assert plan.graph.replays == 6 and plan.seq == 8


def test_a_place_with_error_feedback_or_stochastic_rounding_never_captures(traced):
    work, _ = traced
    plan, x, _ = meta_plan(work, 2, 1 << 16, "nvfp4", feedback=True, graphs=True)
    for _ in range(6):
        plan.run(x, dist.ReduceOp.SUM)
    assert plan.graph is None and not FakeGraph.made


@pytest.mark.parametrize("when", ["before its launches", "after its launches"])
def test_a_failed_capture_runs_the_call_eagerly_and_turns_the_place_s_graphs_off(traced, when):
    """The call that failed to capture runs eagerly as if no capture had been tried (its first
    encode clears the verdict again: the captured one never ran), and so do the later ones."""
    work, launched = traced
    plan, x, _ = _graph_plan(work, 2)
    FakeGraph.fail = when
    clears = []
    real = cuda.pack_encode_args
    monkeypatch_args = pytest.MonkeyPatch()
    monkeypatch_args.setattr(cuda, "pack_encode_args",
                             lambda args: clears.append(args.clear is not None) or real(args))
    try:
        for _ in range(6):
            launched.clear()
            clears.clear()
            plan.run(x, dist.ReduceOp.SUM)
            _done_capturing()
            assert launched[-1][0] == "decode_rows"  # every call ran, eagerly
            assert int(launched[-1][1][-1]["count"]["read"]) == 0
            assert clears[-1]  # the eager encode cleared the verdict
    finally:
        monkeypatch_args.undo()
    assert plan.graph.off and len(FakeGraph.made) == 1 and plan.graph.replays == 0


def test_call_graphs_is_a_bool():
    from lowbitcc.config import LocoConfig

    with pytest.raises(ValueError, match="call_graphs"):
        LocoConfig(call_graphs="yes")


class _Comp:
    def __init__(self, count) -> None:
        self.codec = type("K", (), {"count": count})()
        self.wire_error = None
        self.replays = self.rebinds = 0

    def replayed(self) -> None:
        self.replays += 1

    def rebind(self) -> None:
        self.rebinds += 1


class _Plan:
    """What `PlaceGraph` asks of a plan, on CPU tensors (real addresses, no device)."""

    def __init__(self) -> None:
        from lowbitcc.codec.interface import CallCount

        self.device, self.runs, self.turn, self.stride = torch.device("cpu"), CAPTURE_AT, 0, 1
        self.comp = _Comp(CallCount(torch.zeros(2, dtype=torch.int32), False, 5))
        self.launched: list = []
        self.words = torch.zeros(2, dtype=torch.int64)
        self.addresses = lambda: self.words
        self.buffers = lambda: []
        self.describe = lambda: "a call"
        self.group = type("Group", (), {"graphs": place_graph.LiveGraphs()})()

    def launch(self, source: Source, output) -> None:
        count = self.comp.codec.count
        self.launched.append((source.tensor, count.read, count.value, count.addresses))


def test_a_moved_tensor_replays_the_graph_of_the_place_s_capture_where_its_word_points(traced):
    """Every rank captures each graph once (NCCL: each rank launches the graph derived from one
    collective capture); the captured launches read the call's addresses from the place's word,
    set before a launch where the call's tensors lie elsewhere than the last call's (a fill, this
    rank alone), with the stride of the place's first capture; the tensor of an earlier call is
    never written; a new input factor, or a reduce-scatter output cast after the decode, stops
    the graphs."""
    x = torch.arange(8.0)
    plan = _Plan()
    graph = PlaceGraph()
    seen = []  # the word as each launch finds it
    FakeGraph.during_replay = lambda: seen.append(plan.words.tolist())
    assert graph.run(plan, Source(x, 2, 4, 1.0), None)  # captured with x's address, launched
    assert plan.launched == [(x, True, 1, plan.words)] and plan.comp.codec.count.read is False
    assert plan.comp.codec.count.value == 5 and plan.comp.codec.count.addresses is None
    assert plan.words.tolist() == [x.data_ptr()] * 2
    moved, kept = torch.full((8,), 3.0), x.clone()
    plan.stride = 2  # the place's calls came further apart meanwhile: its graph's stride stays
    assert graph.run(plan, Source(moved, 2, 4, 1.0), None)
    assert len(FakeGraph.made) == 1 and FakeGraph.made[0].replays == 2 and len(plan.launched) == 1
    assert plan.words.tolist() == [moved.data_ptr()] * 2
    assert torch.equal(x, kept) and graph.replays == 2 and plan.comp.replays == 2
    out = torch.zeros(4)
    assert graph.run(plan, Source(moved, 2, 4, 1.0), out)  # a reduce-scatter's output
    assert plan.words.tolist() == [moved.data_ptr(), out.data_ptr()]
    assert seen == [[x.data_ptr()] * 2, [moved.data_ptr()] * 2, [moved.data_ptr(), out.data_ptr()]]
    assert not graph.run(plan, Source(moved, 2, 4, 1.0), out.to(torch.bfloat16))
    assert graph.off and not graph.run(plan, Source(moved, 2, 4, 1.0), None)
    other = PlaceGraph()
    assert other.run(plan, Source(x, 2, 4, 1.0), None)
    assert not other.run(plan, Source(x, 2, 4, 0.5), None) and other.off  # a factor of its own


def test_a_capture_whose_message_check_raised_is_never_replayed(traced):
    """A decode that met a malformed message while capturing deferred its error and filled
    its output with NaN inside the graph: the graph is dropped, the call runs eagerly."""
    from lowbitcc.codec import wire

    plan = _Plan()

    def launch(source, output):
        plan.comp.wire_error = wire.WireFormatError("expected 2 messages of 40 bytes")

    plan.launch = launch
    graph = PlaceGraph()
    assert not graph.run(plan, Source(torch.zeros(8), 2, 4, 1.0), None)
    assert graph.off and plan.comp.rebinds == 1 and graph.replays == 0


def test_a_group_destroys_its_graphs_before_its_communicator(traced):
    """NCCL destroys or aborts a communicator only once the graphs that captured its kernels
    are gone: the group's `LiveGraphs` destroys every place's graphs first (its shutdown, its
    watchdog's abort); the places run eagerly from then on."""
    from lowbitcc.backend.process_group import LocoProcessGroup

    work, launched = traced
    plan, x, _ = _graph_plan(work, 2)
    for _ in range(CAPTURE_AT + 2):
        plan.run(x, dist.ReduceOp.SUM)
        _done_capturing()
    assert len(FakeGraph.made) == 2 and not any(g.reset_ for g in FakeGraph.made)
    order = []
    nccl = type("Nccl", (), {"abort": lambda self: order.append(
        ("abort", [g.reset_ for g in FakeGraph.made]))})()
    links = type("Links", (), {"close": lambda self, abort: order.append(
        ("close node and rail", abort, [g.reset_ for g in FakeGraph.made]))})()
    group = type("Group", (), {"_compressed": plan.group, "_nccl": nccl, "_cuda_links": links})()
    LocoProcessGroup._abort_nccl(group)  # the watchdog's abort
    assert order == [("close node and rail", True, [True, True]), ("abort", [True, True])]
    assert plan.graph.off
    launched.clear()
    plan.run(x, dist.ReduceOp.SUM)  # eager again, no replay of a destroyed graph
    assert launched and sum(g.replays for g in FakeGraph.made) == 3


def test_graphs_released_by_the_watchdog_during_a_launch_go_once_it_returns(traced):
    """The watchdog's thread may release the group's graphs while the calling thread launches
    one: that graph is destroyed by the launching thread once its launch returns, the others
    at once, and a graph captured after the release is launched once and destroyed."""
    work, launched = traced
    plan, x, _ = _graph_plan(work, 2)
    for _ in range(CAPTURE_AT + 1):  # both words' graphs captured
        plan.run(x, dist.ReduceOp.SUM)
        _done_capturing()
    first, second = FakeGraph.made
    FakeGraph.during_replay = lambda: plan.group.graphs.release(0.0)
    plan.run(x, dist.ReduceOp.SUM)  # the first word's graph launches; released meanwhile
    FakeGraph.during_replay = None
    assert first.reset_ and second.reset_ and plan.graph.off
    launched.clear()
    plan.run(x, dist.ReduceOp.SUM)
    assert launched and len(FakeGraph.made) == 2  # eager from then on

    other, y, _ = _graph_plan(work, 2)
    for _ in range(CAPTURE_AT - 1):
        other.run(y, dist.ReduceOp.SUM)
    FakeGraph.during_capture = lambda: other.group.graphs.release(0.0)
    other.run(y, dist.ReduceOp.SUM)  # captured, released meanwhile: launched once, destroyed
    _done_capturing()
    third = FakeGraph.made[-1]
    assert third.replays == 1 and third.reset_ and other.graph.off
