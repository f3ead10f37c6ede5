"""Gloo transport: byte messages over an inner `ProcessGroupGloo` (TCP), CPU tensors."""

from __future__ import annotations

import collections
import time
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from lowbitcc.transports.base import received

RETAIN_S = 0.5
"""How long a transport keeps a finished gloo Work referenced from Python (see `retire`)."""
RETAIN_LAST = 4
"""... and the last this many, however old."""


class GlooTransport:
    """`Transport` over ``group``, a gloo backend owned by the caller."""

    def __init__(self, group: dist.ProcessGroupGloo) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self._retired: collections.deque[tuple[float, Any]] = collections.deque()

    def retire(self, work: dist.Work) -> None:
        """Keep a finished ``work`` referenced from Python for a while.

        A gloo worker thread drops its own reference to a Work just *after* marking it done.
        If that is the last reference, the thread frees the Work's tensors, which takes the
        GIL; when that happens while the interpreter is finalizing, the thread is killed inside
        a destructor and the process aborts ("terminate called without an active exception";
        plain gloo does this too, about one exit in five under mpiexec here). Holding the
        Works finished in the last `RETAIN_S` seconds (and the last `RETAIN_LAST`) from Python
        makes the gloo thread's release never the last one: the tensors are freed by Python,
        with the GIL, when the Work leaves this window. The window is short so that large
        buffers are not kept alive (at most what the last half second moved).
        """
        now = time.monotonic()
        self._retired.append((now, work))
        while len(self._retired) > RETAIN_LAST and self._retired[0][0] < now - RETAIN_S:
            self._retired.popleft()

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        return self.all_to_all_async(send).wait()

    def all_gather(self, send: torch.Tensor) -> torch.Tensor:
        return self.all_gather_async(send).wait()

    def all_to_all_async(self, send: torch.Tensor,
                         out: torch.Tensor | None = None) -> _GlooPending:
        recv = received(out, send.numel(), send)
        work = self.group.alltoall_base(recv, send.reshape(-1), [], [], dist.AllToAllOptions())
        return _GlooPending(self, work, recv.view(send.shape), send)

    def all_gather_async(self, send: torch.Tensor,
                         out: torch.Tensor | None = None) -> _GlooPending:
        recv = received(out, self.size * send.numel(), send)
        flat = send.reshape(-1).contiguous()
        work = self.group._allgather_base(recv, flat, AllgatherOptions())
        return _GlooPending(self, work, recv.view(self.size, -1), flat)

    def send_async(self, send: torch.Tensor, peer: int, tag: int) -> _GlooPending:
        flat = send.reshape(-1).contiguous()
        return _GlooPending(self, self.group.send([flat], peer, tag), flat, flat)

    def recv_async(self, nbytes: int, peer: int, tag: int) -> _GlooPending:
        recv = torch.empty(nbytes, dtype=torch.uint8)
        return _GlooPending(self, self.group.recv([recv], peer, tag), recv, None)


class _GlooPending:
    """A gloo Work and its receive buffer; holds the send buffer alive until waited."""

    def __init__(
        self, transport: GlooTransport, work: dist.Work, recv: torch.Tensor,
        send: torch.Tensor | None,
    ) -> None:
        self.transport, self.work, self.recv, self.send = transport, work, recv, send

    def wait(self) -> torch.Tensor:
        self.work.wait()
        self.transport.retire(self.work)
        self.send = None
        return self.recv
