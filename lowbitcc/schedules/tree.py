"""The tree schedule: a binary tree rooted at rank 0, for small messages (few, sequential hops).

Rank ``r``'s children are ``2r+1`` and ``2r+2`` (those below ``n``); its parent ``(r-1)//2``.
Up the tree, every rank waits for its children's codes of the *whole* tensor (all ``n`` rows),
decodes and sums them in fp32 with its own values, and, unless it is the root, quantizes that
partial sum (stage ``tree.up``; a leaf quantizes its own input) and sends it to its parent.
The root quantizes the total once (stage ``tree.down``) and the codes go down the tree
unchanged; every rank decodes them, so all-reduce results are bitwise identical everywhere.
Reduce-scatter is the same with each rank decoding only its own row. The tree never chunks:
it is meant for messages small enough that latency, not bandwidth, sets the time.

Traffic per rank: up to 3 messages of the whole tensor (``n m`` elements) up and down, against
``2(n-1)`` of ``m`` for direct; ``2d`` sequential hops. Quantizations on an
element's path: ``d + 1``, ``d = floor(log2 n)`` the tree's depth. Error bound (nearest
rounding, fresh error state, ``q`` and ``A`` as in `ring`): ``(d + 1) A / 2q``, for both
collectives.
"""

from __future__ import annotations

import torch

from lowbitcc.compressor import CallCompressor, Source
from lowbitcc.schedules.chunking import all_values
from lowbitcc.transports.base import Transport
from lowbitcc.transports.links import Links

UP, DOWN = 0, 1  # message tags


def depth(n: int) -> int:
    """Depth of the tree over ``n`` ranks (0 for one rank)."""
    return (n).bit_length() - 1


def _reduce_and_broadcast(source: Source, comp: CallCompressor, transport: Transport) -> torch.Tensor:
    """The root's codes of the sum of every row, ``uint8 [n, P]``, as received by this rank."""
    n, r, m = transport.size, transport.rank, source.m
    rows = list(range(source.rows))
    width = comp.codec.message_bytes(m)
    children = [c for c in (2 * r + 1, 2 * r + 2) if c < n]
    inbox = [transport.recv_async(source.rows * width, c, UP) for c in children]
    if children:
        received = torch.stack([p.wait().view(source.rows, width) for p in inbox], dim=1)
        partial = all_values(source)
        for j in rows:
            partial[j * m:(j + 1) * m] += comp.decode_sum(received[j], m, j)
        summed = Source(partial, source.rows, m)
    else:
        summed = source
    if r == 0:
        codes = comp.encode("tree.down", summed, rows)
    else:
        up = comp.encode("tree.up", summed, rows)
        sent = transport.send_async(up.reshape(-1), (r - 1) // 2, UP)
        codes = transport.recv_async(up.numel(), (r - 1) // 2, DOWN).wait().view(source.rows, width)
        sent.wait()
    for pending in [transport.send_async(codes.reshape(-1), c, DOWN) for c in children]:
        pending.wait()
    return codes


def decode_kept(children: torch.Tensor | None, codes: torch.Tensor, comp: CallCompressor,
                m: int, rank: int, out: torch.Tensor | None,
                own: torch.Tensor | None = None) -> None:
    """The decodes of a run whose transfers are done, in the schedule's order, from the messages
    kept: ``children`` (uint8 ``[children, n, P]``, each child's messages of every row; None:
    a leaf), each row's decoded only for what it tells of the call (a foreign message's error,
    kept by ``comp``: what it sent is sent), then the root's ``codes`` (uint8 ``[n, P]``) into
    flat ``out`` (an all-reduce), or this rank's row of them into ``own`` (fp32 ``[m]``: a
    reduce-scatter). A call place's C++ core (`backend.plan_cores`) hands these to the plan
    where a message of its run did not belong to the call, so that the run's results and error
    are the Python path's."""
    if children is not None:
        scratch = comp.scratch(m, codes.device)
        for j in range(codes.shape[0]):
            comp.decode_sum(children[:, j], m, j, scratch)
    if out is not None:
        comp.decode_into(codes, m, list(range(codes.shape[0])), out)
    else:
        comp.decode_sum(codes[rank:rank + 1], m, rank, own)


def reduce_scatter(source: Source, comp: CallCompressor, links: Links,
                   chunk: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """Sum over ranks of row ``rank`` of ``source``: fp32 ``[m]``, in ``out`` where given
    (``chunk`` unused)."""
    transport = links.world
    codes = _reduce_and_broadcast(source, comp, transport)
    r = transport.rank
    return comp.decode_sum(codes[r:r + 1], source.m, r, out)


def all_reduce(source: Source, out: torch.Tensor, comp: CallCompressor, links: Links,
               chunk: int = 0) -> None:
    """Sum over ranks of ``source`` into flat ``out``, identical on every rank (``chunk`` unused)."""
    transport = links.world
    codes = _reduce_and_broadcast(source, comp, transport)
    comp.decode_into(codes, source.m, list(range(source.rows)), out)
