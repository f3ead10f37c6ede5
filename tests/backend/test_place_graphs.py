"""Graph replay of a call place (`place_graph.PlaceGraph`, ``LocoConfig.call_graphs``), without
a GPU: a place's `CallPlan` on the CUDA code branch (``device="meta"``, the CUDA launcher and
the NCCL group recorded, `tests.support.cuda_trace`) with a fake graph that records what its
capture issues and counts its replays. What a real capture and replay do on a GPU is
``benchmarks/gpu_session.sh graphs``'."""

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

    def __init__(self) -> None:
        self.captured: list = []
        self.replays = 0
        FakeGraph.made.append(self)

    def capture(self, body) -> None:
        if FakeGraph.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.capturing = True
        body()

    def replay(self) -> None:
        self.replays += 1


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
    return work, launched


def _graph_plan(work: GpuWork, world: int):
    return meta_plan(work, world, 1 << 16, "nvfp4", feedback=False, graphs=True)


def _done_capturing() -> None:
    for graph in FakeGraph.made:
        graph.capturing = False


@pytest.mark.parametrize("world", [2, 4])
def test_a_place_captures_one_graph_per_verdict_word_and_then_only_replays(world, traced):
    work, launched = traced
    plan, x, _ = _graph_plan(work, world)
    last = "decode_rows" if world == 2 else "decode_into"
    for run in range(1, 9):
        launched.clear()
        work.nccl.clear()
        if run > CAPTURE_AT + 1:
            with _Classified(work):
                plan.run(x, dist.ReduceOp.SUM)
        else:
            plan.run(x, dist.ReduceOp.SUM)
        _done_capturing()
        if run < CAPTURE_AT:  # eager: every launch, the second writing the next call number
            assert launched and launched[-1][0] == last and not FakeGraph.made
            assert int(launched[-1][1][-1]["count"]["mode"]) == (COUNT_SET if run == 2 else 0)
        elif run <= CAPTURE_AT + 1:  # a capture, the call run by its replay
            graph = FakeGraph.made[run - CAPTURE_AT]
            assert not launched and graph.replays == 1
            names = [name for name, _ in graph.captured]
            assert names[-1] == last and work.nccl  # the transfers captured too
            checks = [args[-1]["count"] for name, args in graph.captured if name != "encode"]
            assert all(int(c["read"]) == 1 for c in checks)
            assert int(checks[-1]["mode"]) == COUNT_ADD and int(checks[-1]["value"]) == 1
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


def test_a_failed_capture_runs_the_call_eagerly_and_turns_the_place_s_graphs_off(traced):
    work, launched = traced
    plan, x, _ = _graph_plan(work, 2)
    FakeGraph.fail = True
    for _ in range(6):
        launched.clear()
        plan.run(x, dist.ReduceOp.SUM)
        assert launched[-1][0] == "decode_rows"  # every call ran, eagerly
        assert int(launched[-1][1][-1]["count"]["read"]) == 0
    assert plan.graph.off and len(FakeGraph.made) == 1


class _Plan:
    """What `PlaceGraph` asks of a plan, on CPU tensors (real addresses, no device)."""

    def __init__(self, x: torch.Tensor) -> None:
        self.device, self.runs, self.turn, self.stride = torch.device("cpu"), CAPTURE_AT, 0, 1
        self.comp = type("C", (), {"codec": type("K", (), {"count": None})(),
                                   "replayed": lambda self: None})()
        self.launched = []
        self.buffers = lambda: []
        self.describe = lambda: "a call"

    def launch(self, source: Source, output) -> None:
        self.launched.append(source.tensor)


def test_a_moved_tensor_replays_through_the_captured_one_and_a_new_factor_stops_the_graphs(
        traced, monkeypatch):
    from lowbitcc.codec.interface import CallCount

    x = torch.arange(8.0)
    plan = _Plan(x)
    plan.comp.codec.count = CallCount(torch.zeros(2, dtype=torch.int32), False, 5)
    graph = PlaceGraph()
    assert graph.run(plan, Source(x, 2, 4, 1.0), None)  # captured on x, replayed
    assert plan.launched == [x] and plan.comp.codec.count.read is False
    assert plan.comp.codec.count.value == 5  # the eager value back after the capture
    moved = torch.full((8,), 3.0)
    plan.turn = 1
    assert graph.run(plan, Source(moved, 2, 4, 1.0), None)  # captured on x again
    assert plan.launched == [x, x]
    assert torch.equal(x, moved)  # copied in; the (fake) replay left it; copied back
    assert graph.run(plan, Source(moved, 2, 4, 1.0), None) and graph.replays == 3
    assert not graph.run(plan, Source(moved, 2, 4, 0.5), None)  # a factor of its own
    assert graph.off and not graph.run(plan, Source(x, 2, 4, 1.0), None)
