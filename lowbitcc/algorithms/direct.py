"""The direct schedule: one all-to-all of codes, then (all-reduce) one all-gather of codes.

Reduce-scatter of a source of ``n`` rows of ``m`` elements (row ``j`` is owned by rank ``j``):

1. quantize every row once with the error state of stage ``"rs"`` (n messages);
2. all-to-all: row ``j`` goes to rank ``j``;
3. decode the ``n`` messages of the own row and sum them in fp32, in rank order.

All-reduce adds:

4. re-quantize the reduced row with its own error state (stage ``"ag"``);
5. all-gather the ``n`` messages; every rank, the owner included, decodes all of them, so every
   rank ends with bitwise-identical values.

Pipelining: with ``chunk`` > 0 and rows longer than one chunk, the columns are cut into chunks
of ``chunk`` elements (a multiple of the group size) and steps 1-5 run per chunk, each chunk's
transfers in the background while the next chunk is encoded and the previous one decoded.
Chunk ``k`` has its own error-state stages (``"rs.k.row"``, ``"ag.k"``); each row's slice of a
chunk is encoded where it lies, without a copy. Quantization groups never
straddle a chunk edge, so with nearest rounding the codes, and the results, are the same bytes
as without chunks (stochastic rounding draws its random bits per chunk).

Traffic per rank: ``(n-1)`` messages of ``m`` elements out and in per phase (two phases for
all-reduce), plus one 40-byte header per message and chunk. Quantizations on any element's
path: 1 (reduce-scatter) or 2 (all-reduce).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import torch

from lowbitcc.backends.base import Pending, Transport
from lowbitcc.compressor import CallCompressor, Source


def chunks(m: int, chunk: int, group_size: int) -> list[tuple[int, int]]:
    """Column ranges ``[a, b)`` covering ``[0, m)``: one range if ``chunk`` is 0 or ``m`` fits."""
    if chunk <= 0 or m <= chunk:
        return [(0, m)]
    width = -(-chunk // group_size) * group_size
    return [(a, min(a + width, m)) for a in range(0, m, width)]


def _encode_columns(comp: CallCompressor, stage: str, source: Source, a: int, b: int) -> torch.Tensor:
    """Messages ``[rows, P]`` for columns ``[a, b)`` of every row; a chunk encodes each row's
    slice in place (a view, no copy of the input) with its own stage ``stage.row``."""
    rows, m, flat = source.rows, source.m, source.tensor
    if (a, b) == (0, m):
        return comp.encode(stage, source, list(range(rows)))
    parts = []
    for r in range(rows):
        lo, hi = min(r * m + a, flat.numel()), min(r * m + b, flat.numel())
        parts.append(comp.encode(f"{stage}.{r}", Source(flat[lo:hi], 1, b - a, source.factor), [r]))
    return torch.cat(parts)


def _stage(name: str, k: int, count: int) -> str:
    return name if count == 1 else f"{name}.{k}"


def _pipeline(
    source: Source, comp: CallCompressor, transport: Transport, ranges: list[tuple[int, int]],
    on_reduced: Callable[[int, int, int, torch.Tensor], Pending | None],
    on_gathered: Callable[[int, int, int, torch.Tensor], None] | None,
) -> None:
    """Run the reduce-scatter of every chunk (column ``ranges``, from `chunks`), one transfer in
    flight while the next is encoded.

    ``on_reduced(k, a, b, reduced)`` gets chunk ``k``'s reduced own row (fp32 ``[b - a]``) and may
    start a second transfer, whose result goes to ``on_gathered(k, a, b, received)``.
    """
    rank = transport.rank
    scattering: collections.deque = collections.deque()
    gathering: collections.deque = collections.deque()

    def reduce_oldest() -> None:
        k, a, b, pending = scattering.popleft()
        reduced = comp.decode_sum(pending.wait(), b - a, rank)
        second = on_reduced(k, a, b, reduced)
        if second is not None:
            gathering.append((k, a, b, second))

    def gather_oldest() -> None:
        k, a, b, pending = gathering.popleft()
        assert on_gathered is not None
        on_gathered(k, a, b, pending.wait())

    for k, (a, b) in enumerate(ranges):
        messages = _encode_columns(comp, _stage("rs", k, len(ranges)), source, a, b)
        scattering.append((k, a, b, transport.all_to_all_async(messages)))
        if len(scattering) > 1:
            reduce_oldest()
        if len(gathering) > 1:
            gather_oldest()
    while scattering:
        reduce_oldest()
    while gathering:
        gather_oldest()


def reduce_scatter(source: Source, comp: CallCompressor, transport: Transport,
                   chunk: int = 0) -> torch.Tensor:
    """Sum over ranks of row ``transport.rank`` of ``source``: fp32 ``[m]``."""
    out = torch.empty(source.m, dtype=torch.float32, device=source.tensor.device)

    def keep(k: int, a: int, b: int, reduced: torch.Tensor) -> None:
        out[a:b] = reduced

    _pipeline(source, comp, transport, chunks(source.m, chunk, comp.codec.group_size), keep, None)
    return out


def all_reduce(
    source: Source, out: torch.Tensor, comp: CallCompressor, transport: Transport, chunk: int = 0
) -> None:
    """Sum over ranks of ``source`` into flat ``out`` (any float dtype), identical on every rank."""
    rank, rows, m = transport.rank, source.rows, source.m
    ranges = chunks(m, chunk, comp.codec.group_size)
    count = len(ranges)

    def requantize(k: int, a: int, b: int, reduced: torch.Tensor) -> Pending:
        message = comp.encode(_stage("ag", k, count), Source(reduced, 1, b - a), [rank])
        return transport.all_gather_async(message[0])

    def place(k: int, a: int, b: int, gathered: torch.Tensor) -> None:
        if count == 1:
            comp.decode_into(gathered, m, list(range(rows)), out)
            return
        for r in range(rows):
            lo, hi = min(r * m + a, out.numel()), min(r * m + b, out.numel())
            comp.decode_into(gathered[r:r + 1], b - a, [r], out[lo:hi])

    _pipeline(source, comp, transport, ranges, requantize, place)
