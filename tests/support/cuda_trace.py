"""What traces the CUDA code branch without a GPU (`tests/codec/test_cuda_launch_budget.py`,
`tests/probes/cuda_branch_host.py`): the GPU work a call issues, a recording stand-in for the
inner NCCL group, and the group a `call_plan.CallPlan` asks of, for rank 0 of ``world``."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import types

import torch
from torch._C._distributed_c10d import FakeProcessGroup

from lowbitcc import state
from lowbitcc.backend.call_plan import CallPlan
from lowbitcc.backend.compressed_calls import CompressedCalls
from lowbitcc.backend.place_graph import LiveGraphs
from lowbitcc.codec import cuda
from lowbitcc.codec.formats import FORMATS
from lowbitcc.codec.shard_codec import ShardCodec
from lowbitcc.config import LocoConfig
from lowbitcc.counters import Stats
from lowbitcc.transports.links import Links
from lowbitcc.transports.metered import MeteredTransport
from lowbitcc.transports.nccl import NcclTransport
from lowbitcc.transports.topology import NodeLayout


@dataclasses.dataclass
class GpuWork:
    kernels: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    launches: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    allocations: int = 0
    host_to_device: int = 0
    synchronisations: int = 0
    nccl: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @property
    def total_kernels(self) -> int:
        """Kernels of lowbitcc's own: torch's and the CUDA codec's (NCCL's not included)."""
        return sum(self.kernels.values()) + sum(self.launches.values())


class RecordingGroup:
    """The inner NCCL group: records each collective (on a GPU, NCCL's own kernel)."""

    def __init__(self, work: GpuWork, rank: int, size: int) -> None:
        self.work, self._rank, self._size = work, rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def alltoall_base(self, recv, send, *args):
        self.work.nccl["all_to_all"] += 1

    def _allgather_base(self, recv, send, *args):
        self.work.nccl["all_gather"] += 1


class PlanGroup:
    """What a `call_plan.CallPlan` asks of its group (`compressed_call.CallGroup`), for rank 0
    of ``world`` ranks whose codec is ``codec`` and whose calls are keyed "bucket", feedback on
    (an int8 error state) or off."""

    def __init__(self, world: int, codec: ShardCodec, feedback: bool = True,
                 graphs: bool = False, schedule: str = "direct") -> None:
        self.rank, self.size, self._codec, self._schedule = 0, world, codec, schedule
        self.config = LocoConfig(feedback=feedback, call_graphs=graphs)
        self.agreement = types.SimpleNamespace(next_seq=itertools.count(1).__next__)
        self.graphs = LiveGraphs()

    def codec(self, *args) -> ShardCodec:
        return self._codec

    def key(self, *args) -> tuple[str, bool]:
        return "bucket", False

    def modelled(self, numel: int) -> bool:
        return False

    def schedule_for(self, *args) -> str:
        return self._schedule

    def chunk(self, *args) -> int:
        return 0

    compressor = CompressedCalls.compressor  # the group's own: config and rank


class TracedPlan(CallPlan):
    """A `CallPlan` whose ``run(tensor, op, output=None)`` takes its call number from its
    group and its feedback key "bucket", as `reductions.Reductions` hands them to a run (where
    they are given, `CallPlan.run` itself)."""

    def run(self, tensor, op, output=None, *taken) -> None:  # type: ignore[override]
        if not taken:
            key = "" if self.comp.error_dtype is None else "bucket"
            taken = (self.group.agreement.next_seq(), key, None, False)
        super().run(tensor, op, output, *taken)


def meta_plan(work: GpuWork, world: int, numel: int, fmt: str = "mxfp4",
              collective: str = "all_reduce", feedback: bool = True, graphs: bool = False,
              replay: bool = True, stats: Stats | None = None, node_size: int = 0,
              c10d: bool = False) -> tuple[CallPlan, torch.Tensor, torch.Tensor | None]:
    """Rank 0's `CallPlan` of an all-reduce of ``numel`` fp32 elements on ``device="meta"``
    (or a reduce-scatter of them into ``numel / world``) on the CUDA code branch (the CUDA
    kernels, ``fmt``'s width and default group, checksums off; ``graphs``: ``call_graphs``,
    ``replay`` False: every run eager), its transfers metered into ``stats`` (default `state.STATS`
    now) as `transports.open_nccl_links`' are, its
    NCCL collectives recorded in ``work``; with its input and (reduce-scatter) output.
    ``node_size`` > 0: the hierarchical schedule over nodes of that many ranks (rank 0's node and
    rail links recorded in ``work`` too). ``c10d``: the world link's group is torch's C++
    ``FakeProcessGroup`` (a c10d backend whose collectives do nothing, as a C++ replay of a
    record issues them on ProcessGroupNCCL; ``work`` then counts none of them). The caller replaces
    `cuda._launch` (no GPU) and, where it counts, `lowbitcc.state`'s store and statistics."""
    codec = ShardCodec(bits=FORMATS[fmt].width, group_size=FORMATS[fmt].default_group,
                       dtype_code=0, seq=0,
                       world=world, signature=1, fmt=fmt, kernels=cuda.KERNELS, checksum=False)
    group = (FakeProcessGroup._create_internal(0, world) if c10d
             else RecordingGroup(work, 0, world))
    transport = MeteredTransport(NcclTransport(group),  # as on a GPU
                                 state.STATS if stats is None else stats)
    if node_size:
        layout = NodeLayout(world // node_size, node_size, 0, 0)
        links = Links(transport, layout, lambda name, color, key, size: NcclTransport(
            RecordingGroup(work, 0, size)))
    else:
        links = Links.of(transport)
    route = types.SimpleNamespace(links=links)
    x = torch.empty(numel, device="meta")
    out = torch.empty(numel // world, device="meta") if collective == "reduce_scatter" else None
    plan = TracedPlan(PlanGroup(world, codec, feedback, graphs,
                                "hierarchical" if node_size else "direct"), route, x, collective)
    if not replay and not graphs:  # every run eager
        plan.graph = None
    return plan, x, out
