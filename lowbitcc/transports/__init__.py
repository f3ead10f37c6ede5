"""Transports: how the compressed schedules' bytes move between the ranks of a "loco" group.

`base.Transport` is the interface (six methods on uint8 tensors); ``gloo`` and ``mpi`` move CPU
tensors, ``nccl`` CUDA tensors. `open_links` builds a group's `Links` for CPU tensors (world, and
node/rail on first use) for the ``LOCO_TRANSPORT`` kind, `open_nccl_links` those for CUDA
tensors; `NAMES` lists the kinds, and `lowbitcc.config` validates against it.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from lowbitcc.counters import Stats
from lowbitcc.transports import topology
from lowbitcc.transports.base import Pending, Transport
from lowbitcc.transports.gloo import GlooTransport
from lowbitcc.transports.links import KeptSubGroups, Links
from lowbitcc.transports.metered import MeteredTransport

NAMES = ("gloo", "mpi", "nccl")
"""Transport kinds (``LOCO_TRANSPORT``, with "auto"). "nccl" is for CUDA tensors."""

CPU_NAMES = ("gloo", "mpi")
CUDA_NAMES = ("nccl",)


def cpu_kind(kind: str) -> str:
    """The transport of CPU tensors under ``LOCO_TRANSPORT=kind``: "auto" and "nccl" (a choice
    for CUDA tensors) mean gloo."""
    return "gloo" if kind in ("auto", *CUDA_NAMES) else kind


def open_nccl_links(group: object, stats: Stats, *, store: dist.Store,
                    global_ranks: Sequence[int], rank: int, timeout: datetime.timedelta,
                    node_size: int) -> Links:
    """The `Links` for CUDA tensors of a group whose rank ``i`` is global rank
    ``global_ranks[i]``: the world link over ``group`` (a ``ProcessGroupNCCL``), node and rail
    links over NCCL groups on ``store`` made on first use with ``timeout`` (`nccl.sub_group`,
    kept by `KeptSubGroups`, shut down or aborted by `Links.close`); every link metered into
    ``stats`` by link class, as `open_links`' are."""
    from lowbitcc.transports.nccl import NcclTransport, sub_group

    node_size = topology.node_size_from(node_size)
    layout = topology.layout(global_ranks, rank, node_size)
    same_node = topology.same_node(global_ranks, rank, node_size)

    def nccl_group(name: str, color: int, key: int, size: int) -> Any:
        return sub_group(store, name, color, key, size, timeout)

    return Links(MeteredTransport(NcclTransport(group), stats, same_node=same_node), layout,
                 KeptSubGroups(nccl_group, _metered_sub(stats, NcclTransport)))


def gloo_sub_groups(store: dist.Store, timeout: datetime.timedelta, stats: Stats,
                    ) -> KeptSubGroups:
    """The node and rail links of a group's CPU links (`open_links`, "gloo"): each a
    ``ProcessGroupGloo`` made on first use on ``store`` (prefix ``lowbitcc/gloo-{name}{color}``)
    with ``timeout``, metered into ``stats``, kept for the group's shutdown."""

    def gloo_group(name: str, color: int, key: int, size: int) -> Any:
        prefixed = dist.PrefixStore(f"lowbitcc/gloo-{name}{color}", store)
        return dist.ProcessGroupGloo(prefixed, key, size, timeout)

    return KeptSubGroups(gloo_group, _metered_sub(stats, GlooTransport))


def _metered_sub(stats: Stats, link: Callable[[Any], Transport],
                 ) -> Callable[[str, int, int, Any], Transport]:
    """How a node or rail link (`links.SubTransport`) is handed out, whatever its transport:
    ``wrap(name, key, size, group)`` is ``link(group)`` metered into ``stats``, this rank
    ``key`` of ``size``, its same-node ranks those a node link's ranks share (all) or a rail
    link's (one per node: only itself)."""

    def wrap(name: str, key: int, size: int, group: Any) -> Transport:
        same_node = [True] * size if name == "node" else [i == key for i in range(size)]
        return MeteredTransport(link(group), stats, same_node=same_node)

    return wrap


def open_links(kind: str, *, world: GlooTransport, store: dist.Store, global_ranks: Sequence[int],
               rank: int, timeout: datetime.timedelta, node_size: int, stats: Stats) -> Links:
    """The `Links` for CPU tensors of a group whose rank ``i`` is global rank ``global_ranks[i]``.

    ``kind`` is "gloo" or "mpi" (see `cpu_kind` for "auto" and "nccl"). ``world`` is the
    group's inner gloo transport (gloo's world link); node and rail gloo groups live on
    ``store`` (`gloo_sub_groups`, shut down by `Links.close`). Every link is metered into
    ``stats``. Collective over the group when ``kind`` is "mpi".
    """
    kind = cpu_kind(kind)
    node_size = topology.node_size_from(node_size)
    layout = topology.layout(global_ranks, rank, node_size)
    same_node = topology.same_node(global_ranks, rank, node_size)
    if kind == "gloo":
        return Links(MeteredTransport(world, stats, same_node=same_node), layout,
                     gloo_sub_groups(store, timeout, stats))
    if kind == "mpi":
        from lowbitcc.transports import mpi

        comm = mpi.communicator(global_ranks, rank)
        timeout_s = timeout.total_seconds()
        metered = _metered_sub(stats, lambda split: mpi.MpiTransport(split, timeout_s))

        def mpi_split(name: str, color: int, key: int, size: int) -> Transport:
            return metered(name, key, size, comm.Split(color, key))

        return Links(MeteredTransport(mpi.MpiTransport(comm, timeout_s), stats,
                                      same_node=same_node), layout, mpi_split)
    raise ValueError(f"lowbitcc: LOCO_TRANSPORT={kind} is not one of {', '.join(NAMES)}")


__all__ = ["NAMES", "GlooTransport", "Links", "MeteredTransport", "Pending", "Transport",
           "cpu_kind", "open_links", "open_nccl_links"]
