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
        recv = torch.empty(send.numel(), dtype=send.dtype)
        self.group.alltoall_base(recv, send.reshape(-1), [], [], dist.AllToAllOptions()).wait()
        return recv.view(send.shape)

    def all_gather(self, send: torch.Tensor) -> torch.Tensor:
        recv = torch.empty(self.size * send.numel(), dtype=send.dtype)
        self.group._allgather_base(recv, send.reshape(-1).contiguous(), AllgatherOptions()).wait()
        return recv.view(self.size, -1)
