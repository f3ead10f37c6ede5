"""`LocoProcessGroup`: the torch ``ProcessGroup`` behind ``init_process_group("loco")``.

This module answers c10d and delegates; it checks arguments and decides, per call, which path
runs it:

- exact calls go to the group's inner ``ProcessGroupGloo`` (built on the same store), so they
  equal gloo bit for bit; reductions through `exact.ExactReduction` (AVG and PREMUL_SUM
  emulated);
- compressible calls (`lowbitcc.policy`) go to `compressed_calls.CompressedCalls`, which runs a
  compressed schedule over the group's links: the inner gloo group, or MPI, or further node and
  rail groups (``LOCO_TRANSPORT``, ``LOCO_SCHEDULE``);
- every CPU call, either path, is queued in issue order on the group's `issue_queue.IssueQueue`
  and returns its `LocoWork`.

CUDA tensors (when torch has CUDA and NCCL and a GPU is visible): the group also holds an inner
``ProcessGroupNCCL``; exact calls go there with the caller's options, compressed calls run the
same `CompressedCalls` jobs with the CUDA route (CUDA kernels, NCCL links), and both are issued
in the calling thread by `cuda_issue.CudaIssuer` (streams and Works; docs/gpu.md). Both inner
groups are attached to this group, so ``_get_backend(device)`` answers as for NCCL and gloo.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from lowbitcc import policy, state
from lowbitcc.backend import BACKEND_NAME
from lowbitcc.backend.call_agreement import CollectiveMismatchError
from lowbitcc.backend.compressed_call import Route
from lowbitcc.backend.compressed_calls import CompressedCalls
from lowbitcc.backend.cuda_issue import CudaIssuer
from lowbitcc.backend.exact import (
    ExactReduction,
    all_reduce_of,
    op_type,
    reduce_of,
    reduce_scatter_flat_into,
    reduce_scatter_into,
    start_now,
)
from lowbitcc.backend.issue_queue import InnerWork, IssueQueue, Job, LocoWork
from lowbitcc.codec import kernels
from lowbitcc.config import LocoConfig
from lowbitcc.transports import open_links, open_nccl_links
from lowbitcc.transports.gloo import GlooTransport
from lowbitcc.transports.nccl import SCHEDULES as NCCL_SCHEDULES

log = logging.getLogger("lowbitcc")

__all__ = ["CollectiveMismatchError", "LocoProcessGroup", "LocoWork"]


LEASED_TIMED = 8
"""One in this many exact calls issued at once under a lease is timed for the cost model."""


def _flat(tensors: list[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for t in tensors:
        out.extend(_flat(t) if isinstance(t, list | tuple) else [t])
    return out


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _sync(options: Any, kind: Any) -> Any:
    """A ``kind`` options object with ``options``' reduction and timeout, synchronous (NCCL then
    runs it on the current stream)."""
    out = kind()
    out.reduceOp = options.reduceOp
    out.timeout = options.timeout
    out.asyncOp = False
    return out


def cuda_usable() -> bool:
    """Whether this process can serve CUDA tensors: torch with CUDA and NCCL, and a GPU."""
    return dist.is_nccl_available() and torch.cuda.is_available()


class LocoProcessGroup(dist.ProcessGroup):
    """The "loco" process group. Create it with ``init_process_group("loco")``."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta,
                 config: LocoConfig, global_ranks: list[int] | None = None,
                 group_id: str = "") -> None:
        """``global_ranks[i]`` is the default group's rank of this group's rank ``i`` (None:
        this is the default group); ``group_id`` c10d's name of the group."""
        super().__init__(rank, size)
        self.config = config
        self.timeout = timeout
        self._group_name = ""
        self._group_desc = ""
        self._inner = dist.ProcessGroupGloo(
            dist.PrefixStore("lowbitcc/gloo", store), rank, size, timeout)
        self._gloo = GlooTransport(self._inner)
        # the leased exact reductions, issued by the deciding thread in issue order (`leases`)
        self._direct = dist.ProcessGroupGloo(
            dist.PrefixStore("lowbitcc/gloo-direct", store), rank, size, timeout
        ) if config.cost_model and config.check and config.policy != "never" else self._inner
        self._direct_works = GlooTransport(self._direct)
        self._leased = 0
        cpu = Route(
            kernels=kernels.select(config.codec, "cpu", config.wire_group_size),
            links=open_links(config.transport, world=self._gloo, store=store,
                             global_ranks=global_ranks or list(range(size)), rank=rank,
                             timeout=timeout, node_size=config.node_size, stats=state.STATS),
        )
        routes = {"cpu": cpu}
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO,
                               self._inner)
        self._nccl: Any = None
        self._cuda: CudaIssuer | None = None
        if cuda_usable():
            self._nccl = _inner_nccl(store, rank, size, timeout, global_ranks, group_id)
            self._cuda = CudaIssuer(self._nccl)
            routes["cuda"] = Route(
                kernels=kernels.select(config.codec, "cuda", config.wire_group_size),
                links=open_nccl_links(self._nccl, state.STATS), inline=True,
                schedules=NCCL_SCHEDULES)
            self._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL,
                                   self._nccl)
        self._queue = IssueQueue(f"lowbitcc-r{rank}", self._gloo.retire)
        self._compressed = CompressedCalls(rank, size, config, self._gloo, routes,
                                           on_worker=self._on_worker)

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
        if self._queue.shutdown(self.timeout.total_seconds()):
            self._inner.shutdown()
            if self._direct is not self._inner:
                self._direct.shutdown()
            if self._nccl is not None:
                self._nccl.shutdown()

    abort = shutdown

    # -- the two paths ------------------------------------------------------------------------
    def _compressible(self, tensors: list[torch.Tensor], op: Any) -> bool:
        return (
            self.config.policy != "never"
            and all(policy.eligible(t, op_type(op)) and self._compressed.serves(t.device)
                    for t in tensors)
            and policy.wants_compression(self.config.policy)
        )

    def _on_worker(self, fn: Any) -> None:
        """Run ``fn`` on the worker thread, after the CPU calls queued before, and wait."""
        def job() -> list[torch.Tensor]:
            fn()
            return []

        self._queue.submit(job).wait()

    def _on_cuda(self, what: str, tensors: list[Any]) -> bool:
        """Whether the call's tensors are CUDA tensors (checked: one device type, served)."""
        device_type = _check_tensors(what, _flat(tensors))
        if device_type == "cuda" and self._cuda is None:
            raise ValueError(
                f"lowbitcc: {what} got CUDA tensors, but this process cannot serve them "
                f"(torch {torch.__version__}: CUDA {torch.cuda.is_available()}, NCCL "
                f"{dist.is_nccl_available()}); the 'loco' backend needs a CUDA build of torch "
                "with NCCL and a visible GPU for CUDA tensors")
        return device_type == "cuda"

    def _exact(self, method: str, outputs: list[Any], *args: Any,
               source_rank: Callable[[Any], int] | None = None,
               check: tuple[str, list[torch.Tensor], int] | None = None,
               problem: Callable[[], str | None] | None = None) -> Any:
        """Queue ``inner.<method>(*args)`` (CUDA tensors: issue ``nccl.<method>(*args)`` now);
        the Work's value is ``outputs`` flattened. ``source_rank(inner_work)`` (receives only)
        names the sender once the inner work has completed (see `LocoWork`). ``check``, for
        collectives: ``(kind, tensors, root)``, the call as its descriptor names it (wire
        `COLLECTIVE_CODES`; its size is that of ``tensors``, the same on every rank), which CPU
        calls exchange first (`CompressedCalls.checked`). ``problem()``: what is wrong with
        this rank's arguments as gloo would refuse them (None: nothing); where the call
        exchanges a descriptor, a problem makes this rank refuse the call in the exchange
        (`_refuse`), so that every rank raises; elsewhere gloo raises its own error."""
        state.STATS.add("exact", calls=1, tensor_bytes=_bytes(_flat(list(args[:1]))))
        tensors = [t for t in _flat([a for a in args if isinstance(a, list | tuple | torch.Tensor)])
                   if isinstance(t, torch.Tensor)]
        if self._on_cuda(method, tensors) and self._cuda is not None:
            return self._cuda.exact(method, _flat(outputs), *args)
        if check is not None and problem is not None:
            self._refuse_data_movement(check[0], problem)
        posted: list[Any] = []
        sender = None if source_rank is None else lambda: source_rank(posted[0])
        job = self._inner_job(method, outputs, *args, posted=posted)
        if check is not None:
            job = self._checked(check, job)
        return self._queue.submit(job, sender)

    def _checked(self, check: tuple[str, list[torch.Tensor], int], job: Job, op: int = 0) -> Job:
        """``job`` preceded by the descriptor exchange of ``check`` (see `_exact`) where the
        group checks data movements (`CompressedCalls.checks_data_movement`), else ``job``."""
        if not self._compressed.checks_data_movement():
            return job
        kind, described, root = check
        dtype = described[0].dtype if described else torch.uint8
        return self._compressed.checked(kind, dtype, sum(t.numel() for t in described), job,
                                        op=op, root=root)

    def _inner_job(self, method: str, outputs: list[Any], *args: Any,
                   posted: list[Any] | None = None) -> Job:
        """The worker job that posts ``inner.<method>(*args)`` (appending its Work to
        ``posted``); the call's value is ``outputs`` flattened."""
        def job() -> InnerWork:
            work = getattr(self._inner, method)(*args)
            if posted is not None:
                posted.append(work)
            return InnerWork(work, lambda: _flat(outputs))

        return job

    def _refuse(self, collective: str, error: Exception, *, exchanges: bool,
                numels: list[int] | None = None, like: torch.Tensor | None = None) -> NoReturn:
        """Raise ``error``, this rank's verdict on a call's arguments. Where the valid call
        would exchange a descriptor (``exchanges``), first take part in that exchange flagged
        invalid (`CompressedCalls.refused`, with ``numels`` and ``like`` for a reduction), so
        that every rank raises for this call and the group stays in step."""
        if exchanges:
            job = self._compressed.refused(collective, error, numels or [0], like)
            self._queue.submit(job).wait()  # raises error
        raise error

    def _refuse_data_movement(self, kind: str, problem: Callable[[], str | None]) -> None:
        """Where the group checks data movements (`CompressedCalls.checks_data_movement`),
        `_refuse` a call of ``kind`` in its exchange if ``problem()`` names one; else nothing
        (gloo raises its own error on this rank)."""
        if not self._compressed.checks_data_movement():
            return
        wrong = problem()
        if wrong is not None:
            self._refuse(kind, ValueError(f"lowbitcc: {kind}: {wrong}"), exchanges=True)

    def _refuse_reduction(self, error: Exception, cuda: bool, outputs: list[torch.Tensor],
                          collective: str = "reduce_scatter") -> NoReturn:
        """`_refuse` a reduce-scatter (or all-reduce) of ``outputs``, one call per tensor; CUDA
        calls raise without an exchange (their exchange depends on the policy and the cost
        model's CUDA leases, not checked here)."""
        world = self.size() if collective == "reduce_scatter" else 1
        numels = [o.numel() * world for o in outputs]
        self._refuse(collective, error,
                     exchanges=not cuda and self._compressed.agrees_on(numels),
                     numels=numels, like=outputs[0])

    def _refuse_invalid_op(self, op: Any, cuda: bool, outputs: list[torch.Tensor],
                           collective: str = "reduce_scatter") -> None:
        """`_refuse_reduction` if ``op`` cannot reduce ``outputs`` (`_op_problem`); else
        nothing."""
        wrong = _op_problem(op, outputs)
        if wrong is not None:
            self._refuse_reduction(wrong, cuda, outputs, collective)

    def _reduction(self, opts: Any, inputs: list[torch.Tensor], outputs: list[torch.Tensor],
                   issue: Any, *, in_place: bool, collective: str = "all_reduce"
                   ) -> ExactReduction:
        return ExactReduction(opts, inputs, outputs, issue, in_place=in_place, world=self.size(),
                              group=self._inner, collective=collective)

    def _leased_now(self, exact: ExactReduction, size_class: Any) -> Any:
        """Issue ``exact``, a reduction leased at issue (`Leases`), on the direct group now and
        return its Work (gloo's own where it needs no finishing). One in `LEASED_TIMED` of
        these is timed for the cost model, until gloo has completed it: the timing callback
        takes the GIL on gloo's thread, which costs more than the rest of the call."""
        self._leased += 1
        if self._leased % LEASED_TIMED:
            return start_now(exact.on(self._direct))
        nbytes = sum(t.numel() * t.element_size() for t in exact.inputs)
        stop = self._compressed.clock(self._compressed.route(exact.inputs[0].device),
                                      size_class, True, nbytes)

        def done(work: Any) -> None:
            stop()
            self._direct_works.retire(work)

        return start_now(exact.on(self._direct), done)

    # -- c10d methods: reductions -------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllreduceOptions()
        return self._all_reduce("allreduce", tensors, opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self._all_reduce("allreduce_coalesced", tensors, opts)

    def _all_reduce(self, method: str, tensors: list[torch.Tensor], opts: Any) -> Any:
        cuda = self._on_cuda(method, tensors)
        self._refuse_invalid_op(opts.reduceOp, cuda, tensors, "all_reduce")
        compress = self._compressible(tensors, opts.reduceOp)
        if cuda and self._cuda is not None:
            agree = compress or self._compressed.agrees_on([t.numel() for t in tensors], "cuda")
            ticket = None
            if agree and len(tensors) == 1:
                exact_now, ticket = self._compressed.goes_exact(
                    "all_reduce", tensors[0], tensors[0].numel(), compress)
                agree = not exact_now
            if not agree:
                return self._cuda.exact(method, tensors, tensors, opts)
            single = _sync(opts, dist.AllreduceOptions)
            exacts = [lambda t=t: self._nccl.allreduce([t], single) for t in tensors]
            jobs = [self._compressed.all_reduce(t, opts.reduceOp, exact=e, wants=compress,
                                                ticket=ticket)
                    for t, e in zip(tensors, exacts)]
            return self._cuda.compressed(lambda: [job() for job in jobs],
                                         lambda: [e() for e in exacts],
                                         tensors, tensors, opts.asyncOp)
        if not compress and not self._compressed.agrees_on([t.numel() for t in tensors]):
            return self._queue.submit(self._reduction(opts, tensors, tensors, all_reduce_of,
                                                      in_place=True))
        single = opts
        if not isinstance(opts, dist.AllreduceOptions):
            single = dist.AllreduceOptions()
            single.reduceOp = opts.reduceOp
        exacts = [self._reduction(single, [t], [t], all_reduce_of, in_place=True)
                  for t in tensors]
        ticket = None
        if len(tensors) == 1:
            ticket = self._compressed.ticket("all_reduce", tensors[0], tensors[0].numel(),
                                             compress)
            if ticket is not None and ticket.leased:
                return self._leased_now(exacts[0], ticket.size_class)
        jobs = [self._compressed.all_reduce(t, opts.reduceOp, exact=e, wants=compress,
                                            ticket=ticket, leased=e.on(self._direct))
                for t, e in zip(tensors, exacts)]
        return self._queue.submit(self._queue.sequence(jobs, tensors))

    def reduce_scatter(self, output_tensors: list[torch.Tensor],
                       input_tensors: list[list[torch.Tensor]], opts: Any = None) -> LocoWork:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        if len(output_tensors) != 1 or len(input_tensors) != 1:
            raise ValueError("lowbitcc: reduce_scatter takes one output and one input list")
        output, inputs = output_tensors[0], input_tensors[0]
        cuda = self._on_cuda("reduce_scatter", [output, *inputs])
        if len(inputs) != self.size():
            self._refuse_reduction(ValueError(
                f"lowbitcc: reduce_scatter needs {self.size()} input tensors, got {len(inputs)}"),
                cuda, [output])
        if any(t.shape != output.shape or t.dtype != output.dtype for t in inputs):
            self._refuse_reduction(ValueError(
                "lowbitcc: reduce_scatter inputs must all match the output's shape and dtype"),
                cuda, [output])
        self._refuse_invalid_op(opts.reduceOp, cuda, [output])
        if cuda and self._cuda is not None:
            compress = self._compressible([output], opts.reduceOp)
            agree = compress or self._compressed.agrees_on([output.numel() * self.size()],
                                                           "cuda")
            ticket = None
            if agree:
                exact_now, ticket = self._compressed.goes_exact(
                    "reduce_scatter", output, output.numel() * self.size(), compress)
                agree = not exact_now
            if not agree:
                return self._cuda.exact("reduce_scatter", [output], output_tensors, input_tensors,
                                        opts)
            source = torch.stack([t.reshape(-1) for t in inputs])
            single = _sync(opts, dist.ReduceScatterOptions)

            def exact_rs() -> None:
                self._nccl.reduce_scatter([output], [inputs], single)

            job = self._compressed.reduce_scatter(output, source, opts.reduceOp, exact=exact_rs,
                                                  wants=compress, ticket=ticket)
            return self._cuda.compressed(job, exact_rs, [output, source, *inputs], [output],
                                         opts.asyncOp)
        exact = self._reduction(opts, inputs, [output], reduce_scatter_into(output),
                                in_place=False, collective="reduce_scatter")
        compress = self._compressible([output], opts.reduceOp)
        if not compress and not self._compressed.agrees_on([output.numel() * self.size()]):
            return self._queue.submit(exact)
        ticket = self._compressed.ticket("reduce_scatter", output, output.numel() * self.size(),
                                         compress)
        if ticket is not None and ticket.leased:
            return self._leased_now(exact, ticket.size_class)
        source = torch.stack([t.reshape(-1) for t in inputs])
        job = self._compressed.reduce_scatter(output, source, opts.reduceOp, exact=exact,
                                              wants=compress, ticket=ticket,
                                              leased=exact.on(self._direct))
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
        cuda = self._on_cuda("reduce_scatter", [*outputs, *inputs])
        for out, inp in zip(outputs, inputs):
            if inp.numel() != out.numel() * self.size() or inp.dtype != out.dtype:
                self._refuse_reduction(ValueError(
                    f"lowbitcc: reduce_scatter input of {inp.numel()} {inp.dtype} elements does not "
                    f"hold {self.size()} outputs of {out.numel()} {out.dtype} elements"),
                    cuda, outputs)
        self._refuse_invalid_op(opts.reduceOp, cuda, outputs)
        compress = self._compressible(outputs, opts.reduceOp)
        if cuda and self._cuda is not None:
            agree = compress or self._compressed.agrees_on([i.numel() for i in inputs], "cuda")
            ticket = None
            if agree and len(inputs) == 1:
                exact_now, ticket = self._compressed.goes_exact(
                    "reduce_scatter", inputs[0], inputs[0].numel(), compress)
                agree = not exact_now
            if not agree:
                if len(outputs) == 1:
                    return self._cuda.exact("_reduce_scatter_base", outputs, outputs[0],
                                            inputs[0], opts)
                return self._cuda.exact("reduce_scatter_tensor_coalesced", outputs, outputs,
                                        inputs, opts)
            single = _sync(opts, dist.ReduceScatterOptions)
            exacts = [lambda o=o, i=i: self._nccl._reduce_scatter_base(o, i, single)
                      for o, i in zip(outputs, inputs)]
            jobs = [self._compressed.reduce_scatter(o, i, opts.reduceOp, exact=e, wants=compress,
                                                    ticket=ticket)
                    for o, i, e in zip(outputs, inputs, exacts)]
            return self._cuda.compressed(lambda: [job() for job in jobs],
                                         lambda: [e() for e in exacts],
                                         [*outputs, *inputs], outputs, opts.asyncOp)
        jobs: list[Job] = []
        for out, inp in zip(outputs, inputs):
            exact = self._reduction(opts, [inp], [out], reduce_scatter_flat_into(out),
                                    in_place=False, collective="reduce_scatter")
            agree = compress or self._compressed.agrees_on([inp.numel()])
            ticket = None
            if agree and len(inputs) == 1:
                ticket = self._compressed.ticket("reduce_scatter", inp, inp.numel(), compress)
                if ticket is not None and ticket.leased:
                    return self._leased_now(exact, ticket.size_class)
            jobs.append(self._compressed.reduce_scatter(
                out, inp, opts.reduceOp, exact=exact, wants=compress, ticket=ticket,
                leased=exact.on(self._direct)) if agree else exact)
        return self._queue.submit(self._queue.sequence(jobs, outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> LocoWork:
        opts = opts if opts is not None else dist.ReduceOptions()
        if self._on_cuda("reduce", tensors) and self._cuda is not None:
            return self._cuda.exact("reduce", tensors, tensors, opts)
        self._refuse_data_movement("reduce", lambda: self._root_problem(opts.rootRank))
        op_wrong = _op_problem(opts.reduceOp, tensors)
        if op_wrong is not None:
            self._refuse("reduce", op_wrong, exchanges=self._compressed.checks_data_movement())
        outputs = tensors if self.rank() == opts.rootRank else []
        job: Job = self._reduction(opts, tensors, outputs, reduce_of, in_place=True,
                                   collective="reduce")
        job = self._checked(("reduce", tensors, opts.rootRank), job,
                            op=int(op_type(opts.reduceOp)))
        return self._queue.submit(job)

    # -- c10d methods: exact data movement ----------------------------------------------------
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> LocoWork:
        opts = opts or dist.BroadcastOptions()
        return self._exact("broadcast", tensors, tensors, opts,
                           check=("broadcast", tensors, opts.rootRank),
                           problem=lambda: self._root_problem(opts.rootRank))

    def _root_problem(self, root: int) -> str | None:
        return None if 0 <= root < self.size() else (
            f"root rank {root} is not a rank of this group of {self.size()}")

    def allgather(self, output_tensors: list[list[torch.Tensor]],
                  input_tensors: list[torch.Tensor], opts: Any = None) -> LocoWork:
        return self._exact("allgather", output_tensors, output_tensors, input_tensors,
                           opts or AllgatherOptions(), check=("all_gather", input_tensors, 0),
                           problem=lambda: _list_problem("output", output_tensors,
                                                         input_tensors, self.size()))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                          opts: Any = None) -> LocoWork:
        opts = opts or AllgatherOptions()
        if self.config.param_bits and self._gathers_compressibly(output, input):
            wants = self.config.policy != "never" and policy.mode("always") != "never"
            if wants or self.config.check:
                gather = self._inner_job("_allgather_base", [output], output, input, opts)

                def exact() -> InnerWork:
                    state.STATS.add("exact", calls=1, tensor_bytes=_bytes([input]))
                    return gather()

                job = self._compressed.all_gather(output, input, exact, wants=wants)
                return self._queue.submit(self._queue.sequence([job], [output]))
        return self._exact("_allgather_base", [output], output, input, opts,
                           check=("all_gather", [input], 0),
                           problem=lambda: _holds_problem(output, input, self.size()))

    def _gathers_compressibly(self, output: torch.Tensor, source: torch.Tensor) -> bool:
        """An all-gather that ``param_bits`` applies to: CPU float tensors, at least
        ``min_size`` elements per rank, an output of ``size`` inputs of the same dtype."""
        _check_tensors("all_gather", [output, source])
        return (source.device.type == "cpu" and policy.eligible(source, dist.ReduceOp.SUM)
                and output.dtype == source.dtype
                and source.numel() >= self.config.min_size
                and output.numel() == source.numel() * self.size())

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> LocoWork:
        opts = opts or AllgatherOptions()
        if self._on_cuda("all_gather", [*outputs, *inputs]) and self._cuda is not None:
            return self._exact("allgather_into_tensor_coalesced", outputs, outputs, inputs, opts)
        state.STATS.add("exact", calls=1, tensor_bytes=_bytes(inputs))

        jobs = [self._inner_job("_allgather_base", [o], o, i, opts)
                for o, i in zip(outputs, inputs)]
        return self._queue.submit(
            self._checked(("all_gather", inputs, 0), self._queue.sequence(jobs, outputs)))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            input_list: list[torch.Tensor], opts: Any = None) -> LocoWork:
        return self._exact("allgather_coalesced", output_lists, output_lists, input_list,
                           opts or AllgatherOptions(), check=("all_gather", input_list, 0))

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts: Any = None) -> LocoWork:
        opts = opts or dist.GatherOptions()
        return self._exact("gather", output_tensors, output_tensors, input_tensors, opts,
                           check=("gather", input_tensors, opts.rootRank),
                           problem=lambda: self._root_problem(opts.rootRank) or (
                               _list_problem("output", output_tensors, input_tensors,
                                             self.size())
                               if self.rank() == opts.rootRank else None))

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts: Any = None) -> LocoWork:
        opts = opts or dist.ScatterOptions()
        return self._exact("scatter", output_tensors, output_tensors, input_tensors, opts,
                           check=("scatter", output_tensors, opts.rootRank),
                           problem=lambda: self._root_problem(opts.rootRank) or (
                               _list_problem("input", input_tensors, output_tensors,
                                             self.size())
                               if self.rank() == opts.rootRank else None))

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> LocoWork:
        # sizes may differ between ranks (uneven splits): the descriptor names none
        return self._exact("alltoall", output_tensors, output_tensors, input_tensors,
                           opts or dist.AllToAllOptions(), check=("all_to_all", [], 0))

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts: Any = None) -> LocoWork:
        return self._exact("alltoall_base", [output], output, input, output_split_sizes,
                           input_split_sizes, opts or dist.AllToAllOptions(),
                           check=("all_to_all", [], 0))

    alltoall_base = all_to_all_single

    def barrier(self, opts: Any = None) -> LocoWork:
        opts = opts or dist.BarrierOptions()
        if self._compressed.checks_data_movement():  # the exchange is a barrier itself
            return self._queue.submit(self._checked(("barrier", [], 0), lambda: []))
        return self._queue.submit(lambda: InnerWork(self._inner.barrier(opts), lambda: []))

    def monitored_barrier(self, timeout: datetime.timedelta | float | None = None,
                          wait_all_ranks: bool = False) -> None:
        """gloo's debugging barrier, run on the inner gloo group after every call issued before
        it: rank 0 raises naming the first rank (``wait_all_ranks``: every rank) that did not
        arrive within ``timeout`` (seconds or a timedelta; default the group's), the others
        raise that rank 0 failed. Blocks the calling thread; the group's later calls wait."""
        if timeout is None:
            timeout = self.timeout
        elif not isinstance(timeout, datetime.timedelta):
            timeout = datetime.timedelta(seconds=float(timeout))

        def job() -> list[torch.Tensor]:
            self._inner.monitored_barrier(timeout, wait_all_ranks)
            return []

        self._queue.submit(job).wait()

    # -- point to point: issued in order, never waited on by the worker ----------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> LocoWork:
        return self._exact("send", tensors, tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> LocoWork:
        return self._exact("recv", tensors, tensors, src, tag, source_rank=lambda _: src)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> LocoWork:
        """Receive from whichever rank sends first; the Work's ``_source_rank()`` names it."""
        if self._on_cuda("recv_anysource", tensors):
            raise ValueError("lowbitcc: recv without a source rank needs CPU tensors "
                             "(NCCL has no receive from any source)")
        return self._exact("recv_anysource", tensors, tensors, tag,
                           source_rank=lambda inner: inner._source_rank())


def _op_problem(op: Any, tensors: list[torch.Tensor]) -> TypeError | None:
    """The error of a reduction by ``op`` of ``tensors`` that NCCL refuses and gloo lacks:
    PREMUL_SUM on tensors that are not floating point (None: none)."""
    if op_type(op) != dist.ReduceOp.PREMUL_SUM:
        return None
    for t in tensors:
        if not t.dtype.is_floating_point:
            return TypeError(f"lowbitcc: PREMUL_SUM needs floating-point tensors (as on NCCL), "
                             f"got {t.dtype}")
    return None


def _holds_problem(output: torch.Tensor, source: torch.Tensor, size: int) -> str | None:
    """What is wrong with ``output`` as the all-gather of ``size`` tensors like ``source``, as
    gloo would refuse it; None: nothing."""
    if output.numel() == source.numel() * size and output.dtype == source.dtype:
        return None
    return (f"an output of {output.numel()} {output.dtype} elements does not hold {size} inputs "
            f"of {source.numel()} {source.dtype}")


def _list_problem(name: str, lists: list[list[torch.Tensor]], like: list[torch.Tensor],
                  size: int) -> str | None:
    """What is wrong with ``lists`` (one list of ``size`` tensors per tensor of ``like``, each
    of its shape and dtype), as gloo would refuse it; None: nothing."""
    if len(lists) != len(like):
        return f"{len(lists)} {name} lists for {len(like)} tensors"
    for entries, t in zip(lists, like):
        if len(entries) != size:
            return f"an {name} list of {len(entries)} tensors in a group of {size}"
        for i, e in enumerate(entries):
            if e.shape != t.shape or e.dtype != t.dtype:
                return (f"{name} tensor {i} is {e.dtype} {tuple(e.shape)}, expected "
                        f"{t.dtype} {tuple(t.shape)}")
    return None


def _check_tensors(what: str, tensors: list[Any]) -> str:
    """The one device type of ``tensors`` ("cpu" for none); raises on anything else."""
    types = set()
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"lowbitcc: {what} expects tensors, got {type(t).__name__}")
        types.add(t.device.type)
    if len(types) > 1:
        raise ValueError(f"lowbitcc: {what} got tensors on several device types "
                         f"({', '.join(sorted(types))}); one call takes one")
    device_type = types.pop() if types else "cpu"
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"lowbitcc: {what} got a {device_type} tensor; the 'loco' backend serves "
                         "CPU and CUDA tensors")
    return device_type


def _inner_nccl(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta,
                global_ranks: list[int] | None, group_id: str) -> Any:
    """The group's inner ``ProcessGroupNCCL`` on its own store prefix, named and numbered as
    c10d names and numbers the NCCL groups it creates itself."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    options.is_high_priority_stream = False
    options.global_ranks_in_group = global_ranks or list(range(size))
    options.group_name = f"{group_id}/lowbitcc" if group_id else "lowbitcc"
    nccl = dist.ProcessGroupNCCL(dist.PrefixStore("lowbitcc/nccl", store), rank, size, options)
    nccl._set_sequence_number_for_group()
    return nccl
