"""`LocoProcessGroup`: the torch ``ProcessGroup`` behind ``init_process_group("loco")``.

This module answers c10d and delegates; it checks arguments and decides, per call, which path
runs it:

- exact calls go to the group's inner ``ProcessGroupGloo`` (built on the same store), so they
  equal gloo bit for bit; reductions through `exact.ExactReduction` (AVG and PREMUL_SUM
  emulated);
- compressible calls (`lowbitcc.policy`) go to `compressed_call.CompressedCalls`, which runs a
  compressed schedule over the group's links: the inner gloo group, or MPI, or further node and
  rail groups (``LOCO_TRANSPORT``, ``LOCO_SCHEDULE``);
- every call, either path, is queued in issue order on the group's `issue_queue.IssueQueue` and
  returns its `LocoWork`.

Device seam: compressed calls are routed by the tensor's device type (`compressed_call.Route`:
codec kernels plus links); this group serves CPU tensors.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from lowbitcc import policy, state
from lowbitcc.backend import BACKEND_NAME
from lowbitcc.backend.compressed_call import CollectiveMismatchError, CompressedCalls, Route
from lowbitcc.backend.exact import (
    ExactReduction,
    op_type,
    reduce_scatter_flat_into,
    reduce_scatter_into,
)
from lowbitcc.backend.issue_queue import InnerWork, IssueQueue, Job, LocoWork
from lowbitcc.codec import kernels
from lowbitcc.config import LocoConfig
from lowbitcc.transports import open_links
from lowbitcc.transports.gloo import GlooTransport

log = logging.getLogger("lowbitcc")

__all__ = ["CollectiveMismatchError", "LocoProcessGroup", "LocoWork"]


def _flat(tensors: list[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for t in tensors:
        out.extend(_flat(t) if isinstance(t, list | tuple) else [t])
    return out


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class LocoProcessGroup(dist.ProcessGroup):
    """The "loco" process group for CPU tensors. Create it with ``init_process_group("loco")``."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta,
                 config: LocoConfig, global_ranks: list[int] | None = None) -> None:
        """``global_ranks[i]`` is the default group's rank of this group's rank ``i`` (None:
        this is the default group)."""
        super().__init__(rank, size)
        self.config = config
        self.timeout = timeout
        self._group_name = ""
        self._group_desc = ""
        self._inner = dist.ProcessGroupGloo(
            dist.PrefixStore("lowbitcc/gloo", store), rank, size, timeout)
        self._gloo = GlooTransport(self._inner)
        cpu = Route(
            kernels=kernels.select(config.codec, "cpu", config.group_size),
            links=open_links(config.transport, world=self._gloo, store=store,
                             global_ranks=global_ranks or list(range(size)), rank=rank,
                             timeout=timeout, node_size=config.node_size, stats=state.STATS),
        )
        self._compressed = CompressedCalls(rank, size, config, self._gloo, {"cpu": cpu})
        self._queue = IssueQueue(f"lowbitcc-r{rank}", self._gloo.retire)

    # -- identity -----------------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 (c10d's name)
        return BACKEND_NAME

    _get_backend_name = getBackendName
    name = getBackendName  # type: ignore[assignment]

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name
        self._compressed.group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._group_name

    @property
    def group_desc(self) -> str:  # type: ignore[override]
        return self._group_desc

    def shutdown(self) -> None:
        if self._queue.shutdown(self.timeout.total_seconds()):
            self._inner.shutdown()

    abort = shutdown

    # -- the two paths ------------------------------------------------------------------------
    def _compressible(self, tensors: list[torch.Tensor], op: Any) -> bool:
        return (
            self.config.policy != "never"
            and all(policy.eligible(t, op_type(op)) and self._compressed.serves(t.device)
                    for t in tensors)
            and policy.wants_compression(self.config.policy)
        )

    def _exact(self, method: str, outputs: list[Any], *args: Any) -> LocoWork:
        """Queue ``inner.<method>(*args)``; the Work's value is ``outputs`` flattened."""
        state.STATS.add("exact", calls=1, tensor_bytes=_bytes(_flat(list(args[:1]))))

        def job() -> InnerWork:
            return InnerWork(getattr(self._inner, method)(*args), lambda: _flat(outputs))

        return self._queue.submit(job)

    def _reduction(self, opts: Any, inputs: list[torch.Tensor], outputs: list[torch.Tensor],
                   issue: Any, *, in_place: bool) -> ExactReduction:
        return ExactReduction(opts, inputs, outputs, issue, in_place=in_place, world=self.size())

    # -- c10d methods: reductions -------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> LocoWork:
        opts = opts if opts is not None else dist.AllreduceOptions()
        _check_tensors("all_reduce", tensors)
        return self._all_reduce(tensors, opts, self._inner.allreduce)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> LocoWork:
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        _check_tensors("all_reduce_coalesced", tensors)
        return self._all_reduce(tensors, opts, self._inner.allreduce_coalesced)

    def _all_reduce(self, tensors: list[torch.Tensor], opts: Any, issue: Any) -> LocoWork:
        if not self._compressible(tensors, opts.reduceOp):
            return self._queue.submit(self._reduction(opts, tensors, tensors, issue, in_place=True))
        single = opts
        if not isinstance(opts, dist.AllreduceOptions):
            single = dist.AllreduceOptions()
            single.reduceOp = opts.reduceOp
        jobs = [self._compressed.all_reduce(
                    t, opts.reduceOp,
                    exact=self._reduction(single, [t], [t], self._inner.allreduce, in_place=True))
                for t in tensors]
        return self._queue.submit(self._queue.sequence(jobs, tensors))

    def reduce_scatter(self, output_tensors: list[torch.Tensor],
                       input_tensors: list[list[torch.Tensor]], opts: Any = None) -> LocoWork:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        if len(output_tensors) != 1 or len(input_tensors) != 1:
            raise ValueError("lowbitcc: reduce_scatter takes one output and one input list")
        output, inputs = output_tensors[0], input_tensors[0]
        if len(inputs) != self.size():
            raise ValueError(
                f"lowbitcc: reduce_scatter needs {self.size()} input tensors, got {len(inputs)}")
        _check_tensors("reduce_scatter", [output, *inputs])
        if any(t.shape != output.shape or t.dtype != output.dtype for t in inputs):
            raise ValueError(
                "lowbitcc: reduce_scatter inputs must all match the output's shape and dtype")
        exact = self._reduction(opts, inputs, [output], reduce_scatter_into(self._inner, output),
                                in_place=False)
        if not self._compressible([output], opts.reduceOp):
            return self._queue.submit(exact)
        source = torch.stack([t.reshape(-1) for t in inputs])
        job = self._compressed.reduce_scatter(output, source, opts.reduceOp, exact=exact)
        return self._queue.submit(self._queue.sequence([job], [output]))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                              opts: Any = None) -> LocoWork:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self.reduce_scatter_single_coalesced([output], [input], opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> LocoWork:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        if len(outputs) != len(inputs):
            raise ValueError("lowbitcc: reduce_scatter needs as many outputs as inputs")
        _check_tensors("reduce_scatter", [*outputs, *inputs])
        for out, inp in zip(outputs, inputs):
            if inp.numel() != out.numel() * self.size() or inp.dtype != out.dtype:
                raise ValueError(
                    f"lowbitcc: reduce_scatter input of {inp.numel()} {inp.dtype} elements does not "
                    f"hold {self.size()} outputs of {out.numel()} {out.dtype} elements")
        compress = self._compressible(outputs, opts.reduceOp)
        jobs: list[Job] = []
        for out, inp in zip(outputs, inputs):
            exact = self._reduction(opts, [inp], [out], reduce_scatter_flat_into(self._inner, out),
                                    in_place=False)
            jobs.append(self._compressed.reduce_scatter(out, inp, opts.reduceOp, exact=exact)
                        if compress else exact)
        return self._queue.submit(self._queue.sequence(jobs, outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> LocoWork:
        opts = opts if opts is not None else dist.ReduceOptions()
        _check_tensors("reduce", tensors)
        outputs = tensors if self.rank() == opts.rootRank else []
        return self._queue.submit(
            self._reduction(opts, tensors, outputs, self._inner.reduce, in_place=True))

    # -- c10d methods: exact data movement ----------------------------------------------------
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> LocoWork:
        return self._exact("broadcast", tensors, tensors, opts or dist.BroadcastOptions())

    def allgather(self, output_tensors: list[list[torch.Tensor]],
                  input_tensors: list[torch.Tensor], opts: Any = None) -> LocoWork:
        return self._exact("allgather", output_tensors, output_tensors, input_tensors,
                           opts or AllgatherOptions())

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                          opts: Any = None) -> LocoWork:
        return self._exact("_allgather_base", [output], output, input, opts or AllgatherOptions())

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> LocoWork:
        opts = opts or AllgatherOptions()
        state.STATS.add("exact", calls=1, tensor_bytes=_bytes(inputs))

        def gather(out: torch.Tensor, inp: torch.Tensor) -> Job:
            return lambda: InnerWork(self._inner._allgather_base(out, inp, opts), lambda: [out])

        jobs = [gather(o, i) for o, i in zip(outputs, inputs)]
        return self._queue.submit(self._queue.sequence(jobs, outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            input_list: list[torch.Tensor], opts: Any = None) -> LocoWork:
        return self._exact("allgather_coalesced", output_lists, output_lists, input_list,
                           opts or AllgatherOptions())

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts: Any = None) -> LocoWork:
        return self._exact("gather", output_tensors, output_tensors, input_tensors,
                           opts or dist.GatherOptions())

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts: Any = None) -> LocoWork:
        return self._exact("scatter", output_tensors, output_tensors, input_tensors,
                           opts or dist.ScatterOptions())

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> LocoWork:
        return self._exact("alltoall", output_tensors, output_tensors, input_tensors,
                           opts or dist.AllToAllOptions())

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts: Any = None) -> LocoWork:
        return self._exact("alltoall_base", [output], output, input, output_split_sizes,
                           input_split_sizes, opts or dist.AllToAllOptions())

    alltoall_base = all_to_all_single

    def barrier(self, opts: Any = None) -> LocoWork:
        opts = opts or dist.BarrierOptions()
        return self._queue.submit(lambda: InnerWork(self._inner.barrier(opts), lambda: []))

    # -- point to point: issued in order, never waited on by the worker ----------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> LocoWork:
        return self._exact("send", tensors, tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> LocoWork:
        return self._exact("recv", tensors, tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> LocoWork:
        return self._exact("recv_anysource", tensors, tensors, tag)


def _check_tensors(what: str, tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"lowbitcc: {what} expects tensors, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(
                f"lowbitcc: {what} got a {t.device.type} tensor; this build of the 'loco' backend "
                "serves CPU tensors")
