"""The transport interface that compressed schedules run over."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from lowbitcc.counters import Stats


class Transport(Protocol):
    """Moves uint8 messages between the ``size`` ranks of one group.

    The blocking methods return once the data has arrived; ``*_async`` ones return a `Pending`
    at once. A dead or stalled peer makes ``wait()`` raise within the group's timeout. Every
    rank must call the collective methods in the same order; a point-to-point message is
    matched with the receive of the same ``tag`` from the same peer, in posting order.
    """

    rank: int
    size: int

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        """``send`` is ``uint8 [size, P]``: row ``j`` goes to rank ``j``. Returns ``[size, P]``
        whose row ``i`` came from rank ``i`` (row ``rank`` is this rank's own row)."""
        ...

    def all_gather(self, send: torch.Tensor) -> torch.Tensor:
        """``send`` is ``uint8 [P]``; returns ``[size, P]`` whose row ``i`` came from rank ``i``."""
        ...

    def all_to_all_async(self, send: torch.Tensor) -> Pending:
        """`all_to_all` started in the background; ``send`` must stay untouched until waited."""
        ...

    def all_gather_async(self, send: torch.Tensor) -> Pending:
        """`all_gather` started in the background; ``send`` must stay untouched until waited."""
        ...

    def send_async(self, send: torch.Tensor, peer: int, tag: int) -> Pending:
        """Send flat uint8 ``send`` to rank ``peer``; it must stay untouched until waited."""
        ...

    def recv_async(self, nbytes: int, peer: int, tag: int) -> Pending:
        """Receive ``nbytes`` bytes from rank ``peer``; ``wait()`` returns ``uint8 [nbytes]``."""
        ...


class Pending(Protocol):
    """A transfer in flight; ``wait()`` blocks until it is done and returns what arrived."""

    def wait(self) -> torch.Tensor:
        ...


class _MeteredPending:
    def __init__(self, inner: Pending, stats: "Stats", category: str) -> None:
        self.inner, self.stats, self.category = inner, stats, category

    def wait(self) -> torch.Tensor:
        start = time.perf_counter()
        out = self.inner.wait()
        self.stats.add(self.category, wire_s=time.perf_counter() - start)
        return out


class MeteredTransport:
    """Wraps a `Transport`, adding the bytes this rank sends and the time spent to `stats`
    (for background transfers, the time spent waiting for them)."""

    def __init__(self, inner: Transport, stats: "Stats", category: str = "compressed") -> None:
        self.inner = inner
        self.rank = inner.rank
        self.size = inner.size
        self.stats = stats
        self.category = category

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        return self._metered(self.inner.all_to_all, send, send.shape[1])

    def all_gather(self, send: torch.Tensor) -> torch.Tensor:
        return self._metered(self.inner.all_gather, send, send.numel())

    def all_to_all_async(self, send: torch.Tensor) -> Pending:
        self.stats.add(self.category, wire_bytes=(self.size - 1) * send.shape[1])
        return _MeteredPending(self.inner.all_to_all_async(send), self.stats, self.category)

    def all_gather_async(self, send: torch.Tensor) -> Pending:
        self.stats.add(self.category, wire_bytes=(self.size - 1) * send.numel())
        return _MeteredPending(self.inner.all_gather_async(send), self.stats, self.category)

    def send_async(self, send: torch.Tensor, peer: int, tag: int) -> Pending:
        self.stats.add(self.category, wire_bytes=send.numel())
        return _MeteredPending(self.inner.send_async(send, peer, tag), self.stats, self.category)

    def recv_async(self, nbytes: int, peer: int, tag: int) -> Pending:
        return _MeteredPending(self.inner.recv_async(nbytes, peer, tag), self.stats, self.category)

    def _metered(self, fn, send: torch.Tensor, row_bytes: int) -> torch.Tensor:
        start = time.perf_counter()
        out = fn(send)
        self.stats.add(
            self.category, wire_s=time.perf_counter() - start,
            wire_bytes=(self.size - 1) * row_bytes,
        )
        return out
