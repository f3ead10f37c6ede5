"""`Route`: the device-specific part of a group's compressed calls, and the schedule a call runs.

A `Route` says which codec kernels and which links (transports) serve tensors of one device
type, whether its jobs run in the calling thread (``inline``: CUDA, see `cuda_issue`) and which
schedules its links can run; `cpu_route` and `cuda_route` build a group's. Schedules, keys,
feedback, descriptor agreement and byte accounting are shared by every device.
`choose_schedule` is ``LOCO_SCHEDULE=auto``'s rule.

The CUDA route runs over the group's inner NCCL groups: its world group (`inner_nccl`) and the
hierarchical schedule's node and rail groups, all with `inner_timeout` (lowbitcc's watchdog
owns the group's timeout), ended with the group in the order NCCL needs (`end_device_work`).
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import torch.distributed as dist

from lowbitcc import state
from lowbitcc.codec import kernels
from lowbitcc.codec.interface import Kernels
from lowbitcc.config import LocoConfig
from lowbitcc.transports import open_links, open_nccl_links
from lowbitcc.transports.gloo import GlooTransport
from lowbitcc.transports.links import Links
from lowbitcc.transports.nccl import SCHEDULES as NCCL_SCHEDULES
from lowbitcc.transports.topology import NodeLayout


@dataclasses.dataclass(frozen=True)
class Route:
    """The codec kernels and the links that compressed calls on one device type use.

    ``inline``: the jobs run in the calling thread, not on the worker (the descriptor exchange,
    which uses the inner gloo group, is then handed to the worker), and are not cut into
    chunks (``chunk_size``): chunks let a CPU rank code one while the network moves another,
    but work enqueued on one CUDA stream gains nothing from them and pays each step's launch
    overhead once per chunk; ``schedules``: the ones the links can run (None: all)."""

    kernels: Kernels
    links: Links
    inline: bool = False
    schedules: tuple[str, ...] | None = None


def choose_schedule(config: LocoConfig, nbytes: int, world: int, layout: NodeLayout) -> str:
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


def cpu_route(config: LocoConfig, world: GlooTransport, store: dist.Store,
              global_ranks: list[int], rank: int, timeout: datetime.timedelta) -> Route:
    """The `Route` of CPU tensors: the C++ kernels and ``LOCO_TRANSPORT``'s links with
    ``world`` as the gloo world link; ``inline`` under ``LOCO_ISSUER=inline``."""
    return Route(
        kernels=kernels.select(config.codec, "cpu", config.wire_group_size),
        links=open_links(config.transport, world=world, store=store, global_ranks=global_ranks,
                         rank=rank, timeout=timeout, node_size=config.node_size,
                         stats=state.STATS),
        inline=config.issuer == "inline")


def cuda_route(config: LocoConfig, nccl: Any, store: dist.Store, global_ranks: list[int],
               rank: int, timeout: datetime.timedelta) -> Route:
    """The `Route` of CUDA tensors: the CUDA kernels and the links over ``nccl``, the group's
    inner ``ProcessGroupNCCL`` (node and rail NCCL groups on ``store`` where the hierarchical
    schedule asks, with the inner groups' timeout, `cuda_issue.inner_timeout`, where the
    group's is ``timeout``); inline, the schedules NCCL's links can run."""
    return Route(kernels=kernels.select(config.codec, "cuda", config.wire_group_size),
                 links=open_nccl_links(nccl, state.STATS, store=store, global_ranks=global_ranks,
                                       rank=rank, timeout=inner_timeout(timeout),
                                       node_size=config.node_size),
                 inline=True, schedules=NCCL_SCHEDULES)


def end_device_work(graphs: Any, links: Any, nccl: Any, timeout_s: float, abort: bool) -> None:
    """End a group's CUDA work in the order NCCL needs, each step even where one before it
    raised: its places' ``graphs`` (`place_graph.LiveGraphs.release`, waiting at most
    ``timeout_s``), then the node and rail groups of its ``links`` (`Links.close`), then its
    inner world group ``nccl``; the groups shut down, or where ``abort`` aborted (the
    watchdog's end of a group past its timeout)."""
    try:
        graphs.release(timeout_s)
    finally:
        try:
            links.close(abort=abort)
        finally:
            (nccl.abort if abort else nccl.shutdown)()


INNER_TIMEOUT_SLACK = datetime.timedelta(seconds=60)
"""What the inner NCCL groups' timeout adds to twice the group's (`inner_timeout`)."""


def inner_timeout(timeout: datetime.timedelta) -> datetime.timedelta:
    """The timeout of a group's inner NCCL groups (its world group and its node and rail
    groups) where the group's own is ``timeout``: twice it plus `INNER_TIMEOUT_SLACK`.

    lowbitcc's watchdog owns the group's timeout (`watchdog.Watchdog`): at ``timeout`` it fails
    the call by name and aborts the inner groups, and ``ProcessGroupNCCL.abort`` stops torch's
    own NCCL watchdog for them without taking the process down. torch's watchdog, which with
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING``'s default ends the process at its own timeout, is given
    a longer one, so that it acts only where lowbitcc's did not (a process that stopped
    polling, say)."""
    return timeout * 2 + INNER_TIMEOUT_SLACK


def inner_nccl(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta,
               global_ranks: list[int] | None, group_id: str) -> Any:
    """A group's inner ``ProcessGroupNCCL`` on its own store prefix, named and numbered as
    c10d names and numbers the NCCL groups it creates itself; ``timeout``: the group's (the
    inner group's is `inner_timeout`'s)."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = inner_timeout(timeout)
    options.is_high_priority_stream = False
    options.global_ranks_in_group = global_ranks or list(range(size))
    options.group_name = f"{group_id}/lowbitcc" if group_id else "lowbitcc"
    nccl = dist.ProcessGroupNCCL(dist.PrefixStore("lowbitcc/nccl", store), rank, size, options)
    nccl._set_sequence_number_for_group()
    return nccl
