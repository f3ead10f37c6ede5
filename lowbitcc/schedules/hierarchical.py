"""The hierarchical schedule: exact inside a node, low-bit across nodes.

With ``N`` nodes of ``L`` ranks (`topology.NodeLayout`; rank ``r`` is local rank ``l = r % L``
on node ``r // L``), row ``j`` of the source belongs to local rank ``j % L`` of node ``j // L``:

1. node reduce-scatter, exact: local rank ``l`` receives, in fp32 over the node's links, the
   rows ``{v L + l : v < N}`` of every rank of its node and sums them in local-rank order;
2. rail reduce-scatter, compressed: the ``N`` ranks of local index ``l`` (one per node, the
   *rail*) run the direct schedule on those ``N`` rows (stages ``hier.rs``); rank ``v L + l``
   ends with its own row. This is the result of a reduce-scatter.

All-reduce continues:

3. rail all-gather, compressed (direct, stage ``hier.ag``): every rail member decodes the
   same codes, so the ``N`` rows of rail ``l`` are identical on every node;
4. node all-gather, exact: each rank gathers its node's ``L`` rails in fp32.

Only the slow dimension (across nodes) carries codes, as the hybrid-compression paper
(arXiv 2409.02423) prescribes. Traffic per rank: ``(L-1)`` fp32 messages of ``N m`` elements in
the node per phase, and the direct schedule's ``(N-1)`` coded messages of ``m`` across. With one
node the schedule is exact; with one rank per node it is direct. Quantizations: as direct (1 for
reduce-scatter, 2 for all-reduce), so its error bound is direct's (``A / 2q`` and ``A / q``).
"""

from __future__ import annotations

import torch

from lowbitcc.compressor import CallCompressor, Source
from lowbitcc.schedules import direct
from lowbitcc.schedules.chunking import all_values, into
from lowbitcc.transports.links import Links

PREFIX = "hier."


def _check(links: Links, rows: int) -> None:
    lay = links.layout
    if not lay.regular or lay.nodes * lay.node_size != rows:
        raise ValueError(
            f"lowbitcc: the hierarchical schedule needs the group's {rows} ranks on equal nodes "
            f"of consecutive ranks (LOCO_NODE_SIZE or the launcher's LOCAL_WORLD_SIZE); "
            "choose another LOCO_SCHEDULE"
        )


def _node_reduce(source: Source, comp: CallCompressor, links: Links) -> torch.Tensor:
    """Step 1: fp32 ``[N * m]``, the node's sum of rows ``v L + l`` (``v`` = 0..N-1), in
    buffers the compressor keeps (`CallCompressor.kept`; a call plan's are the same every run)."""
    lay, m, device = links.layout, source.m, source.tensor.device
    size = source.rows * m
    values = all_values(source, comp.kept(PREFIX + "values", size, torch.float32, device))
    by_local = values.view(lay.nodes, lay.node_size, m).transpose(0, 1)
    if lay.node_size == 1:
        return values
    send = comp.kept(PREFIX + "node send", size, torch.float32, device)
    send.view(lay.node_size, lay.nodes, m).copy_(by_local)
    received = links.node().all_to_all_async(
        send.view(lay.node_size, -1).view(torch.uint8),
        comp.received(PREFIX + "node.rs", 4 * size, device)).wait().view(torch.float32)
    total = comp.kept(PREFIX + "node sum", lay.nodes * m, torch.float32, device)
    total.copy_(received[0])
    for row in received[1:]:
        total += row
    return total


def reduce_scatter(source: Source, comp: CallCompressor, links: Links, chunk: int = 0,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Sum over ranks of row ``rank`` of ``source``: fp32 ``[m]`` (in ``out`` where given)."""
    _check(links, source.rows)
    lay = links.layout
    partial = _node_reduce(source, comp, links)
    if lay.nodes == 1:
        return into(out, partial)
    return direct.reduce_scatter(Source(partial, lay.nodes, source.m), comp,
                                 Links.of(links.rail()), chunk, prefix=PREFIX, out=out)


def all_reduce(source: Source, out: torch.Tensor, comp: CallCompressor, links: Links,
               chunk: int = 0) -> None:
    """Sum over ranks of ``source`` into flat ``out``, identical on every rank."""
    _check(links, source.rows)
    lay, m, device = links.layout, source.m, source.tensor.device
    partial = _node_reduce(source, comp, links)
    if lay.nodes == 1:
        rail = partial
    else:
        rail = comp.kept(PREFIX + "rail", lay.nodes * m, torch.float32, device)
        direct.all_reduce(Source(partial, lay.nodes, m), rail, comp, Links.of(links.rail()), chunk,
                          prefix=PREFIX)
    if lay.node_size == 1:
        out.copy_(rail[: out.numel()])
        return
    rails = links.node().all_gather_async(
        rail.view(torch.uint8),
        comp.received(PREFIX + "node.ag", 4 * lay.node_size * rail.numel(), device)
    ).wait().view(torch.float32)
    by_node = rails.view(lay.node_size, lay.nodes, m).transpose(0, 1)
    if out.numel() == source.rows * m and out.is_contiguous():  # straight into the output
        out.view(lay.nodes, lay.node_size, m).copy_(by_node)
        return
    everything = comp.kept(PREFIX + "everything", source.rows * m, torch.float32, device)
    everything.view(lay.nodes, lay.node_size, m).copy_(by_node)
    out.copy_(everything[: out.numel()])
