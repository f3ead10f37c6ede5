"""Node layout of a group: which ranks share a node (fast links) and which cross nodes.

The hierarchical schedule needs every node to hold the same number ``L`` of the group's ranks,
placed contiguously: group rank ``r`` is local rank ``r % L`` on node ``r // L``. A node is
``node_size`` consecutive *global* ranks; ``node_size`` comes from config (``LOCO_NODE_SIZE``)
or, when that is 0, from the launcher's ``LOCAL_WORLD_SIZE`` (torchrun, or set by lowbitcc
from mpiexec/srun), so that one machine can emulate several nodes.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """``nodes`` nodes of ``node_size`` ranks; this rank is ``local`` on node ``node``.

    ``regular`` is False when the group's ranks do not split into equal contiguous nodes; the
    hierarchical schedule then cannot run (the other fields describe one node of everyone).
    """

    nodes: int
    node_size: int
    node: int
    local: int
    regular: bool = True


def node_size_from(config_value: int, environ: Mapping[str, str] | None = None) -> int:
    """``config_value`` if positive, else ``LOCAL_WORLD_SIZE`` from the launcher, else 0
    (unknown: every rank on one node)."""
    if config_value > 0:
        return config_value
    environ = os.environ if environ is None else environ
    try:
        return max(0, int(environ.get("LOCAL_WORLD_SIZE", "0")))
    except ValueError:
        return 0


def same_node(global_ranks: Sequence[int], group_rank: int, node_size: int) -> list[bool]:
    """For each rank of a group whose rank ``i`` is global rank ``global_ranks[i]``: whether it
    is on group rank ``group_rank``'s node (nodes of ``node_size`` consecutive global ranks; 0:
    unknown, every rank on one node)."""
    if node_size <= 0:
        return [True] * len(global_ranks)
    mine = global_ranks[group_rank] // node_size
    return [g // node_size == mine for g in global_ranks]


def layout(global_ranks: Sequence[int], group_rank: int, node_size: int) -> NodeLayout:
    """The layout of a group whose rank ``i`` is global rank ``global_ranks[i]``."""
    size = len(global_ranks)
    one_node = NodeLayout(1, size, 0, group_rank)
    if node_size <= 0:
        return one_node
    node_of = [g // node_size for g in global_ranks]
    distinct = list(dict.fromkeys(node_of))
    per_node = size // len(distinct)
    contiguous = all(node_of[i] == distinct[i // per_node] for i in range(size))
    if size % len(distinct) or not contiguous:
        return dataclasses.replace(one_node, regular=False)
    return NodeLayout(len(distinct), per_node, group_rank // per_node, group_rank % per_node)
