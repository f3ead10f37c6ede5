"""The CUDA path's plumbing, checked without a GPU: `CudaIssuer` (streams, events, Works) with
torch.cuda replaced by recording fakes, the NCCL transport over a fake group, the device-side
header check on CPU tensors, and the group-level rules (mixed backend strings, transports,
schedules). What needs a GPU is in tests/gpu (``pytest -m gpu``)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from lowbitcc.backend import cuda_issue
from lowbitcc.codec import wire
from lowbitcc.codec.shard_codec import ShardCodec
from lowbitcc.transports import cpu_kind
from lowbitcc.transports.nccl import SCHEDULES, NcclTransport


class FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log
        self.device = torch.device("cpu")

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait_event", self.name, event.stream))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeStream) and other.name == self.name

    __hash__ = None  # type: ignore[assignment]


class FakeEvent:
    def __init__(self) -> None:
        self.stream = None

    def record(self, stream: FakeStream) -> None:
        self.stream = stream.name

    def query(self) -> bool:
        return True


class FakeTensor:
    def __init__(self, log: list, name: str) -> None:
        self.device = torch.device("cpu")
        self.log, self.name = log, name

    def record_stream(self, stream: FakeStream) -> None:
        self.log.append(("record_stream", self.name, stream.name))


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda as the issuer uses it, recording into a log; `state["current"]` is the
    stream a launch would go to."""
    log: list = []
    state = {"current": FakeStream("current", log), "capturing": False, "sides": 0}

    @contextlib.contextmanager
    def stream_ctx(stream):
        before, state["current"] = state["current"], stream
        try:
            yield
        finally:
            state["current"] = before

    def new_stream(device):
        state["sides"] += 1
        return FakeStream(f"side{state['sides']}", log)

    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: state["current"])
    monkeypatch.setattr(torch.cuda, "stream", stream_ctx)
    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])

    def ready(outputs, device):
        log.append(("ready", state["current"].name, [t.name for t in outputs]))
        return ("work", tuple(outputs))

    monkeypatch.setattr(cuda_issue, "ready_work", ready)
    return log, state


def _job(log, state, name="job"):
    return lambda: log.append((name, state["current"].name))


def test_synchronous_call_runs_on_the_callers_stream(fake_cuda):
    log, state = fake_cuda
    issuer = cuda_issue.CudaIssuer(nccl=None)
    out = FakeTensor(log, "out")
    work = issuer.compressed(_job(log, state), _job(log, state, "exact"), [out], [out], False)
    assert isinstance(work, cuda_issue.StreamWork) and work.result() == [out]
    assert work.event.stream == "current"  # what waiting on the Work orders after
    assert log == [("job", "current")]


def test_async_call_runs_on_a_side_stream_that_waits_for_the_caller(fake_cuda):
    log, state = fake_cuda
    issuer = cuda_issue.CudaIssuer(nccl=None)
    inp, out = FakeTensor(log, "in"), FakeTensor(log, "out")
    work = issuer.compressed(_job(log, state), _job(log, state, "exact"), [inp, out], [out], True)
    assert log == [("wait_stream", "side1", "current"), ("job", "side1"),
                   ("record_stream", "in", "side1"), ("record_stream", "out", "side1")]
    assert work.event.stream == "side1"
    work.synchronize()  # as NCCL's: the caller's stream waits for the call, the host does not
    assert log[-1] == ("wait_event", "current", "side1")
    assert state["current"].name == "current"  # the caller's stream is current again
    log.clear()
    issuer.compressed(_job(log, state), _job(log, state, "exact"), [out], [out], True)
    assert state["sides"] == 1  # one side stream per device, reused
    # the second call waits for the first's end, recorded on the side stream
    assert ("wait_event", "side1", "side1") in log


def test_calls_on_different_streams_are_chained_in_issue_order(fake_cuda):
    log, state = fake_cuda
    issuer = cuda_issue.CudaIssuer(nccl=None)
    out = FakeTensor(log, "out")
    issuer.compressed(_job(log, state), _job(log, state), [out], [out], True)  # on side1
    log.clear()
    issuer.compressed(_job(log, state), _job(log, state), [out], [out], False)  # on current
    assert log[0] == ("wait_event", "current", "side1")
    assert log[1] == ("job", "current")


def test_calls_from_two_threads_issue_one_at_a_time_and_chain(fake_cuda):
    """A second thread's call waits until the first's job has been enqueued, then chains
    after it; without the lock its job ran in the middle of the first's."""
    import threading

    log, state = fake_cuda
    issuer = cuda_issue.CudaIssuer(nccl=None)
    out = FakeTensor(log, "out")
    second_started, second_ran = threading.Event(), threading.Event()

    def first_job():
        log.append(("first", "begins"))
        second_started.wait(5)
        second_ran.wait(0.3)  # long enough for the other thread's job, had it run
        log.append(("first", "ends"))

    def second_call():
        second_started.set()
        issuer.compressed(lambda: (log.append(("second", "runs")), second_ran.set()),
                          lambda: None, [out], [out], False)

    thread = threading.Thread(target=second_call)
    first = threading.Thread(target=lambda: issuer.compressed(first_job, lambda: None, [out],
                                                              [out], False))
    first.start()
    thread.start()
    first.join(10)
    thread.join(10)
    jobs = [e for e in log if e[0] in ("first", "second")]
    assert jobs == [("first", "begins"), ("first", "ends"), ("second", "runs")]
    assert ("wait_event", "current", "current") in log  # the second chained after the first


def test_graph_capture_takes_the_exact_path(fake_cuda):
    log, state = fake_cuda
    state["capturing"] = True
    issuer = cuda_issue.CudaIssuer(nccl=None)
    out = FakeTensor(log, "out")
    issuer.compressed(_job(log, state), _job(log, state, "exact"), [out], [out], True)
    assert log == [("exact", "current"), ("ready", "current", ["out"])]


class _ClosingCall:
    """A compressed call as `closing` settles it: ``close()`` counted."""

    verdict = None

    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_a_call_issued_during_a_graph_capture_leaves_no_place_open_and_no_canary(fake_cuda):
    """While a graph is captured the compressed call runs c10d's own call: its jobs are closed
    (their places settled, so the next call does not wait a timeout for them), and no canary,
    pinned buffer or event is made inside the capture."""
    log, state = fake_cuda
    state["capturing"] = True
    issuer = cuda_issue.CudaIssuer(nccl=None)
    out, call = FakeTensor(log, "out"), _ClosingCall()
    work = issuer.compressed(_job(log, state), _job(log, state, "exact"), [out], [out], True,
                             [call])
    assert call.closed == 1 and log == [("exact", "current"), ("ready", "current", ["out"])]
    assert issuer.canary(out, work) is None


class _FakeRun:
    """A place's run (`plan_run.PlanRun`) as the issuer sees it: calling it is logged."""

    verdict = None
    canary_entry = None

    def __init__(self, log: list, state: dict, tensor, output=None) -> None:
        self.log, self.state, self.tensor, self.output = log, state, tensor, output

    def __call__(self) -> list:
        self.log.append(("plan", self.state["current"].name, self.tensor.name)
                        + (() if self.output is None else (self.output.name,)))
        return [self.tensor if self.output is None else self.output]

    def describe(self) -> str:
        return "the plan's call"


class _FakeNccl:
    def __init__(self, log: list) -> None:
        self.log = log

    def allreduce(self, tensors, options) -> None:
        self.log.append(("nccl allreduce", [t.name for t in tensors]))


def test_a_place_plan_runs_on_the_calls_stream_and_goes_exact_while_captured(fake_cuda):
    import torch.distributed as dist

    log, state = fake_cuda
    issuer = cuda_issue.CudaIssuer(nccl=_FakeNccl(log))
    out = FakeTensor(log, "out")
    options = dist.AllreduceOptions()
    options.asyncOp = True
    work = issuer.run_plan(_FakeRun(log, state, out), ("allreduce", ([out], options)))
    assert isinstance(work, cuda_issue.StreamWork)
    assert log == [("wait_stream", "side1", "current"), ("plan", "side1", "out"),
                   ("record_stream", "out", "side1")]
    log.clear()  # a reduce-scatter's plan: the input read, the output written and returned
    inp = FakeTensor(log, "inp")
    rs_options = dist.ReduceScatterOptions()
    rs_options.asyncOp = False
    work = issuer.run_plan(_FakeRun(log, state, inp, out),
                           ("_reduce_scatter_base", (out, inp, rs_options)))
    # the previous call's event first (it ran on the side stream), then the plan on the current
    assert log == [("wait_event", "current", "side1"), ("plan", "current", "inp", "out")]
    assert work._outputs == [out]  # the Work's value: the reduce-scatter's output
    log.clear()
    state["capturing"] = True  # c10d's own call instead, and nothing of the call left open
    issuer.run_plan(_FakeRun(log, state, out), ("allreduce", ([out], options)))
    assert log == [("nccl allreduce", ["out"]), ("ready", "current", ["out"])]


class _RaisingRun(_FakeRun):
    def __call__(self) -> list:
        super().__call__()
        raise RuntimeError("a peer deviated")


def test_a_plan_that_raises_still_orders_the_next_call_after_its_work(fake_cuda):
    """A run that raises (after enqueuing its kernels, as `raise_deferred` does) leaves its
    stream's event for the next call, which may reuse the plan's kept buffers on another
    stream."""
    import torch.distributed as dist

    log, state = fake_cuda
    issuer = cuda_issue.CudaIssuer(nccl=None)
    out = FakeTensor(log, "out")
    options = dist.AllreduceOptions()
    options.asyncOp = True
    with pytest.raises(RuntimeError, match="deviated"):
        issuer.run_plan(_RaisingRun(log, state, out), ("allreduce", ([out], options)))
    log.clear()
    options.asyncOp = False
    issuer.run_plan(_FakeRun(log, state, out), ("allreduce", ([out], options)))
    assert log[0] == ("wait_event", "current", "side1"), log


def test_exact_calls_return_ncclss_work_or_a_stream_ordered_one(fake_cuda, monkeypatch):
    log, state = fake_cuda
    futures = []
    real_future = torch.futures.Future

    def future(devices):  # a CUDA-aware future needs CUDA devices; record them instead
        futures.append(devices)
        return real_future()

    monkeypatch.setattr(torch.futures, "Future", future)

    class FakeNccl:
        def __init__(self, result):
            self.result, self.calls = result, []

        def allreduce(self, tensors, opts):
            self.calls.append(("allreduce", opts))
            return self.result

    t = torch.ones(3)
    async_nccl = FakeNccl("nccl-work")
    assert cuda_issue.CudaIssuer(async_nccl).native("allreduce", [t], [t], "opts") == "nccl-work"
    assert async_nccl.calls == [("allreduce", "opts")]
    # synchronous mode: NCCL returns no Work (never None to a C++ caller); ours is an event
    # recorded after the call on the caller's stream, which wait() orders the waiter after
    sync = cuda_issue.CudaIssuer(FakeNccl(None)).native("allreduce", [t], [t], "opts")
    assert isinstance(sync, cuda_issue.StreamWork) and log == []
    state["current"] = FakeStream("waiter", log)
    assert sync.wait()
    assert log == [("wait_event", "waiter", "current")]
    assert futures == []  # built only when asked for
    assert sync.get_future().wait() == [t] and sync.result() == [t]
    assert sync.get_future() is sync.get_future() and len(futures) == 1
    state["capturing"] = True  # while a graph is captured: a ready future's Work
    captured = cuda_issue.CudaIssuer(FakeNccl(None)).native("allreduce", [t], [t], "opts")
    assert captured == ("work", (t,))


class FakeNcclGroup:
    """Records the options of each call; all-to-all and all-gather copy like one rank would."""

    def __init__(self, size: int = 1) -> None:
        self.options: list = []
        self._size = size

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return self._size

    def alltoall_base(self, recv, send, out_splits, in_splits, opts):
        self.options.append(opts)
        recv.copy_(send)

    def _allgather_base(self, recv, send, opts):
        self.options.append(opts)
        recv.copy_(send.repeat(self._size))


def test_nccl_transport_issues_synchronous_calls_and_returns_their_buffers():
    group = FakeNcclGroup()
    transport = NcclTransport(group)
    send = torch.arange(10, dtype=torch.uint8).view(1, 10)
    assert torch.equal(transport.all_to_all_async(send).wait(), send)
    assert torch.equal(transport.all_gather(send[0]), send)
    assert [o.asyncOp for o in group.options] == [False, False]
    with pytest.raises(NotImplementedError, match="direct, hierarchical"):
        transport.send_async(send, 0, 0)
    assert SCHEDULES == ("direct", "hierarchical")  # collectives only: no ring, no tree


def test_device_header_check_finds_foreign_and_flagged_messages_on_any_device():
    codec = ShardCodec(4, 32, 0, 7, 2, 99)
    x = torch.randn(2 * 100)
    messages = codec.encode(x, 2, 100, 1.0, None, 0.0, [0, 1], None).messages
    nonfinite, foreign = codec.check_on_device(messages, 100, [0, 1])
    assert not bool(nonfinite) and not bool(foreign)
    flagged = messages.clone()
    flagged[1, wire.FLAGS_OFFSET] = wire.FLAG_NONFINITE
    nonfinite, foreign = codec.check_on_device(flagged, 100, [0, 1])
    assert bool(nonfinite) and not bool(foreign)
    for offset in range(wire.HEADER_BYTES):  # every header byte is checked (unknown flags too)
        bad = messages.clone()
        bad[0, offset] ^= 0x40
        _, foreign = codec.check_on_device(bad, 100, [0, 1])
        assert bool(foreign), offset
    _, foreign = codec.check_on_device(messages, 100, [1, 0])  # shards swapped
    assert bool(foreign)


def test_nccl_links_make_node_and_rail_groups_on_first_use(monkeypatch):
    """The hierarchical schedule's links on CUDA: NCCL groups of the node's ranks
    and of the rail's, each on its own store prefix, made when first used, metered by link
    class."""
    import datetime

    import torch.distributed as dist

    from lowbitcc.counters import Stats
    from lowbitcc.transports import open_nccl_links

    made = []

    class FakeNccl:
        class Options:
            pass

        def __init__(self, store, rank, size, options=None) -> None:
            self._rank, self._size = rank, size
            made.append((store, rank, size, getattr(options, "_timeout", None)))

        def rank(self) -> int:
            return self._rank

        def size(self) -> int:
            return self._size

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNccl, raising=False)
    monkeypatch.setattr(dist, "PrefixStore", lambda prefix, store: prefix)
    timeout = datetime.timedelta(seconds=7)
    links = open_nccl_links(FakeNccl("world", 5, 8), Stats(), store=None,
                            global_ranks=list(range(8)), rank=5, timeout=timeout, node_size=4)
    assert made == [("world", 5, 8, None)]  # nothing more until a schedule asks
    assert (links.layout.nodes, links.layout.node_size, links.layout.node,
            links.layout.local) == (2, 4, 1, 1)
    node, rail = links.node(), links.rail()
    assert made[1:] == [("lowbitcc/nccl-node1", 1, 4, timeout),
                        ("lowbitcc/nccl-rail1", 1, 2, timeout)]
    assert (node.size, rail.size) == (4, 2) and links.node() is node
    assert node._same_node == [True] * 4 and rail._same_node == [False, True]
    assert links.world._same_node == [False] * 4 + [True] * 4
    assert "hierarchical" in SCHEDULES


def test_transport_choice_applies_to_cpu_tensors():
    assert cpu_kind("auto") == "gloo"
    assert cpu_kind("nccl") == "gloo"
    assert cpu_kind("mpi") == "mpi"


def test_mixed_backend_strings_are_refused(tmp_path):
    """Each spec in one process (a group's failed init leaves nothing behind)."""
    specs = ["cpu:gloo,cuda:loco", "cpu:loco,cuda:nccl"]
    code = textwrap.dedent(f"""
        import torch.distributed as dist, lowbitcc
        for i, spec in enumerate({specs!r}):
            try:
                dist.init_process_group(spec, init_method=f"file://{tmp_path}/s{{i}}", rank=0,
                                        world_size=1)
            except ValueError as exc:
                print(spec, "refused:", exc, flush=True)
            except Exception as exc:
                print(spec, "failed:", type(exc).__name__, exc, flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ})
    lines = {line.split(" ", 1)[0]: line for line in out.stdout.splitlines()}
    assert set(lines) == set(specs), out.stdout + out.stderr
    for spec, line in lines.items():
        if "cuda:nccl" in spec and "refused" not in line:
            # c10d builds nccl first on a CPU build and fails there (no NCCL): nothing is dropped
            assert "NCCL" in line, line
            continue
        assert "refused: lowbitcc: backend" in line and "pass backend='loco'" in line, line


def test_registered_for_cpu_and_cuda():
    import torch.distributed as dist

    import lowbitcc  # noqa: F401

    assert dist.Backend.backend_capability["loco"] == ["cpu", "cuda"]
