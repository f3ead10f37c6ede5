"""A steady compressed all-reduce whose first message of codes from one rank travels corrupt, in
a rank process: what each rank raises and where its output comes out NaN, run with the other
ranks in Python or by their plans' C++ cores (tests/backend/test_faults.py,
tests/backend/test_steady_runner.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import lowbitcc
from lowbitcc.backend import steady_runner
from lowbitcc.transports import gloo as gloo_transport

ROW = 4096
"""Elements per rank's row of the 3-rank call (its rows of four chunks of `CHUNK`)."""
CHUNK = 1024


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
    pg = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(
        min_size=2, cost_model=False, schedule=schedule, chunk_size=CHUNK, max_chunks=0))
    if rank == sender or not served:
        pg._runner = steady_runner.NoRunner()
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

    def cores() -> int:
        return getattr(pg._runner, "served_compressed", 0)

    before = cores()
    original, sent = getattr(gloo_transport.GlooTransport, method), []

    def corrupting(self, send, *rest):
        if send.numel() > lowbitcc.codec.exchange_frame.EXCHANGE_BYTES and not sent:
            sent.append(True)
            send[28] ^= 0xFF
        return original(self, send, *rest)

    if rank == sender:
        setattr(gloo_transport.GlooTransport, method, corrupting)
    out = x.clone()
    try:
        call(out)
        raised = "nothing"
    except lowbitcc.codec.wire.WireFormatError as exc:
        raised = type(exc).__name__
    finally:
        setattr(gloo_transport.GlooTransport, method, original)
    served_now = cores() - before
    nan = [[bool(out[r * ROW + c * CHUNK:r * ROW + (c + 1) * CHUNK].isnan().any())
            for c in range(ROW // CHUNK)] for r in range(3)]
    return raised, nan, bool(torch.isfinite(call(x.clone())).all()), served_now
