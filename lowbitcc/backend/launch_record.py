"""`LaunchRecord`: a call place's steady-state run recorded once on the host, as the list of
its CUDA launches and NCCL transfers with their arguments, and issued again from that list
(wherever a place can replay and ``call_graphs`` is off: "packed kernel arguments made once").

What a planned call does on the host is mostly making the same arguments again: the codec's
views and checks, the kernels' packed ``EncodeArgs``, ``RowCheck`` and ``FrameArgs``, the
NCCL call's flattened views. Once a place's tensor keeps its address those are the same bytes
run after run, save the call number in the headers, which the kernels can read from the
place's counter on the device (`interface.CallCount`, ``read``) as a graph's replay does. So
a record is made like a graph's capture (`place_graph.PlaceGraph`, which decides when, and
keeps the statistics and the compressor as for a graph): `capture` runs the plan's launch
path with the calling thread's launches appended to the record instead of launched
(`codec.launch_recording`) and the transfers prepared instead of issued
(`transports.nccl.NcclTransport.prepare_all_gather`); `replay` issues them in order on the
current stream: at two ranks an encode, an all-gather and a decode, without a Python object of
the codec's made.

Unlike a CUDA graph, a replay issues NCCL's calls eagerly, exactly as an eager run does, and
its kernels write exactly an eager run's bytes (its place replays only where the counter holds
the call's own number, `PlaceGraph.run`), so ranks may differ in whether they replay a call:
a rank whose tensor moved records again alone.

The record holds the addresses of the call's tensors (the plan's kept buffers, counter and
verdict words, which the plan keeps, and the call's tensor and output, which the place checks
before every replay) and references to the plan's kept buffers only. A path whose work a
record cannot repeat refuses while recording (`launch_recording.NotRecordableError`), and so
does any torch operation other than a view (`_OnlyViews`: a copy, a fill, an allocation would
be skipped by the replay); the run then goes eagerly.

**Issued from C++.** Where lowbitcc's C++ module is built (`native`) and CuPy sees a GPU, a
record is issued by one C++ call (`native_replay`, ``backend/csrc/launch_replay.h``): each
launch by the CUDA driver on the kernel's ``CUfunction`` (CuPy's, `cuda.function_handle`) with
the recorded arguments' bytes, each transfer on the inner NCCL backend (``_allgather_base``,
``alltoall_base``, synchronous), in order on the current stream, the GIL released; the
transfers' bytes are metered once per replay as their issues were. A step C++ cannot make (a
launch whose arguments are not NumPy scalars, a transfer over a group that is not a c10d
backend) is called back in Python in its place. Without the module or a GPU, the record's steps
are called in Python (`replay`). Tests without a GPU put kernel handles in `HANDLE` and a list
in `RECORDER`, which the C++ replay's launches are appended to.

Threads: the calling thread only (the issuer's), one call at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch._C._distributed_c10d import Backend as _C10dBackend
from torch.utils._python_dispatch import TorchDispatchMode

from lowbitcc.backend import native
from lowbitcc.codec import cuda, launch_recording
from lowbitcc.transports.metered import MeteredPrepared
from lowbitcc.transports.nccl import Enqueued, Prepared

log = logging.getLogger(__name__)

HANDLE: Callable[[torch.device, str], int] | None = None
"""A kernel's ``CUfunction`` for a C++ replay: None, CuPy's (`cuda.function_handle`) where CuPy
sees a GPU (else no C++ replay); tests without a GPU put a stand-in here."""
_WARNED: list[bool] = []
"""Non-empty once a C++ replay could not be made (warned once per process, then at debug)."""
RECORDER: list | None = None
"""None: a C++ replay launches through the CUDA driver; a list: it appends each launch there
instead, as ``(function, (grid_x, grid_y), block, stream, [argument bytes])`` (tests)."""

FREE_OPS = frozenset({"record_stream"})
"""Operations besides views a record may meet: they queue no device work."""


def recordable(transport: Any) -> bool:
    """Whether ``transport``'s transfers can be recorded (``records``: NCCL's, metered or
    not; a metered one counts its bytes at every issue, none while a record is made)."""
    return getattr(transport, "records", False)


class LaunchRecord:
    """The record of one run of ``plan`` (`call_plan.CallPlan`): the `place_graph` graph
    interface (`capture`, `replay`, `reset`)."""

    def __init__(self, plan: Any) -> None:
        self._plan = plan
        self._steps: list[Callable[[], Any]] = []
        self._native: Any = None  # the steps as a C++ `LaunchReplay`, where one is made
        self._meters: list[tuple[Any, int, int]] = []  # its transfers' metering

    def capture(self, body: Callable[[], Any]) -> None:
        """Record ``body`` (the plan's launch path) without issuing its work; raises where a
        step cannot be recorded."""
        plan, steps = self._plan, []
        transport = plan.transport
        plan.transport = _RecordingTransport(transport, steps)
        try:
            with launch_recording.recording(steps), _OnlyViews():
                body()
        finally:
            plan.transport = transport
        self._steps = steps
        try:
            self._native, self._meters = native_replay(steps, plan.device)
        except Exception:  # the record stays, issued in Python
            level = logging.DEBUG if _WARNED else logging.WARNING
            _WARNED.append(True)
            log.log(level, "lowbitcc: %s: a host record's C++ replay could not be made; its "
                    "steps are issued in Python (said once at warning level)", plan.describe(),
                    exc_info=True)
            self._native, self._meters = None, []

    def replay(self, stream: torch.cuda.Stream | None) -> None:
        """Issue the recorded launches and transfers, in order, on the current stream
        (``stream``: the caller's ``torch.cuda.current_stream`` of the plan's device; None off
        CUDA)."""
        if self._native is None:
            for step in self._steps:
                step()
            return
        seconds = self._native.replay(0 if stream is None else stream.cuda_stream)
        for meter, inside, across in self._meters:
            meter.stats.add_sent(meter.category, seconds, inside, across)
            seconds = 0.0

    def reset(self) -> None:
        self._steps, self._native, self._meters = [], None, []


def native_replay(steps: list[Callable[[], Any]], device: torch.device,
                  ) -> tuple[Any, list[tuple[Any, int, int]]]:
    """``steps`` (a record's, in order) as a C++ ``LaunchReplay`` on ``device``, and the
    metering of its transfers made in C++: ``(meter, bytes inside the node, across)`` per
    `MeteredTransport` (a replay adds them to the meter's statistics, and the seconds its
    transfers took to issue and wait for to the first's ``wire_s``: the direct schedule has one
    link; a replay that raises meters nothing); (None, []) where there is no C++ module or no
    kernel handle, or ``device`` is not CUDA and no `RECORDER` is set (see the module
    docstring)."""
    if device.type != "cuda" and RECORDER is None:  # (tests' meta plans: Python's launcher)
        return None, []
    module = native.load()
    handle = HANDLE if HANDLE is not None else (cuda.function_handle if cuda.available()
                                                else None)
    if module is None or handle is None:
        return None, []
    index = -1 if device.type != "cuda" else (
        device.index if device.index is not None else torch.cuda.current_device())
    replay = module.LaunchReplay(index, RECORDER)
    meters: dict[int, list] = {}
    for step in steps:
        if isinstance(step, cuda.RecordedLaunch) and _scalars(step.args):
            grid = (*step.grid, 1, 1)[:2] if isinstance(step.grid, tuple) else (step.grid, 1)
            if 0 not in grid:  # (`cuda._launch` launches nothing either)
                replay.add_kernel(handle(step.device, step.name), grid[0], grid[1],
                                  cuda.THREADS, [arg.tobytes() for arg in step.args])
            continue
        prepared = step.prepared if isinstance(step, RecordedTransfer) else None
        inner = prepared.inner if isinstance(prepared, MeteredPrepared) else prepared
        if isinstance(inner, Prepared) and isinstance(inner.group, _C10dBackend):
            replay.add_transfer(inner.group, inner.all_to_all, inner.received, inner.send)
            if inner is not prepared:
                counted = meters.setdefault(id(prepared.meter), [prepared.meter, 0, 0])
                counted[1] += prepared.sent[0]
                counted[2] += prepared.sent[1]
            continue
        replay.add_call(step)
    return replay, [tuple(m) for m in meters.values()]


class RecordedTransfer:
    """A transfer a record holds (`_RecordingTransport`): ``prepared`` (`nccl.Prepared`, or
    metered); calling it issues it again, the current stream ordered after it."""

    __slots__ = ("prepared",)

    def __init__(self, prepared: Any) -> None:
        self.prepared = prepared

    def __call__(self) -> None:
        self.prepared.issue_ordered()


def _scalars(args: tuple) -> bool:
    """Whether every argument is a NumPy scalar (its bytes are what CuPy passes)."""
    return all(isinstance(arg, np.generic) for arg in args)


class _RecordingTransport:
    """The plan's transport while it records: each transfer prepared and appended to the
    record; its receive buffer handed back as the transfer's."""

    def __init__(self, transport: Any, steps: list[Callable[[], Any]]) -> None:
        self._transport, self._steps = transport, steps

    @property
    def rank(self) -> int:
        return self._transport.rank

    @property
    def size(self) -> int:
        return self._transport.size

    def all_gather_async(self, send: torch.Tensor, out: torch.Tensor | None = None) -> Enqueued:
        return self._recorded(self._transport.prepare_all_gather(send, out))

    def all_to_all_async(self, send: torch.Tensor, out: torch.Tensor | None = None) -> Enqueued:
        return self._recorded(self._transport.prepare_all_to_all(send, out))

    def _recorded(self, prepared: Any) -> Enqueued:
        self._steps.append(RecordedTransfer(prepared))
        return Enqueued(None, prepared.recv)


class _OnlyViews(TorchDispatchMode):
    """Refuses every torch operation but views and `FREE_OPS` while a record is made."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket.__name__ not in FREE_OPS:
            raise launch_recording.NotRecordableError(
                f"lowbitcc: a call's launches cannot be recorded: it runs {func}")
        return func(*args, **(kwargs or {}))
