"""`Links`: the transports one group's compressed schedules run over."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lowbitcc.transports.base import Transport
from lowbitcc.transports.topology import NodeLayout

SubTransport = Callable[[str, int, int, int], Transport]
"""``make(name, color, key, size)``: a transport over the ranks that passed the same ``name``
and ``color``, ordered by ``key``; called by every rank of the group at the same point."""


class KeptSubGroups:
    """A `SubTransport` over process groups of its own: each link's group made on first use by
    ``make_group(name, color, key, size)`` (collective over the link's ranks), handed out as
    ``wrap(name, key, size, group)`` (the transport over it, metered), and kept, so that the
    group whose links they are shuts them down (`shutdown`) or aborts them (`abort`) with itself
    (`Links.close`) rather than leaving them to torch's exit. The node and rail gloo groups of a
    group's CPU links (`transports.open_links`) and NCCL groups of its CUDA links
    (`transports.open_nccl_links`) are kept so. Made and used by the threads that call the
    group."""

    def __init__(self, make_group: Callable[[str, int, int, int], Any],
                 wrap: Callable[[str, int, int, Any], Transport]) -> None:
        self._make_group, self._wrap = make_group, wrap
        self.groups: list[Any] = []

    def __call__(self, name: str, color: int, key: int, size: int) -> Transport:
        group = self._make_group(name, color, key, size)
        self.groups.append(group)
        return self._wrap(name, key, size, group)

    def shutdown(self) -> None:
        """Shut every group made down (NCCL's: its communicator destroyed once its work is
        done)."""
        for group in self.groups:
            group.shutdown()

    def abort(self) -> None:
        """Abort every group made (NCCL's: its kernels end, torch's watchdog stops watching
        it)."""
        for group in self.groups:
            group.abort()


class Links:
    """``world`` (the whole group) and, built on first use, ``node()`` (the ranks of this
    rank's node) and ``rail()`` (the ranks with this rank's local index, one per node).

    Every rank must call ``node()`` and ``rail()`` at the same point of the same call: building
    them is collective over the group.
    """

    def __init__(self, world: Transport, layout: NodeLayout, make: SubTransport | None) -> None:
        self.world = world
        self.layout = layout
        self._make = make
        self._node: Transport | None = None
        self._rail: Transport | None = None
        self._shared: Links | None = None  # `with_world`'s: whose node and rail links these are

    @classmethod
    def of(cls, transport: Transport) -> Links:
        """Links whose world is ``transport``, one rank per node (no node or rail links): what a
        schedule gets when another schedule runs it over one of its own links."""
        layout = NodeLayout(transport.size, 1, transport.rank, 0)
        return cls(transport, layout, None)

    def with_world(self, world: Transport) -> Links:
        """These links with ``world`` in place of their world transport (a call's own metered
        copy of it, say); the node and rail links stay these links' own, built once."""
        other = Links(world, self.layout, None)
        other._shared = self if self._shared is None else self._shared
        return other

    def _sub(self, name: str, color: int, key: int, size: int) -> Transport:
        if self._make is None:
            raise RuntimeError(f"lowbitcc: these links have no {name} transport")
        return self._make(name, color, key, size)

    def close(self, abort: bool = False) -> None:
        """Shut down (``abort``: abort) the node and rail links' groups made so far, where
        their maker keeps them (`KeptSubGroups`); the world transport is the caller's."""
        if self._shared is None:
            close = getattr(self._make, "abort" if abort else "shutdown", None)
            if close is not None:
                close()

    def made(self) -> bool:
        """Whether the node and rail links are both made already (asking makes no link)."""
        links = self if self._shared is None else self._shared
        return links._node is not None and links._rail is not None

    def node(self) -> Transport:
        if self._shared is not None:
            return self._shared.node()
        if self._node is None:
            lay = self.layout
            self._node = self._sub("node", lay.node, lay.local, lay.node_size)
        return self._node

    def rail(self) -> Transport:
        if self._shared is not None:
            return self._shared.rail()
        if self._rail is None:
            lay = self.layout
            self._rail = self._sub("rail", lay.local, lay.node, lay.nodes)
        return self._rail
