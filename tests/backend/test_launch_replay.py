"""A place's host record issued from C++ (`launch_record.native_replay`,
``backend/csrc/launch_replay.h``), without a GPU: the kernels' launches go to a recorder in place
of the CUDA driver (`launch_record.RECORDER`, with stand-in kernel handles in
`launch_record.HANDLE`), and are compared with the launches the Python path makes, and once
through the driver's own entry points (a stand-in ``libcuda.so.1`` that logs each call,
``tests/support/fake_cuda_driver.c``); the transfers run for real on gloo over 2 processes (a
c10d backend, as ProcessGroupNCCL is on a GPU). On a GPU the same replay launches through the
real ``cuLaunchKernel`` (the GPU suite's ``plans`` and ``goals`` phases)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import torch.distributed as dist

from lowbitcc import state
from lowbitcc.backend import launch_record, native
from lowbitcc.backend.place_graph import CAPTURE_AT
from lowbitcc.codec import cuda
from lowbitcc.codec.cuda_build import COUNT_ADD, ROW_CHECK
from lowbitcc.counters import Stats
from lowbitcc.feedback import FeedbackStore
from lowbitcc.transports.metered import MeteredTransport
from lowbitcc.transports.nccl import NcclTransport
from tests.support.cuda_trace import GpuWork, meta_plan
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.skipif(native.load() is None, reason="lowbitcc's C++ module not built")


class _Handles(dict):
    """Stand-in ``CUfunction`` handles: one number per kernel name."""

    def __call__(self, device: torch.device, name: str) -> int:
        return self.setdefault(name, 0x1000 + len(self))


@pytest.fixture
def replayed(monkeypatch) -> tuple[_Handles, list, list]:
    """(the kernel handles, the C++ replay's launches, the Python path's launches as the C++
    recorder writes them)."""
    handles, native_launches, python_launches = _Handles(), [], []

    def launch(name, device, grid, args):
        grid = grid if isinstance(grid, tuple) else (grid, 1)
        if 0 not in grid:
            python_launches.append((handles(device, name), grid, cuda.THREADS, 0,
                                    [arg.tobytes() for arg in args]))

    monkeypatch.setattr(cuda, "_launch", launch)
    monkeypatch.setattr(launch_record, "HANDLE", handles)
    monkeypatch.setattr(launch_record, "RECORDER", native_launches)
    monkeypatch.setattr(state, "FEEDBACK", FeedbackStore())
    monkeypatch.setattr(state, "STATS", Stats())
    return handles, native_launches, python_launches


@pytest.mark.parametrize("world,collective", [(2, "all_reduce"), (4, "all_reduce"),
                                              (4, "reduce_scatter")])
def test_a_record_issued_from_cpp_launches_what_was_recorded_and_what_an_eager_run_does(
        world, collective, replayed):
    """Run after run, a place whose record is issued by the C++ replay launches, with no Python
    launch, exactly the recorded launches (kernel handle, grid, block, stream, every argument's
    bytes), which are the eager plan's kernels with the same arguments save the call number's
    (a record reads the place's counter and advances it, an eager run writes it); it issues the
    same transfers and counts the same bytes sent."""
    handles, native_launches, python_launches = replayed
    work, eager_work = GpuWork(), GpuWork()
    stats, eager_stats = Stats(), Stats()
    plan, x, out = meta_plan(work, world, 1 << 16, "nvfp4", collective, feedback=False,
                             stats=stats)
    eager, y, out_e = meta_plan(eager_work, world, 1 << 16, "nvfp4", collective, feedback=False,
                                replay=False, stats=eager_stats)
    for run in range(1, 9):
        native_launches.clear()
        python_launches.clear()
        work.nccl.clear()
        eager_work.nccl.clear()
        state.STATS = stats
        plan.run(x, dist.ReduceOp.SUM, out)
        mine = native_launches + python_launches
        if run >= CAPTURE_AT:  # issued from the record, by C++ alone
            record = plan.graph._graphs[plan.turn][0]
            assert record._native is not None and not python_launches
            assert native_launches == [
                (handles(step.device, step.name), step.grid if isinstance(step.grid, tuple)
                 else (step.grid, 1), cuda.THREADS, 0, [arg.tobytes() for arg in step.args])
                for step in record._steps if isinstance(step, cuda.RecordedLaunch)]
            assert record._native.native_steps == len(native_launches)  # NCCL's: stand-ins
            last = np.frombuffer(native_launches[-1][4][-1], dtype=ROW_CHECK)["count"]
            assert int(last["read"][0]) == 1 and int(last["mode"][0]) == COUNT_ADD
        mine = list(mine)
        python_launches.clear()
        state.STATS = eager_stats
        eager.run(y, dist.ReduceOp.SUM, out_e)
        theirs = list(python_launches)
        assert [m[:4] for m in mine] == [t[:4] for t in theirs]
        assert [len(m[4]) for m in mine] == [len(t[4]) for t in theirs]
        if run < CAPTURE_AT:
            assert mine == theirs
        assert work.nccl == eager_work.nccl
        assert stats.sent("compressed") == eager_stats.sent("compressed")
    assert plan.graph.replays == 6 and plan.seq == eager.seq == 8


@pytest.mark.parametrize("world", [2, 4])
def test_a_record_over_a_c10d_backend_is_issued_without_a_python_step(world, replayed):
    """Over a c10d backend (torch's C++ ``FakeProcessGroup`` in place of ProcessGroupNCCL) every
    step of a record is made in C++: a replay calls no Python function but the record's own
    `replay` and its transfers' metering (traced with ``sys.setprofile``), which counts the
    bytes an eager run sends."""
    import sys

    stats = Stats()
    plan, x, _ = meta_plan(GpuWork(), world, 1 << 16, "nvfp4", feedback=False, stats=stats,
                           c10d=True)
    sent = []  # the bytes each run sent: eager runs, then replays
    for _ in range(CAPTURE_AT + 1):
        before = stats.sent("compressed")["wire_bytes"]
        plan.run(x, dist.ReduceOp.SUM)
        sent.append(stats.sent("compressed")["wire_bytes"] - before)
    assert plan.graph.replays == 2 and len(set(sent)) == 1 and sent[0] > 0
    record = plan.graph._graphs[plan.turn][0]
    assert record._native.native_steps == len(record._native) == len(record._steps)
    called: list[str] = []

    def trace(frame, event, arg):
        if event == "call":
            called.append(frame.f_code.co_name)

    before = stats.sent("compressed")["wire_bytes"]
    sys.setprofile(trace)
    try:
        record.replay(None)
    finally:
        sys.setprofile(None)
    assert called == ["replay", "add_sent"], called  # the record's, and its metering
    assert stats.sent("compressed")["wire_bytes"] - before == sent[0]


def _gloo_steps(rank: int, world: int, gloo) -> dict:
    """A record of kernels and transfers on a real gloo backend, issued by C++ twice."""
    import lowbitcc.backend.launch_record as lr
    from lowbitcc.codec import cuda as cuda_module

    backend = gloo._get_backend(torch.device("cpu"))
    events: list = []
    lr.HANDLE = lambda device, name: {"encode": 11, "decode": 12}[name]
    lr.RECORDER = events
    cuda_module._launch = lambda name, device, grid, args: events.append(("python", name))
    stats = Stats()
    send = torch.full((6,), rank + 1, dtype=torch.uint8)
    rows = torch.arange(world * 3, dtype=torch.uint8) + 10 * rank
    gather = MeteredTransport(NcclTransport(backend), stats).prepare_all_gather(send)
    spread = NcclTransport(backend).prepare_all_to_all(rows.view(world, 3))
    seen: list = []
    steps = [
        cuda_module.RecordedLaunch("encode", torch.device("cpu"), 3,
                                   (np.uint64(0xABCDEF), np.int32(-2), np.float32(0.5))),
        launch_record.RecordedTransfer(gather),
        lambda: seen.append(gather.recv.clone()),  # after the all-gather: what it received
        launch_record.RecordedTransfer(spread),
        cuda_module.RecordedLaunch("decode", torch.device("cpu"), (2, 5), (np.int64(7),)),
        cuda_module.RecordedLaunch("decode", torch.device("cpu"), (4,), (np.int64(8),)),
        cuda_module.RecordedLaunch("decode", torch.device("cpu"), 0, (np.int64(7),)),  # none
        cuda_module.RecordedLaunch("encode", torch.device("cpu"), 1, (7,)),  # not a scalar
    ]
    replay, meters = launch_record.native_replay(steps, torch.device("cpu"))
    seconds = []
    for value in (rank + 1, rank + 50):
        send.fill_(value)
        rows.add_(1)
        seconds.append(replay.replay(123))
        for meter, inside, across in meters:
            meter.stats.add_sent(meter.category, 0.0, inside, across)
    expected = [torch.empty(6, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(expected, send, group=gloo)
    return {"events": [e if e[0] == "python" else (e[0], e[1], e[2], e[3], [bytes(a) for a in e[4]])
                       for e in events],
            "seen": [s.tolist() for s in seen], "last": [e.tolist() for e in expected],
            "spread": spread.recv.tolist(), "rows": rows.tolist(), "sent": stats.sent("compressed"),
            "native": replay.native_steps, "steps": len(replay), "seconds": seconds}


def test_a_record_issued_from_cpp_makes_its_transfers_on_the_c10d_backend_in_order():
    """On 2 ranks over gloo's c10d backend: each replay issues its all-gather and all-to-all on
    the backend itself, in record order (a Python step after the all-gather sees what arrived),
    re-reading the send buffers each time; launches go out with their handle, grid, block, the
    caller's stream and their arguments' bytes; a launch of no block is left out and a launch
    whose arguments are not NumPy scalars runs in Python; a grid given as (x,) is (x, 1); the
    metered transfer's bytes are counted per replay."""
    results = run_ranks(_gloo_steps, 2)
    for rank, result in enumerate(results):
        kernel = (11, (3, 1), cuda.THREADS, 123,
                  [np.uint64(0xABCDEF).tobytes(), np.int32(-2).tobytes(), np.float32(0.5).tobytes()])
        decode = (12, (2, 5), cuda.THREADS, 123, [np.int64(7).tobytes()])
        row = (12, (4, 1), cuda.THREADS, 123, [np.int64(8).tobytes()])
        assert result["events"] == [kernel, decode, row, ("python", "encode")] * 2
        assert result["seen"] == [[[1] * 6, [2] * 6], [[50] * 6, [51] * 6]]
        assert result["last"] == result["seen"][-1]
        peer_rows = [[10 * r + 3 * rank + i + 2 for i in range(3)] for r in range(2)]
        assert result["spread"] == peer_rows
        assert result["sent"]["wire_bytes"] == 2 * 6  # two replays, one peer, 6 bytes each
        assert result["native"] == 5 and result["steps"] == 7
        assert all(s >= 0.0 for s in result["seconds"])


def test_a_replay_without_the_cuda_driver_raises_a_clear_error():
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("a CUDA driver is installed here")
    except OSError:
        pass
    replay = native.load().LaunchReplay(-1, None)
    replay.add_kernel(0x10, 1, 1, cuda.THREADS, [b"\0" * 8])
    with pytest.raises(RuntimeError, match="lowbitcc: .*CUDA driver"):
        replay.replay(0)


def test_a_record_whose_cpp_replay_cannot_be_made_is_issued_in_python(replayed, caplog,
                                                                        monkeypatch):
    """Where the C++ replay cannot be made (here a kernel handle that cannot be looked up), the
    place still replays its record, step by step in Python, and says why: at warning level once
    per process, then at debug level."""
    _, native_launches, python_launches = replayed

    def no_handle(device, name):
        raise AttributeError("no kernel handle here")

    launch_record.HANDLE = no_handle
    monkeypatch.setattr(launch_record, "_WARNED", [])
    caplog.set_level(logging.DEBUG, logger=launch_record.log.name)
    plan, x, _ = meta_plan(GpuWork(), 2, 1 << 16, "nvfp4", feedback=False)
    for _ in range(CAPTURE_AT + 1):
        plan.run(x, dist.ReduceOp.SUM)
    assert plan.graph.replays == 2 and not plan.graph.off
    assert plan.graph._graphs[plan.turn][0]._native is None
    assert python_launches and not native_launches
    other, y, _ = meta_plan(GpuWork(), 2, 1 << 16, "nvfp4", feedback=False)
    for _ in range(CAPTURE_AT + 1):  # another place's record: said again at debug level
        other.run(y, dist.ReduceOp.SUM)
    assert other.graph.replays == 2
    warned = [r for r in caplog.records if "C++ replay could not be made" in r.getMessage()]
    levels = [r.levelname for r in warned]  # a record per verdict word, two per place here
    assert levels == ["WARNING"] + ["DEBUG"] * (len(levels) - 1) and len(levels) == 4


def test_the_installed_cupy_gives_a_kernel_s_cufunction_as_the_replay_reads_it():
    """`cuda.function_handle` reads a ``RawKernel``'s ``kernel`` (the current device's
    ``Function``) and its ``ptr``: both are there in the installed CuPy (no GPU needed)."""
    cupy = pytest.importorskip("cupy")
    from cupy.cuda import function

    assert hasattr(cupy.RawKernel, "kernel") and hasattr(function.Function, "ptr")
    assert not hasattr(cupy.RawKernel, "ptr")  # (a RawKernel's own handle is not there)


def test_a_kernel_handle_is_its_raw_kernel_s_function_on_the_device(monkeypatch):
    """`cuda.function_handle` asks CuPy's kernel of that name (a ``RawKernel``, which has no
    ``ptr`` of its own) for its ``Function`` while ``device``'s index is CuPy's current device."""
    import contextlib
    import types

    devices: list[int] = []

    @contextlib.contextmanager
    def device(index):
        devices.append(index)
        yield

    class RawKernel:  # what `RawModule.get_function` gives: a handle only through `.kernel`
        __slots__ = ()

        @property
        def kernel(self):
            assert devices, "the kernel's Function read outside its device"
            return types.SimpleNamespace(ptr=0x5EED + devices[-1])

    monkeypatch.setattr(cuda, "cupy", lambda: types.SimpleNamespace(
        cuda=types.SimpleNamespace(Device=device)))
    monkeypatch.setattr(cuda, "_function", lambda index, name: RawKernel())
    assert cuda.function_handle(torch.device("cuda", 3), "encode") == 0x5EED + 3
    assert devices == [3]


_THROUGH_THE_DRIVER = """
import ctypes, sys
import numpy as np, torch
from lowbitcc.backend import launch_record, native
from lowbitcc.codec import cuda

try:
    driver = ctypes.CDLL("libcuda.so.1")
    assert driver.lowbitcc_fake_cuda_driver
except (OSError, AttributeError) as error:
    print("no stand-in driver:", error)
    sys.exit(0)

launch_record.HANDLE = lambda device, name: {"encode": 0x11, "decode": 0x12}[name]
device = torch.device("cuda", 0)  # a device object only: no tensor is made
steps = [cuda.RecordedLaunch("encode", device, 3,
                             (np.uint64(0xABCDEF), np.int32(-2), np.float32(0.5))),
         cuda.RecordedLaunch("decode", device, (2, 5), (np.int64(7),))]
replay, meters = launch_record.native_replay(steps, device)
assert replay.native_steps == 2 and meters == []
replay.replay(0xABC)
replay.replay(0xABD)
driver.cuCtxSetCurrent(ctypes.c_void_p(0x1001))  # device 1's context current: left as found
replay.replay(0)
bad = native.load().LaunchReplay(0, None)
bad.add_kernel(0xBAD, 1, 1, 256, [bytes(8)])
try:
    bad.replay(0)
except RuntimeError as error:
    print("raised:", error)
"""


def test_a_replay_calls_the_cuda_driver_with_the_recorded_launches(tmp_path):
    """Through the driver itself (a stand-in ``libcuda.so.1`` built here,
    ``tests/support/fake_cuda_driver.c``, that logs each call): a replay of a record on a CUDA
    device makes the device's primary context current where the thread has none (once, then
    it stays), or where another device's is (which is current again after the launches), then
    launches each kernel by its handle with its grid, the block of `cuda.THREADS`, no shared
    memory, the caller's stream and each argument's bytes as kernel parameters; a failed launch
    raises the driver's error by name."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    source = Path(__file__).parents[1] / "support" / "fake_cuda_driver.c"
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(tmp_path / "libcuda.so.1"),
                    str(source)], check=True)
    log = tmp_path / "driver.log"
    env = {**os.environ, "LD_LIBRARY_PATH": f"{tmp_path}:{os.environ.get('LD_LIBRARY_PATH', '')}",
           "FAKE_CUDA_LOG": str(log), "FAKE_CUDA_SIZES_11": "8,4,4", "FAKE_CUDA_SIZES_12": "8"}
    done = subprocess.run([sys.executable, "-c", _THROUGH_THE_DRIVER], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    if "no stand-in driver" in done.stdout:
        pytest.skip(done.stdout.strip())
    assert ("raised: lowbitcc: cuLaunchKernel of a host record's step failed: "
            "CUDA_ERROR_ILLEGAL_ADDRESS (700)") in done.stdout, done.stdout
    encode = " ".join(a.tobytes().hex() for a in (np.uint64(0xABCDEF), np.int32(-2),
                                                   np.float32(0.5)))
    decode = np.int64(7).tobytes().hex()
    t = cuda.THREADS
    def launches(stream: str) -> list[str]:
        return [f"launch 11 3 1 1 {t} 1 1 0 {stream} - {encode}",
                f"launch 12 2 5 1 {t} 1 1 0 {stream} - {decode}"]

    expected = ["retain 0", "set 0x1000", *launches("abc"), *launches("abd"),
                "set 0x1001", "retain 0", "set 0x1000", *launches("0"), "set 0x1001",
                "retain 0", "set 0x1000", f"launch bad 1 1 1 {t} 1 1 0 0 -", "set 0x1001"]
    assert log.read_text().splitlines() == expected
