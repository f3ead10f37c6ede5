"""The transport interface that compressed schedules run over (`Transport`, `Pending`)."""

from __future__ import annotations

from typing import Protocol

import torch


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

    def all_to_all_async(self, send: torch.Tensor, out: torch.Tensor | None = None) -> Pending:
        """`all_to_all` started in the background; ``send`` must stay untouched until waited.
        ``out`` (``send.numel()`` contiguous elements of its dtype on its device), when given,
        receives the rows instead of a new buffer (a call plan keeps one)."""
        ...

    def all_gather_async(self, send: torch.Tensor, out: torch.Tensor | None = None) -> Pending:
        """`all_gather` started in the background; ``send`` must stay untouched until waited.
        ``out`` (uint8, ``size * send.numel()`` contiguous elements on ``send``'s device), when
        given, receives the rows instead of a new buffer (a call plan keeps one)."""
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


def received(out: torch.Tensor | None, numel: int, like: torch.Tensor) -> torch.Tensor:
    """Flat ``out`` where given (`Transport.all_gather_async`'s and `all_to_all_async`'s:
    checked to hold ``numel``
    contiguous elements of ``like``'s dtype on its device), else a new buffer of that size."""
    if out is None:
        return torch.empty(numel, dtype=like.dtype, device=like.device)
    if (out.numel() != numel or out.dtype != like.dtype or out.device != like.device
            or not out.is_contiguous()):
        raise ValueError(f"lowbitcc: a receive buffer of {numel} contiguous {like.dtype} "
                         f"on {like.device} is needed, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    return out.view(-1)
