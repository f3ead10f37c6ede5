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

Threads: the calling thread only (the issuer's), one call at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lowbitcc.codec import launch_recording
from lowbitcc.transports.nccl import Enqueued

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

    def replay(self) -> None:
        """Issue the recorded launches and transfers, in order, on the current stream."""
        for step in self._steps:
            step()

    def reset(self) -> None:
        self._steps = []


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
        self._steps.append(prepared.issue_ordered)
        return Enqueued(None, prepared.recv)


class _OnlyViews(TorchDispatchMode):
    """Refuses every torch operation but views and `FREE_OPS` while a record is made."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket.__name__ not in FREE_OPS:
            raise launch_recording.NotRecordableError(
                f"lowbitcc: a call's launches cannot be recorded: it runs {func}")
        return func(*args, **(kwargs or {}))
