"""MPI transport: byte messages over an mpi4py communicator (CPU tensors).

Needs ranks started by an MPI launcher (``mpiexec -n N``) and mpi4py (``pip install
'lowbitcc[mpi]'`` brings MPICH's wheel). Every operation is non-blocking MPI (``Isend``,
``Irecv``, ``Ialltoall``, ``Iallgather``); ``wait()`` polls its request so that a dead or
stalled peer raises `TimeoutError` after ``timeout_s`` instead of blocking forever, which
MPI itself never does. A request that timed out cannot be cancelled: the group is unusable
afterwards, as an NCCL communicator is after its watchdog fires.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from lowbitcc.transports.base import received

POLL_MAX_S = 0.001


def mpi() -> Any:
    """The ``mpi4py.MPI`` module, or a RuntimeError saying how to get it."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise RuntimeError(
            "lowbitcc: LOCO_TRANSPORT=mpi needs mpi4py (pip install 'lowbitcc[mpi]')"
        ) from exc
    return MPI


def communicator(global_ranks: Sequence[int], group_rank: int) -> Any:
    """The communicator of the MPI world ranks ``global_ranks`` (in group-rank order), seen
    from the member of group rank ``group_rank``.

    Torch's global ranks must be the MPI world ranks, which holds when ``mpiexec`` started the
    processes and ``init_process_group`` took its ranks from the launcher; anything else
    raises a RuntimeError saying so. Collective over the members only. The result is a new
    communicator (a ``Dup`` for the whole world), so that two groups never match each other's
    messages.
    """
    MPI = mpi()
    world = MPI.COMM_WORLD
    ranks = list(global_ranks)
    if world.Get_size() == 1 < len(ranks) or max(ranks) >= world.Get_size():
        raise RuntimeError(
            f"lowbitcc: LOCO_TRANSPORT=mpi but MPI sees {world.Get_size()} process(es) for "
            f"torch ranks up to {max(ranks)}: start the ranks with mpiexec -n N"
        )
    if ranks[group_rank] != world.Get_rank():
        raise RuntimeError(
            f"lowbitcc: LOCO_TRANSPORT=mpi but torch global rank {ranks[group_rank]} is MPI "
            f"rank {world.Get_rank()}: let init_process_group take RANK from mpiexec"
        )
    if ranks == list(range(world.Get_size())):
        return world.Dup()
    return world.Create_group(world.Get_group().Incl(ranks))


class MpiTransport:
    """`Transport` over ``comm``; ``timeout_s`` bounds every wait."""

    def __init__(self, comm: Any, timeout_s: float) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout_s = timeout_s

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        return self.all_to_all_async(send).wait()

    def all_gather(self, send: torch.Tensor) -> torch.Tensor:
        return self.all_gather_async(send).wait()

    def all_to_all_async(self, send: torch.Tensor,
                         out: torch.Tensor | None = None) -> _MpiPending:
        send = send.contiguous()
        recv = received(out, send.numel(), send).view(send.shape)
        request = self.comm.Ialltoall(send.numpy(), recv.numpy())
        return _MpiPending(self, request, recv, send, "all-to-all")

    def all_gather_async(self, send: torch.Tensor,
                         out: torch.Tensor | None = None) -> _MpiPending:
        flat = send.reshape(-1).contiguous()
        recv = received(out, self.size * flat.numel(), flat).view(self.size, -1)
        request = self.comm.Iallgather(flat.numpy(), recv.numpy())
        return _MpiPending(self, request, recv, flat, "all-gather")

    def send_async(self, send: torch.Tensor, peer: int, tag: int) -> _MpiPending:
        flat = send.reshape(-1).contiguous()
        request = self.comm.Isend(flat.numpy(), dest=peer, tag=tag)
        return _MpiPending(self, request, flat, flat, f"send to rank {peer}")

    def recv_async(self, nbytes: int, peer: int, tag: int) -> _MpiPending:
        recv = torch.empty(nbytes, dtype=torch.uint8)
        request = self.comm.Irecv(recv.numpy(), source=peer, tag=tag)
        return _MpiPending(self, request, recv, None, f"receive from rank {peer}")


class _MpiPending:
    """An MPI request, its receive buffer, and the send buffer it must keep alive."""

    def __init__(self, transport: MpiTransport, request: Any, recv: torch.Tensor,
                 send: torch.Tensor | None, what: str) -> None:
        self.transport, self.request, self.recv, self.send, self.what = (
            transport, request, recv, send, what)

    def wait(self) -> torch.Tensor:
        deadline = time.monotonic() + self.transport.timeout_s
        pause = 1e-6
        while not self.request.Test():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"lowbitcc: MPI {self.what} did not complete within "
                    f"{self.transport.timeout_s:.0f} s on rank {self.transport.rank} of "
                    f"{self.transport.size} (a peer is dead or stalled)"
                )
            time.sleep(pause)
            pause = min(2 * pause, POLL_MAX_S)
        self.send = None
        return self.recv
