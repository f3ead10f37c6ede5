"""The direct schedule: one all-to-all of codes, then (all-reduce) one all-gather of codes.

Reduce-scatter of a source of ``n`` rows of ``m`` elements (row ``j`` is owned by rank ``j``):

1. quantize every row once with the error state of stage ``"rs"`` (n messages);
2. all-to-all: row ``j`` goes to rank ``j``;
3. decode the ``n`` messages of the own row and sum them in fp32, in rank order.

All-reduce adds:

4. re-quantize the reduced row with its own error state (stage ``"ag"``);
5. all-gather the ``n`` messages; every rank, the owner included, decodes all of them, so every
   rank ends with bitwise-identical values.

Traffic per rank: ``(n-1)`` messages of ``m`` elements out and in per phase (two phases for
all-reduce). Quantizations on any element's path: 1 (reduce-scatter) or 2 (all-reduce).
"""

from __future__ import annotations

import torch

from lowbitcc.backends.base import Transport
from lowbitcc.compressor import CallCompressor, Source


def reduce_scatter(source: Source, comp: CallCompressor, transport: Transport) -> torch.Tensor:
    """Sum over ranks of row ``transport.rank`` of ``source``: fp32 ``[m]``."""
    messages = comp.encode("rs", source, list(range(source.rows)))
    received = transport.all_to_all(messages)
    return comp.decode_sum(received, source.m, transport.rank)


def all_reduce(
    source: Source, out: torch.Tensor, comp: CallCompressor, transport: Transport
) -> None:
    """Sum over ranks of ``source`` into flat ``out`` (any float dtype), identical on every rank."""
    reduced = reduce_scatter(source, comp, transport)
    message = comp.encode("ag", Source(reduced, 1, source.m), [transport.rank])
    gathered = transport.all_gather(message[0])
    comp.decode_into(gathered, source.m, list(range(source.rows)), out)
