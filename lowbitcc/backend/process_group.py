"""`LocoProcessGroup`: the torch ``ProcessGroup`` behind ``init_process_group("loco")``.

This module answers c10d. Each reduction (all-reduce, reduce-scatter, their coalesced forms) is
written once. A reduction of one tensor first takes its place in its device's call schedule
(`reductions.Reductions.take`); where the place's entry is the call (the steady state) it runs
as that entry and that is the whole call (`Reductions.run`). Otherwise the reduction checks the
call, builds its exact form (`exact.ExactReduction`: as gloo runs it, AVG and PREMUL_SUM
emulated, and as c10d asked for it) and hands it, with the place it took, to
`Reductions.reduce`, which issues its jobs through the `issuer.Issuer` of the tensors' device,
chosen once when the group is created:

- CPU tensors: `worker_issue.WorkerIssuer` (the group's worker thread, `issue_queue`, in
  issue order; calls that run as their place's exact entry start at once on a direct gloo
  group), or under
  ``LOCO_ISSUER=inline`` `inline_issue.InlineIssuer` (the calling thread);
- CUDA tensors (torch with CUDA and NCCL, a visible GPU): `cuda_issue.CudaIssuer` (the calling
  thread, the caller's stream, the inner ``ProcessGroupNCCL``; docs/gpu.md).

Data movements and the exact reduce are `data_movement.DataMovements`'; the c10d methods of the
data movements and point to point are `movement_methods.DataMovementMethods`', which the group
inherits. The inner gloo and NCCL groups are attached, so ``_get_backend(device)`` answers as for
NCCL and gloo."""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch
import torch.distributed as dist

from lowbitcc.backend import BACKEND_NAME, gloo_threads, steady_runner
from lowbitcc.backend.arguments import op_problem, scatter_flat_problem, scatter_list_problem
from lowbitcc.backend.call_agreement import CollectiveMismatchError
from lowbitcc.backend.call_schedule import Entry
from lowbitcc.backend.compressed_calls import CompressedCalls
from lowbitcc.backend.cuda_issue import CudaIssuer, cuda_usable
from lowbitcc.backend.data_movement import DataMovements
from lowbitcc.backend.eager import eager_methods
from lowbitcc.backend.exact import (
    ExactReduction,
    all_reduce_of,
    op_type,
    reduce_of,
    reduce_scatter_flat_into,
    reduce_scatter_into,
)
from lowbitcc.backend.inline_issue import InlineIssuer
from lowbitcc.backend.issue_queue import IssueQueue
from lowbitcc.backend.issuer import Issuer
from lowbitcc.backend.movement_methods import DataMovementMethods
from lowbitcc.backend.reductions import Reductions
from lowbitcc.backend.routes import cpu_route, cuda_route, end_device_work, inner_nccl
from lowbitcc.backend.watchdog import Watchdog
from lowbitcc.backend.worker_issue import WorkerIssuer
from lowbitcc.backend.works import LocoWork
from lowbitcc.config import LocoConfig
from lowbitcc.transports.gloo import GlooTransport

log = logging.getLogger("lowbitcc")

__all__ = ["CollectiveMismatchError", "LocoProcessGroup", "LocoWork"]


@eager_methods
class LocoProcessGroup(DataMovementMethods, dist.ProcessGroup):
    """The "loco" process group. Create it with ``init_process_group("loco")``."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta,
                 config: LocoConfig, global_ranks: list[int] | None = None,
                 group_id: str = "") -> None:
        """``global_ranks[i]`` is the default group's rank of this group's rank ``i`` (None:
        this is the default group); ``group_id`` c10d's name of the group."""
        super().__init__(rank, size)
        self._world = size
        self.config = config
        self.timeout = timeout
        self._group_name = self._group_desc = ""
        self._inner = dist.ProcessGroupGloo(
            dist.PrefixStore("lowbitcc/gloo", store), rank, size, timeout)
        self._gloo = GlooTransport(self._inner)
        inline = config.issuer == "inline"
        # exact reductions issued by the calling thread (a place's exact entry; and, inline,
        # every CPU reduction), in issue order, apart from the worker's inner group
        exchanges = config.check and config.policy != "never" and size > 1
        self._direct = dist.ProcessGroupGloo(
            dist.PrefixStore("lowbitcc/gloo-direct", store), rank, size, timeout
        ) if inline or exchanges else self._inner
        world = GlooTransport(self._direct) if inline else self._gloo
        routes = {"cpu": cpu_route(config, world, store, global_ranks or list(range(size)),
                                   rank, timeout)}
        self._cpu_links = routes["cpu"].links  # its node and rail groups, shut down with it
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO,
                               self._inner)
        self._nccl: Any = None
        self._cuda: CudaIssuer | None = None
        self._cuda_links: Any = None  # the CUDA route's links: their node and rail groups
        if cuda_usable():
            self._nccl = inner_nccl(store, rank, size, timeout, global_ranks, group_id)
            self._cuda = CudaIssuer(self._nccl, Watchdog(timeout.total_seconds(),
                                                         self._abort_nccl))
            routes["cuda"] = cuda_route(config, self._nccl, store,
                                        global_ranks or list(range(size)), rank, timeout)
            self._cuda_links = routes["cuda"].links
            self._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL,
                                   self._nccl)
        self._queue = IssueQueue(f"lowbitcc-r{rank}", self._gloo.retire, timeout.total_seconds())
        self._compressed = CompressedCalls(rank, size, config, self._gloo, routes,
                                           submit=self._queue.submit,
                                           timeout_s=timeout.total_seconds())
        self._issuers: dict[str, Issuer] = {"cpu": InlineIssuer(self._direct, self._queue) if inline else (
            WorkerIssuer(self._queue, self._direct, self._compressed.clock))}
        if self._cuda is not None:
            self._issuers["cuda"] = self._cuda
        self._moves = DataMovements(rank, size, self._inner, self._queue, self._compressed,
                                    self._cuda, timeout)
        self._reductions = Reductions(size, self._compressed, self._issuers, self._queue)
        self._native = self._reductions.native
        # CPU calls that run as their place's entry, served whole in C++ (`steady_runner`)
        self._runner = steady_runner.runner(self._direct, self._inner, self._compressed,
                                            self._issuers["cpu"], self._queue, size)
        # CUDA calls that run as their place's entry: an exact one served in C++ too, a
        # compressed one's place taken there (`steady_runner.device_runner`)
        self._device_runner = steady_runner.device_runner(
            self._nccl, self._compressed, self._cuda, self._reductions, "cuda", size
        ) if self._cuda is not None else steady_runner.NoRunner()
        steady_runner.install(self, LocoProcessGroup)  # its reduction methods, in C++

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
        self._queue.name_group(name)
        if self._cuda is not None:
            self._cuda.watchdog.group = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    @property
    def cost_model(self) -> Any:
        """The group's `lowbitcc.cost_model.CostModel` (its ``table()`` shows what it learned)."""
        return self._compressed.cost_model

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._group_name

    @property
    def group_desc(self) -> str:  # type: ignore[override]
        return self._group_desc

    def shutdown(self) -> None:
        gloo_threads.let_go()  # what callbacks of its calls and others' parked, here
        if self._queue.shutdown(self.timeout.total_seconds()):
            self._inner.shutdown()
            if self._direct is not self._inner:
                self._direct.shutdown()
            self._cpu_links.close()
            if self._cuda is not None:  # and so its inner NCCL groups, graphs first
                alive = self._cuda.watchdog.dead is None
                end_device_work(self._compressed.graphs, self._cuda_links, self._nccl,
                                self.timeout.total_seconds() if alive else 0, abort=False)

    abort = shutdown

    def _abort_nccl(self) -> None:
        """The watchdog's end of the group's device work (`end_device_work`, aborting)."""
        end_device_work(self._compressed.graphs, self._cuda_links, self._nccl, 0.0, abort=True)

    # -- what the reductions share ------------------------------------------------------------
    def _issuer(self, what: str, tensors: list[Any]) -> Issuer:
        """The issuer of the call's tensors (checked: one device type, served)."""
        return self._issuers["cuda" if self._moves.on_cuda(what, tensors) else "cpu"]

    def _exact(self, opts: Any, inputs: list[torch.Tensor], outputs: list[torch.Tensor],
               issue: Any, native: tuple[str, tuple], *, in_place: bool,
               collective: str) -> ExactReduction:
        return ExactReduction(opts, inputs, outputs, issue, in_place=in_place, world=self._world,
                              group=self._inner, collective=collective, native=native)

    # -- c10d methods: reductions -------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        # (a steady call is served before this, in C++: `steady_runner.install`)
        return self._all_reduce("allreduce", tensors,
                                opts if opts is not None else dist.AllreduceOptions())

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self._all_reduce("allreduce_coalesced", tensors, opts)

    def _all_reduce(self, method: str, tensors: list[torch.Tensor], opts: Any) -> Any:
        taken = None
        if len(tensors) == 1 and type(opts) is dist.AllreduceOptions:
            t = tensors[0]
            taken = self._reductions.take("all_reduce", t, t.numel(), opts.reduceOp)
            # as its entry, unbuilt: compressed, or exact by an op the inner backend runs
            if type(taken) is Entry and (not taken.exact or taken.desc.op in self._native[
                    "cpu" if t.is_cpu else t.device.type]):
                return self._reductions.run(taken, "all_reduce", t, t, t.numel(),
                                            opts.reduceOp, (method, (tensors, opts)))
        issuer = self._issuer(method, tensors)
        self._reductions.refuse_invalid_op(opts.reduceOp, issuer, tensors, "all_reduce", taken)
        single = opts
        if not isinstance(opts, dist.AllreduceOptions):
            single = dist.AllreduceOptions()
            single.reduceOp, single.timeout = opts.reduceOp, opts.timeout
        whole = self._exact(opts, tensors, tensors, all_reduce_of, (method, (tensors, opts)),
                            in_place=True, collective="all_reduce")
        parts = [whole] if len(tensors) == 1 and single is opts else [
            self._exact(single, [t], [t], all_reduce_of, ("allreduce", ([t], single)),
                        in_place=True, collective="all_reduce") for t in tensors]
        return self._reductions.reduce(issuer, "all_reduce", whole, parts,
                                       lambda: (tensors, tensors), opts, taken)

    def reduce_scatter(self, output_tensors: list[torch.Tensor],
                       input_tensors: list[list[torch.Tensor]], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        if len(output_tensors) != 1 or len(input_tensors) != 1:
            raise ValueError("lowbitcc: reduce_scatter takes one output and one input list")
        output, inputs = output_tensors[0], input_tensors[0]
        issuer = self._issuer("reduce_scatter", [output, *inputs])
        wrong = scatter_list_problem(output, inputs, self._world)
        if wrong is not None:
            self._reductions.refuse(ValueError(wrong), issuer, [output])
        self._reductions.refuse_invalid_op(opts.reduceOp, issuer, [output])
        whole = self._exact(opts, inputs, [output], reduce_scatter_into(output),
                            ("reduce_scatter", (output_tensors, input_tensors, opts)),
                            in_place=False, collective="reduce_scatter")
        return self._reductions.reduce(
            issuer, "reduce_scatter", whole, [whole],
            lambda: ([output], [torch.stack([t.reshape(-1) for t in inputs])]), opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                              opts: Any = None) -> Any:
        # the class's, not the group's C++ one: the runner is asked once (`steady_runner`)
        return type(self).reduce_scatter_single_coalesced(
            self, [output], [input], opts if opts is not None else dist.ReduceScatterOptions())

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        if len(outputs) != len(inputs):
            raise ValueError("lowbitcc: reduce_scatter needs as many outputs as inputs")
        taken = None
        if (len(outputs) == 1 and outputs[0].numel() * self._world == inputs[0].numel()
                and outputs[0].dtype == inputs[0].dtype):
            i, o = inputs[0], outputs[0]
            taken = self._reductions.take("reduce_scatter", i, i.numel(), opts.reduceOp)
            if type(taken) is Entry and (not taken.exact or taken.desc.op in self._native[
                    "cpu" if i.is_cpu else i.device.type]):  # (as in `_all_reduce`)
                return self._reductions.run(taken, "reduce_scatter", i, o, i.numel(),
                                            opts.reduceOp, ("_reduce_scatter_base", (o, i, opts)))
        issuer = self._issuer("reduce_scatter", [*outputs, *inputs])
        wrong = scatter_flat_problem(outputs, inputs, self._world)
        if wrong is not None:
            self._reductions.refuse(ValueError(wrong), issuer, outputs, first=taken)
        self._reductions.refuse_invalid_op(opts.reduceOp, issuer, outputs, first=taken)
        parts = [self._exact(opts, [i], [o], reduce_scatter_flat_into(o),
                             ("_reduce_scatter_base", (o, i, opts)), in_place=False,
                             collective="reduce_scatter") for o, i in zip(outputs, inputs)]
        whole = parts[0] if len(parts) == 1 else self._exact(
            opts, inputs, outputs, None,
            ("reduce_scatter_tensor_coalesced", (outputs, inputs, opts)), in_place=False,
            collective="reduce_scatter")
        return self._reductions.reduce(issuer, "reduce_scatter", whole, parts,
                                       lambda: (outputs, inputs), opts, taken)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.ReduceOptions()
        outputs = tensors if self.rank() == opts.rootRank else []
        call = self._exact(opts, tensors, outputs, reduce_of, ("reduce", (tensors, opts)),
                           in_place=True, collective="reduce")
        return self._moves.reduce(tensors, opts, call, op_problem(opts.reduceOp, tensors),
                                  int(op_type(opts.reduceOp)))
