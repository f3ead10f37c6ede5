"""The ring schedule: neighbour links only, re-quantizing the partial sum at every hop.

Ranks form the ring ``r -> r+1 (mod n)``. Reduce-scatter runs ``n-1`` steps; at step ``s``
rank ``r`` sends segment ``(r-s-1) mod n`` to its right neighbour and receives segment
``(r-s-2) mod n`` from its left one:

- step 0 quantizes the rank's own row of that segment (stage ``ring.rs.0``);
- step ``s > 0`` decodes what arrived, adds the own row of the segment in fp32, and quantizes
  that partial sum again with the error state of hop ``s`` (stage ``ring.rs.s``). A rank sends
  the same segment at the same hop in every call, so each hop's error state follows one
  stream of partial sums;
- after the last step rank ``r`` decodes segment ``r`` and adds its own row: the result.

All-reduce adds the all-gather: the owner quantizes its reduced row once (stage ``ring.ag``),
and the codes travel ``n-1`` hops unchanged (forwarded, never re-quantized); every rank, the
owner included, decodes all ``n`` messages, so every rank ends with bitwise-identical values.

Pipelining: the columns are cut into chunks (`chunking.chunks`); at every step, chunk ``k`` is
decoded, re-encoded and sent while chunk ``k+1`` of the previous step is still arriving.

Traffic per rank and phase: ``n-1`` messages of ``m`` elements out, ``n-1`` in, to and from one
neighbour each (as direct). Quantizations on an element's path: ``n-1`` (reduce-scatter), ``n``
(all-reduce). Error bound (nearest rounding, fresh error state, ``q = 2**(bits-1) - 1``, ``A``
the sum over ranks of each element's group max): ``(n-1) A / 2q`` for reduce-scatter and
``n A / 2q`` for all-reduce, growing by ``A / 2q`` per hop, against ``A / 2q`` and ``A / q`` for
direct.
"""

from __future__ import annotations

import torch

from lowbitcc.compressor import CallCompressor, Source
from lowbitcc.schedules.chunking import (
    chunks,
    decode_columns,
    into,
    row_slice,
    row_values,
    stage,
)
from lowbitcc.transports.base import Pending, Transport
from lowbitcc.transports.links import Links


def _reduce_scatter_chunks(source: Source, comp: CallCompressor, transport: Transport,
                           ranges: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Each chunk's reduced own row (fp32 ``[b - a]``)."""
    n, r = transport.size, transport.rank
    right, left = (r + 1) % n, (r - 1) % n
    count = len(ranges)
    sends: list[Pending] = []
    inbox: list[Pending | None] = [None] * count
    for s in range(n - 1):
        segment = (r - s - 1) % n  # sent at step s; arrived (as a partial sum) at step s - 1
        for k, (a, b) in enumerate(ranges):
            name = stage(f"ring.rs.{s}", k, count)
            if s == 0:
                message = comp.encode(name, row_slice(source, segment, a, b), [segment])
            else:
                received = inbox[k].wait().view(1, -1)
                partial = comp.decode_sum(received, b - a, segment)
                partial += row_values(source, segment, a, b)
                message = comp.encode(name, Source(partial, 1, b - a), [segment])
            sends.append(transport.send_async(message[0], right, s * count + k))
            inbox[k] = transport.recv_async(message.shape[1], left, s * count + k)
    reduced = []
    for k, (a, b) in enumerate(ranges):
        total = comp.decode_sum(inbox[k].wait().view(1, -1), b - a, r)
        total += row_values(source, r, a, b)
        reduced.append(total)
    for pending in sends:
        pending.wait()
    return reduced


def decode_kept(arrived: list[list[torch.Tensor]], gathered: list[torch.Tensor],
                ranges: list[tuple[int, int]], comp: CallCompressor, source: Source, rank: int,
                out: torch.Tensor | None, own: torch.Tensor | None = None) -> None:
    """The decodes of a run whose transfers are done, in the schedule's order, from the messages
    kept: ``arrived[s][k]`` (uint8 ``[P]``, what step ``s`` received of chunk ``k``), the
    partial sums' decoded only for what they tell of the call (a foreign message's error, kept by
    ``comp``: what they made is sent); each chunk's total (its last step's, plus this rank's row
    of ``source``) into ``own`` (fp32 ``[m]``: a reduce-scatter), or ``gathered[k]`` (uint8
    ``[n, P]``, every rank's reduced row of chunk ``k``) into flat ``out`` (an all-reduce). A call
    place's C++ core (`backend.plan_cores`) hands these to the plan where a message of its run did
    not belong to the call, so that the run's results and error are the Python path's."""
    n = len(arrived) + 1
    for s in range(1, n - 1):
        segment = (rank - s - 1) % n
        for k, (a, b) in enumerate(ranges):
            scratch = comp.scratch(b - a, source.tensor.device)
            comp.decode_sum(arrived[s - 1][k].view(1, -1), b - a, segment, scratch)
    for k, (a, b) in enumerate(ranges):
        total = comp.decode_sum(arrived[n - 2][k].view(1, -1), b - a, rank)
        total += row_values(source, rank, a, b)
        if own is not None:
            own[a:b] = total
    if out is not None:
        for k, (a, b) in enumerate(ranges):
            decode_columns(comp, gathered[k], n, source.m, a, b, out)


def reduce_scatter(source: Source, comp: CallCompressor, links: Links,
                   chunk: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """Sum over ranks of row ``rank`` of ``source``: fp32 ``[m]`` (in ``out`` where given)."""
    transport = links.world
    ranges = chunks(source.m, chunk, comp.codec.group_size)
    if transport.size == 1:
        return into(out, row_values(source, 0, 0, source.m))
    return into(out, torch.cat(_reduce_scatter_chunks(source, comp, transport, ranges)))


def all_reduce(source: Source, out: torch.Tensor, comp: CallCompressor, links: Links,
               chunk: int = 0) -> None:
    """Sum over ranks of ``source`` into flat ``out`` (any float dtype), identical on every rank."""
    transport = links.world
    n, r, m = transport.size, transport.rank, source.m
    right, left = (r + 1) % n, (r - 1) % n
    ranges = chunks(m, chunk, comp.codec.group_size)
    count = len(ranges)
    reduced = (_reduce_scatter_chunks(source, comp, transport, ranges) if n > 1
               else [row_values(source, 0, a, b) for a, b in ranges])
    gathered = []
    for k, (a, b) in enumerate(ranges):
        own = comp.encode(stage("ring.ag", k, count), Source(reduced[k], 1, b - a), [r])
        rows = torch.empty(n, own.shape[1], dtype=torch.uint8, device=own.device)
        rows[r] = own[0]
        gathered.append(rows)
    base = (n - 1) * count
    sends: list[Pending] = []
    inbox: list[Pending | None] = [None] * count
    for s in range(n - 1):
        segment = (r - s) % n  # forwarded at step s; arrived at step s - 1 (or own, at s = 0)
        for k in range(count):
            if s > 0:
                gathered[k][segment] = inbox[k].wait()
            sends.append(transport.send_async(gathered[k][segment], right, base + s * count + k))
            inbox[k] = transport.recv_async(gathered[k].shape[1], left, base + s * count + k)
    for k, (a, b) in enumerate(ranges):
        if n > 1:
            gathered[k][(r + 1) % n] = inbox[k].wait()
        decode_columns(comp, gathered[k], n, m, a, b, out)
    for pending in sends:
        pending.wait()
