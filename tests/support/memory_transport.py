"""An in-memory `Transport` for threads of one process: fast unit tests of the schedules.

`MemoryGroup(size)` is shared by ``size`` threads; ``group.transport(rank)`` is rank ``rank``'s
`Transport`. Collectives match by each rank's own count of collectives (every rank calls them in
the same order, as the protocol requires); point-to-point messages by ``(src, dst, tag)`` in
posting order. `memory_links` builds a rank's `Links` with node and rail groups of their own.
"""

from __future__ import annotations

import collections
import queue
import threading

import torch

from lowbitcc.transports.links import Links
from lowbitcc.transports.topology import NodeLayout

WAIT_S = 30.0


class _Done:
    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def wait(self) -> torch.Tensor:
        return self.value


class _Receive:
    def __init__(self, box: queue.Queue) -> None:
        self.box = box

    def wait(self) -> torch.Tensor:
        return self.box.get(timeout=WAIT_S)


class MemoryGroup:
    """Mailboxes shared by the threads of one in-memory group."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._boxes: dict[tuple, queue.Queue] = collections.defaultdict(queue.Queue)
        self._subgroups: dict[tuple, MemoryGroup] = {}

    def box(self, key: tuple) -> queue.Queue:
        with self._lock:
            return self._boxes[key]

    def subgroup(self, name: str, color: int, size: int) -> MemoryGroup:
        with self._lock:
            return self._subgroups.setdefault((name, color), MemoryGroup(size))

    def transport(self, rank: int) -> MemoryTransport:
        return MemoryTransport(self, rank)


class _Gather:
    def __init__(self, boxes: list[queue.Queue], out: torch.Tensor | None = None) -> None:
        self.boxes, self.out = boxes, out

    def wait(self) -> torch.Tensor:
        rows = torch.stack([b.get(timeout=WAIT_S) for b in self.boxes])
        return rows if self.out is None else self.out.view(rows.shape).copy_(rows)


class MemoryTransport:
    """`Transport` of rank ``rank`` of a `MemoryGroup` (every message is copied)."""

    def __init__(self, group: MemoryGroup, rank: int) -> None:
        self.group, self.rank, self.size = group, rank, group.size
        self._collectives = 0

    def _next(self) -> int:
        self._collectives += 1
        return self._collectives

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        return self.all_to_all_async(send).wait()

    def all_gather(self, send: torch.Tensor) -> torch.Tensor:
        return self.all_gather_async(send).wait()

    def all_to_all_async(self, send: torch.Tensor, out: torch.Tensor | None = None) -> _Gather:
        seq = self._next()
        for dst in range(self.size):
            self.group.box(("a2a", seq, self.rank, dst)).put(send[dst].clone())
        return _Gather([self.group.box(("a2a", seq, src, self.rank)) for src in range(self.size)],
                       out)

    def all_gather_async(self, send: torch.Tensor, out: torch.Tensor | None = None) -> _Gather:
        seq = self._next()
        flat = send.reshape(-1).clone()
        for dst in range(self.size):
            self.group.box(("ag", seq, self.rank, dst)).put(flat)
        return _Gather([self.group.box(("ag", seq, src, self.rank)) for src in range(self.size)],
                       out)

    def send_async(self, send: torch.Tensor, peer: int, tag: int) -> _Done:
        self.group.box(("p2p", self.rank, peer, tag)).put(send.reshape(-1).clone())
        return _Done(send)

    def recv_async(self, nbytes: int, peer: int, tag: int) -> _Receive:
        return _Receive(self.group.box(("p2p", peer, self.rank, tag)))


def memory_links(group: MemoryGroup, rank: int, layout: NodeLayout) -> Links:
    """Rank ``rank``'s `Links` over ``group``, node and rail groups built in memory too."""

    def make(name: str, color: int, key: int, size: int) -> MemoryTransport:
        return group.subgroup(name, color, size).transport(key)

    return Links(group.transport(rank), layout, make)
