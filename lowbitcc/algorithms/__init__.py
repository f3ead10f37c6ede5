"""Compressed reduce-scatter / all-reduce schedules (see docs/algorithms.md).

Each schedule module has ``reduce_scatter(source, comp, transport, chunk)`` and
``all_reduce(source, out, comp, transport, chunk)``; the hierarchical one takes the group's
`Links` instead of one transport. `choose` resolves ``"auto"``; `reduce_scatter` and
`all_reduce` run a named schedule over a group's `Links`.
"""

from __future__ import annotations

import torch

from lowbitcc.algorithms import direct, hierarchical, ring, tree
from lowbitcc.backends.links import Links
from lowbitcc.compressor import CallCompressor, Source
from lowbitcc.config import SCHEDULES as _NAMES
from lowbitcc.config import LocoConfig
from lowbitcc.topology import NodeLayout

SCHEDULES = {"direct": direct, "ring": ring, "tree": tree, "hierarchical": hierarchical}
assert (*SCHEDULES, "auto") == _NAMES, "config.SCHEDULES must name every schedule"


def choose(config: LocoConfig, nbytes: int, world: int, layout: NodeLayout) -> str:
    """The schedule for a call of ``nbytes`` input bytes per rank on ``world`` ranks.

    ``config.schedule`` unless it is "auto"; auto takes hierarchical when the group spans
    several nodes of several ranks each, else tree below ``config.auto_tree_bytes`` from
    ``config.auto_tree_ranks`` ranks on, else ring from ``config.auto_ring_ranks`` ranks on,
    else direct. Every input is the same on every rank, so every rank chooses the same.
    """
    if config.schedule != "auto":
        return config.schedule
    if layout.regular and layout.nodes > 1 and layout.node_size > 1:
        return "hierarchical"
    if nbytes < config.auto_tree_bytes and world >= config.auto_tree_ranks:
        return "tree"
    if config.auto_ring_ranks and world >= config.auto_ring_ranks:
        return "ring"
    return "direct"


def _target(name: str, links: Links):
    return links if name == "hierarchical" else links.world


def reduce_scatter(name: str, source: Source, comp: CallCompressor, links: Links,
                   chunk: int) -> torch.Tensor:
    """Schedule ``name``'s reduce-scatter: fp32 ``[m]``, the sum of this rank's row."""
    return SCHEDULES[name].reduce_scatter(source, comp, _target(name, links), chunk)


def all_reduce(name: str, source: Source, out: torch.Tensor, comp: CallCompressor, links: Links,
               chunk: int) -> None:
    """Schedule ``name``'s all-reduce into flat ``out``."""
    SCHEDULES[name].all_reduce(source, out, comp, _target(name, links), chunk)


__all__ = ["SCHEDULES", "all_reduce", "choose", "direct", "hierarchical", "reduce_scatter",
           "ring", "tree"]
