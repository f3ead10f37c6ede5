"""`Links`: the transports one group's compressed schedules run over."""

from __future__ import annotations

from collections.abc import Callable

from lowbitcc.backends.base import Transport
from lowbitcc.topology import NodeLayout

SubTransport = Callable[[str, int, int, int], Transport]
"""``make(name, color, key, size)``: a transport over the ranks that passed the same ``name``
and ``color``, ordered by ``key``; called by every rank of the group at the same point."""


class Links:
    """``world`` (the whole group) and, built on first use, ``node()`` (the ranks of this
    rank's node) and ``rail()`` (the ranks with this rank's local index, one per node).

    Every rank must call ``node()`` and ``rail()`` at the same point of the same call: building
    them is collective over the group.
    """

    def __init__(self, world: Transport, layout: NodeLayout, make: SubTransport) -> None:
        self.world = world
        self.layout = layout
        self._make = make
        self._node: Transport | None = None
        self._rail: Transport | None = None

    def node(self) -> Transport:
        if self._node is None:
            lay = self.layout
            self._node = self._make("node", lay.node, lay.local, lay.node_size)
        return self._node

    def rail(self) -> Transport:
        if self._rail is None:
            lay = self.layout
            self._rail = self._make("rail", lay.local, lay.node, lay.nodes)
        return self._rail
