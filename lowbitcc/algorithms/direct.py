"""The direct schedule: one all-to-all of codes, then (all-reduce) one all-gather of codes.

Reduce-scatter of ``x`` fp32 ``[n, m]`` (row ``j`` is the part owned by rank ``j``):

1. quantize every row once with the error state of stage ``"rs"`` (n messages);
2. all-to-all: row ``j`` goes to rank ``j``;
3. decode the ``n`` messages of the own row and sum them in fp32, in rank order.

All-reduce adds:

4. re-quantize the reduced row with its own error state (stage ``"ag"``);
5. all-gather the ``n`` messages; every rank, the owner included, decodes all of them, so every
   rank ends with bitwise-identical values.

Traffic per rank: ``(n-1)/n`` of the tensor's codes out and in per phase (twice for all-reduce).
Quantizations on any element's path: 1 (reduce-scatter) or 2 (all-reduce).
"""

from __future__ import annotations

import torch

from lowbitcc.backends.base import Transport
from lowbitcc.compressor import CallCompressor


def reduce_scatter(x: torch.Tensor, comp: CallCompressor, transport: Transport) -> torch.Tensor:
    """Sum over ranks of row ``transport.rank`` of ``x`` ``[n, m]``: fp32 ``[m]``."""
    n, m = x.shape
    messages = comp.encode("rs", x, list(range(n)))
    received = transport.all_to_all(messages)
    return comp.decode_sum(received, m, transport.rank)


def all_reduce(x: torch.Tensor, comp: CallCompressor, transport: Transport) -> torch.Tensor:
    """Sum over ranks of ``x`` ``[n, m]``, identical on every rank: fp32 ``[n, m]``."""
    n, m = x.shape
    reduced = reduce_scatter(x, comp, transport)
    message = comp.encode("ag", reduced[None], [transport.rank])
    gathered = transport.all_gather(message[0])
    return comp.decode(gathered, m, list(range(n)))
