"""Gloo transport: byte messages over an inner `ProcessGroupGloo` (TCP), CPU tensors."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions


class GlooTransport:
    """`Transport` over ``group``, a gloo backend owned by the caller."""

    def __init__(self, group: dist.ProcessGroupGloo) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        return self.all_to_all_async(send).wait()

    def all_gather(self, send: torch.Tensor) -> torch.Tensor:
        return self.all_gather_async(send).wait()

    def all_to_all_async(self, send: torch.Tensor) -> "_GlooPending":
        recv = torch.empty(send.numel(), dtype=send.dtype)
        work = self.group.alltoall_base(recv, send.reshape(-1), [], [], dist.AllToAllOptions())
        return _GlooPending(work, recv.view(send.shape), send)

    def all_gather_async(self, send: torch.Tensor) -> "_GlooPending":
        recv = torch.empty(self.size * send.numel(), dtype=send.dtype)
        flat = send.reshape(-1).contiguous()
        work = self.group._allgather_base(recv, flat, AllgatherOptions())
        return _GlooPending(work, recv.view(self.size, -1), flat)


class _GlooPending:
    """A gloo Work and its receive buffer; holds the send buffer alive until waited."""

    def __init__(self, work: dist.Work, recv: torch.Tensor, send: torch.Tensor) -> None:
        self.work, self.recv, self.send = work, recv, send

    def wait(self) -> torch.Tensor:
        self.work.wait()
        self.send = None
        return self.recv
