"""NCCL transport: byte messages over an inner ``ProcessGroupNCCL``, CUDA tensors.

Every transfer is issued in synchronous mode (``asyncOp = False``): ProcessGroupNCCL then
enqueues it on the calling thread's *current* CUDA stream and returns no Work
(``ProcessGroupNCCL::collective``: "in asyncOp=false mode, we use currentStream as
ncclStream"; see docs/gpu.md). So a transfer is ordered after the encode kernel that filled its
buffer and before the decode kernel that reads what arrived, on one stream, with no host
synchronisation; "waiting" for it returns at once.

Only the collective methods exist: point-to-point transfers issued one by one from one thread
can deadlock on the GPU (a rank's send kernel waits for its peer's receive, enqueued behind
the peer's own send), so the schedules that need them (ring, tree) are refused for CUDA
tensors; `SCHEDULES` names the ones that run. The hierarchical schedule needs only
collectives, on the node's ranks and on the rail's: `sub_group` makes those communicators, on
first use, each its own ``ProcessGroupNCCL`` on the group's store.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from lowbitcc.transports.base import received

SCHEDULES = ("direct", "hierarchical")
"""The compressed schedules that run over this transport."""


def sub_group(store: dist.Store, name: str, color: int, key: int, size: int,
              timeout: datetime.timedelta) -> Any:
    """A ``ProcessGroupNCCL`` over the ranks of a group that passed the same ``name`` ("node" or
    "rail") and ``color`` (`links.SubTransport`), this rank being ``key`` of ``size``, on its
    own prefix of the group's ``store``. NCCL makes its communicator at the first transfer."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    options.is_high_priority_stream = False
    prefixed = dist.PrefixStore(f"lowbitcc/nccl-{name}{color}", store)
    return dist.ProcessGroupNCCL(prefixed, key, size, options)


def _sync(options: Any) -> Any:
    options.asyncOp = False
    return options


class NcclTransport:
    """`Transport` over ``group``, a ``ProcessGroupNCCL`` owned by the caller; every transfer
    runs on the current CUDA stream of the calling thread."""

    records = True
    """Its transfers can be prepared once and issued again (`prepare_all_gather`)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        return self.all_to_all_async(send).wait()

    def all_gather(self, send: torch.Tensor) -> torch.Tensor:
        return self.all_gather_async(send).wait()

    def all_to_all_async(self, send: torch.Tensor, out: torch.Tensor | None = None) -> Enqueued:
        return self.prepare_all_to_all(send, out).issue()

    def all_gather_async(self, send: torch.Tensor, out: torch.Tensor | None = None) -> Enqueued:
        return self.prepare_all_gather(send, out).issue()

    def prepare_all_to_all(self, send: torch.Tensor, out: torch.Tensor | None = None) -> Prepared:
        """`all_to_all_async`'s transfer, ready to be issued, as often as asked (each issue
        reads ``send`` and writes its receive buffer, ``out`` where given, anew)."""
        flat = send.reshape(-1).contiguous()
        recv = received(out, flat.numel(), flat)
        return Prepared(self.group, True, recv, flat, recv.view(send.shape))

    def prepare_all_gather(self, send: torch.Tensor, out: torch.Tensor | None = None) -> Prepared:
        """`all_gather_async`'s transfer, ready to be issued (as `prepare_all_to_all`'s)."""
        flat = send.reshape(-1).contiguous()
        recv = received(out, self.size * flat.numel(), flat)
        return Prepared(self.group, False, recv, flat, recv.view(self.size, -1))

    def send_async(self, send: torch.Tensor, peer: int, tag: int) -> Enqueued:
        raise NotImplementedError(_NO_P2P)

    def recv_async(self, nbytes: int, peer: int, tag: int) -> Enqueued:
        raise NotImplementedError(_NO_P2P)


_NO_P2P = ("lowbitcc: the nccl transport has no point-to-point transfers; compressed calls on "
           f"CUDA tensors run the {', '.join(SCHEDULES)} schedule")


class Prepared:
    """A transfer made ready (`NcclTransport.prepare_all_gather`): `issue` enqueues it on the
    current stream, an all-gather (or with ``all_to_all`` an all-to-all of equal rows) of the
    flat ``send`` into the flat ``received`` on ``group``; ``recv`` is ``received`` as the
    caller sees it. A C++ replay of a record (`backend.launch_record`) issues the same call
    from these fields."""

    def __init__(self, group: Any, all_to_all: bool, received: torch.Tensor, send: torch.Tensor,
                 recv: torch.Tensor) -> None:
        self.group, self.all_to_all, self.received, self.send = group, all_to_all, received, send
        self.recv = recv
        self._options = _sync(dist.AllToAllOptions() if all_to_all else AllgatherOptions())

    def issue(self) -> Enqueued:
        if self.all_to_all:
            work = self.group.alltoall_base(self.received, self.send, [], [], self._options)
        else:
            work = self.group._allgather_base(self.received, self.send, self._options)
        return Enqueued(work, self.recv)

    def issue_ordered(self) -> None:
        """`issue`, the current stream ordered after it (`Enqueued.wait`)."""
        self.issue().wait()


class Enqueued:
    """A transfer enqueued on the current stream: `wait` returns its receive buffer at once
    (the buffer is valid for work enqueued after it on that stream)."""

    def __init__(self, work: Any, recv: torch.Tensor) -> None:
        self.work, self.recv = work, recv

    def wait(self) -> torch.Tensor:
        if self.work is not None:  # a build that ignores asyncOp: order the current stream
            self.work.wait()
        return self.recv
