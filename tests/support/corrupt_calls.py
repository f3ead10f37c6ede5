"""Steady compressed calls whose messages from one rank are changed on the way, in a rank
process (tests/backend/test_faults.py, tests/backend/test_steady_runner.py): the sender's calls
take the Python path, where its transport is patched (`sending_changed`), the other ranks' the
Python path too or their plans' C++ cores (`served_group`); `corrupt_first_codes` the common
case, a first message of codes corrupt."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

import lowbitcc
from lowbitcc.backend import steady_runner
from lowbitcc.transports import gloo as gloo_transport

ROW = 4096
"""Elements per rank's row of the 3-rank call (its rows of four chunks of `CHUNK`)."""
CHUNK = 1024


def served_group(rank: int, sender: int, served: bool, **config: Any) -> Any:
    """A "loco" group of ``config`` (`lowbitcc.LocoConfig`'s keywords) calling every call
    compressed, whose calls take the Python path on rank ``sender`` (whose transport a test
    patches) and, where not ``served``, on every rank; else the C++ runner's where it serves
    them."""
    pg = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(
        min_size=2, cost_model=False, **config))
    if rank == sender or not served:
        pg._runner = steady_runner.NoRunner()
    return pg


@contextlib.contextmanager
def sending_changed(on: bool, method: str,
                    change: Callable[[torch.Tensor, tuple[Any, ...]], None]) -> Iterator[None]:
    """While open, where ``on`` (the sender's rank), `GlooTransport` ``method`` (e.g.
    ``"send_async"``, ``"all_to_all_async"``) first applies ``change(send, rest)`` in place to
    what it sends (``rest``: the method's other arguments); restored on exit."""
    original = getattr(gloo_transport.GlooTransport, method)

    def changed(self, send, *rest):
        change(send, rest)
        return original(self, send, *rest)

    if on:
        setattr(gloo_transport.GlooTransport, method, changed)
    try:
        yield
    finally:
        setattr(gloo_transport.GlooTransport, method, original)


def steady_all_reduce(pg: Any, x: torch.Tensor) -> Callable[[int], torch.Tensor]:
    """``call(step)``: a compressed all-reduce on ``pg`` of ``x`` scaled by step ``step`` (a new
    tensor, returned), one training step each; the place made steady by steps 0 to 11 before
    it is handed out."""

    def call(step: int) -> torch.Tensor:
        out = x * (1 + step / 7)
        with lowbitcc.compressed():
            dist.all_reduce(out, group=pg)
        lowbitcc.end_step()
        return out

    for step in range(12):
        call(step)
    return call


def served_by_cores(pg: Any) -> int:
    """How many compressed calls ``pg``'s C++ runner has served (0: the Python path's)."""
    return getattr(pg._runner, "served_compressed", 0)


def corrupt_first_codes(rank: int, sender: int, method: str, served: bool,
                        schedule: str = "direct") -> tuple[str, list[list[bool]], bool, int]:
    """Twelve steady calls of ``[3 * ROW]`` fp32 on a "loco" group of ``schedule`` (every call
    compressed, chunks of `CHUNK`), then one in which rank ``sender``'s first message of codes
    sent by `GlooTransport` ``method`` (``"send_async"``, ``"all_gather_async"``, ...) has
    byte 28 of its header (its call signature) flipped: no longer the call's. Rank ``sender``
    runs in Python (where the transport is patched), the others by their plans' cores where
    ``served``. Returns: the name of what the call raised (``"nothing"``), which chunks of
    which row of its output are NaN, whether the next call's output is finite, and how many
    calls the C++ runner served in the corrupt one (0 in Python)."""
    pg = served_group(rank, sender, served, schedule=schedule, chunk_size=CHUNK, max_chunks=0)
    x = torch.linspace(-1, 1, 3 * ROW) * (rank + 1)

    def call(out: torch.Tensor) -> torch.Tensor:
        try:
            with lowbitcc.compressed():
                dist.all_reduce(out, group=pg)
        finally:
            lowbitcc.end_step()
        return out

    for _ in range(12):
        call(x.clone())
    before, sent = served_by_cores(pg), []

    def corrupting(send: torch.Tensor, rest: tuple[Any, ...]) -> None:
        if send.numel() > lowbitcc.codec.exchange_frame.EXCHANGE_BYTES and not sent:
            sent.append(True)
            send[28] ^= 0xFF

    out = x.clone()
    try:
        with sending_changed(rank == sender, method, corrupting):
            call(out)
        raised = "nothing"
    except lowbitcc.codec.wire.WireFormatError as exc:
        raised = type(exc).__name__
    served_now = served_by_cores(pg) - before
    nan = [[bool(out[r * ROW + c * CHUNK:r * ROW + (c + 1) * CHUNK].isnan().any())
            for c in range(ROW // CHUNK)] for r in range(3)]
    return raised, nan, bool(torch.isfinite(call(x.clone())).all()), served_now
