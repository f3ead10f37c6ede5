"""`MeteredTransport`: a `Transport` that adds what it sends and how long it waits to `Stats`."""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence

import torch

from lowbitcc.counters import Stats
from lowbitcc.transports.base import Pending, Transport


class _MeteredPending:
    def __init__(self, inner: Pending, stats: Stats, category: str) -> None:
        self.inner, self.stats, self.category = inner, stats, category

    def wait(self) -> torch.Tensor:
        start = time.perf_counter()
        out = self.inner.wait()
        self.stats.add_wire(self.category, time.perf_counter() - start)
        return out


class MeteredPrepared:
    """A prepared transfer of the inner transport (`nccl.Prepared`) whose every issue is metered
    as `MeteredTransport`'s async transfers are: ``sent`` bytes (to this node's ranks, to
    others') into ``meter``'s statistics."""

    def __init__(self, inner, meter: MeteredTransport, sent: tuple[int, int]) -> None:
        self.inner, self.recv, self.meter, self.sent = inner, inner.recv, meter, sent

    def issue(self) -> Pending:
        return self.meter._started(self.inner.issue, (), self.sent)

    def issue_ordered(self) -> None:
        self.issue().wait()


class MeteredTransport:
    """Wraps a `Transport`, adding the bytes this rank sends and the time spent to `stats`
    (for background transfers, the time spent starting them and waiting for them).

    ``same_node[i]``: whether the transport's rank ``i`` is on this rank's node
    (`topology.same_node`; None: every rank is): the bytes sent to it count as
    ``intra_node_bytes``, else as ``inter_node_bytes`` (`counters`)."""

    def __init__(self, inner: Transport, stats: Stats, category: str = "compressed",
                 same_node: Sequence[bool] | None = None) -> None:
        self.inner = inner
        self.rank = inner.rank
        self.size = inner.size
        self.stats = stats
        self.category = category
        if same_node is not None and len(same_node) != inner.size:
            raise ValueError(f"lowbitcc: same_node names {len(same_node)} ranks for a "
                             f"transport of {inner.size}")
        self._same_node = list(same_node) if same_node is not None else [True] * inner.size
        inside = sum(self._same_node) - int(self._same_node[self.rank])
        self._peers = (inside, inner.size - 1 - inside)  # (on this node, on others)

    def all_to_all(self, send: torch.Tensor) -> torch.Tensor:
        return self._metered(self.inner.all_to_all, send, send.shape[1])

    def all_gather(self, send: torch.Tensor) -> torch.Tensor:
        return self._metered(self.inner.all_gather, send, send.numel())

    def all_to_all_async(self, send: torch.Tensor, out: torch.Tensor | None = None) -> Pending:
        return self._started(self.inner.all_to_all_async, (send,) if out is None else (send, out),
                             self._to_peers(send.shape[1]))

    def all_gather_async(self, send: torch.Tensor, out: torch.Tensor | None = None) -> Pending:
        return self._started(self.inner.all_gather_async, (send,) if out is None else (send, out),
                             self._to_peers(send.numel()))

    def metering(self, stats: Stats) -> MeteredTransport:
        """This transport (the same inner one and nodes) adding to ``stats`` instead, e.g. a
        call's `counters.RunTally`."""
        other = copy.copy(self)
        other.stats = stats
        return other

    @property
    def records(self) -> bool:
        """Whether the inner transport's transfers can be prepared once and issued again
        (`nccl.NcclTransport.records`): then so can this one's, each issue metered."""
        return getattr(self.inner, "records", False)

    def prepare_all_to_all(self, send: torch.Tensor, out: torch.Tensor | None = None,
                           ) -> MeteredPrepared:
        return MeteredPrepared(self.inner.prepare_all_to_all(send, out), self,
                                self._to_peers(send.shape[1]))

    def prepare_all_gather(self, send: torch.Tensor, out: torch.Tensor | None = None,
                           ) -> MeteredPrepared:
        return MeteredPrepared(self.inner.prepare_all_gather(send, out), self,
                                self._to_peers(send.numel()))

    def send_async(self, send: torch.Tensor, peer: int, tag: int) -> Pending:
        n = send.numel()
        return self._started(self.inner.send_async, (send, peer, tag),
                             (n, 0) if self._same_node[peer] else (0, n))

    def recv_async(self, nbytes: int, peer: int, tag: int) -> Pending:
        return self._started(self.inner.recv_async, (nbytes, peer, tag), (0, 0))

    def _to_peers(self, row_bytes: int) -> tuple[int, int]:
        """The bytes of one row sent to every other rank: (inside the node, across nodes)."""
        return self._peers[0] * row_bytes, self._peers[1] * row_bytes

    def _started(self, fn, args: tuple, sent: tuple[int, int]) -> Pending:
        start = time.perf_counter()
        pending = fn(*args)
        self.stats.add_sent(self.category, time.perf_counter() - start, sent[0], sent[1])
        return _MeteredPending(pending, self.stats, self.category)

    def _metered(self, fn, send: torch.Tensor, row_bytes: int) -> torch.Tensor:
        start = time.perf_counter()
        out = fn(send)
        inside, across = self._to_peers(row_bytes)
        self.stats.add(self.category, wire_s=time.perf_counter() - start,
                       wire_bytes=inside + across, intra_node_bytes=inside,
                       inter_node_bytes=across)
        return out
