"""`MeteredTransport`: a `Transport` that adds what it sends and how long it waits to `Stats`."""

from __future__ import annotations

import time

import torch

from lowbitcc.counters import Stats
from lowbitcc.transports.base import Pending, Transport


class _MeteredPending:
    def __init__(self, inner: Pending, stats: Stats, category: str) -> None:
        self.inner, self.stats, self.category = inner, stats, category

    def wait(self) -> torch.Tensor:
        start = time.perf_counter()
        out = self.inner.wait()
        self.stats.add(self.category, wire_s=time.perf_counter() - start)
        return out


class MeteredTransport:
    """Wraps a `Transport`, adding the bytes this rank sends and the time spent to `stats`
    (for background transfers, the time spent starting them and waiting for them)."""

    def __init__(self, inner: Transport, stats: Stats, category: str = "compressed") -> None:
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
        return self._started(self.inner.all_to_all_async, (send,), (self.size - 1) * send.shape[1])

    def all_gather_async(self, send: torch.Tensor) -> Pending:
        return self._started(self.inner.all_gather_async, (send,), (self.size - 1) * send.numel())

    def send_async(self, send: torch.Tensor, peer: int, tag: int) -> Pending:
        return self._started(self.inner.send_async, (send, peer, tag), send.numel())

    def recv_async(self, nbytes: int, peer: int, tag: int) -> Pending:
        return self._started(self.inner.recv_async, (nbytes, peer, tag), 0)

    def _started(self, fn, args: tuple, sent: int) -> Pending:
        start = time.perf_counter()
        pending = fn(*args)
        self.stats.add(self.category, wire_s=time.perf_counter() - start, wire_bytes=sent)
        return _MeteredPending(pending, self.stats, self.category)

    def _metered(self, fn, send: torch.Tensor, row_bytes: int) -> torch.Tensor:
        start = time.perf_counter()
        out = fn(send)
        self.stats.add(
            self.category, wire_s=time.perf_counter() - start,
            wire_bytes=(self.size - 1) * row_bytes,
        )
        return out
