"""`DataMovements`: the exact calls of a "loco" group that move data (and its exact `reduce`).

Broadcast, the all-gathers, gather, scatter, all-to-all, barrier, reduce and point to point go
to the group's inner gloo group as they are (CUDA tensors: to its inner NCCL group, issued at
once by `cuda_issue.CudaIssuer`), so they are gloo's (NCCL's) results bit for bit. CPU calls are
queued in issue order on the group's worker (`issue_queue`); under ``check_all`` they exchange a
call descriptor first (`CompressedCalls.checked`), and a call whose arguments this rank refuses
takes part in that exchange flagged invalid (`refuse`), so that every rank raises. The one
compressed data movement, the ``param_bits`` all-gather, is here too (`GatherCall`: after the
descriptor exchange, every rank wanting it compressed, `schedules.gather`: one encode of this
rank's flat input, one all-gather of codes, one decode of every rank's codes into the output; no
error feedback: parameters are not accumulated). The process group's c10d methods delegate here;
but an all-gather, broadcast, all-to-all or point-to-point call of one tensor that the group's
runner serves (`steady_runner`, ``backend/csrc/runner_moves.h``: the same count and the inner
group's own call, from the calling thread where the worker would issue it at once) does not
come here.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from lowbitcc import policy, schedules, state
from lowbitcc.backend.arguments import (
    check_tensors,
    flat,
    holds_problem,
    list_problem,
    nbytes,
)
from lowbitcc.backend.call_agreement import CorruptFrameError
from lowbitcc.backend.compressed_call import CallGroup
from lowbitcc.backend.compressed_calls import CompressedCalls
from lowbitcc.backend.cuda_issue import CudaIssuer
from lowbitcc.backend.exact import ExactReduction
from lowbitcc.backend.issue_queue import IssueQueue, Job
from lowbitcc.backend.works import InnerWork, LocoWork, callback_parent
from lowbitcc.codec import wire
from lowbitcc.codec.shard_codec import ShardCodec
from lowbitcc.collectives import COLLECTIVES
from lowbitcc.compressor import CallCompressor, Source

Check = tuple[str, list[torch.Tensor], int]
"""A data movement as its descriptor names it: ``(collective, tensors, root)`` (wire
`COLLECTIVE_CODES`; its size is that of ``tensors``, the same on every rank)."""


class DataMovements:
    """The data movements of one group of ``size`` ranks (see the module docstring): ``inner``
    its inner gloo group, ``queue`` its worker, ``compressed`` its compressed calls, ``cuda``
    its CUDA issuer (None: no CUDA)."""

    def __init__(self, rank: int, size: int, inner: dist.ProcessGroup, queue: IssueQueue,
                 compressed: CompressedCalls, cuda: CudaIssuer | None,
                 timeout: datetime.timedelta) -> None:
        self.rank, self.size = rank, size
        self._inner, self._queue, self._compressed, self._cuda = inner, queue, compressed, cuda
        self._timeout = timeout

    # -- refusals ---------------------------------------------------------------------------
    def refuse(self, collective: str, error: Exception, *, exchanges: bool,
               numels: list[int] | None = None, like: torch.Tensor | None = None) -> NoReturn:
        """Raise ``error``, this rank's verdict on a call's arguments. Where the valid call
        would exchange a descriptor (``exchanges``), first take part in that exchange flagged
        invalid (`CompressedCalls.refused`, with ``numels`` and ``like`` for a reduction), so
        that every rank raises for this call and the group stays in step."""
        if exchanges:
            job = self._compressed.refused(collective, error, numels or [0], like)
            self._queue.submit(job).wait()  # raises error
        raise error

    def _refuse_if(self, kind: str, problem: Callable[[], str | None]) -> None:
        """Where the group checks data movements (`CompressedCalls.checks_data_movement`),
        `refuse` a call of ``kind`` in its exchange if ``problem()`` names one; else nothing
        (gloo raises its own error on this rank)."""
        if not self._compressed.checks_data_movement():
            return
        wrong = problem()
        if wrong is not None:
            self.refuse(kind, ValueError(f"lowbitcc: {kind}: {wrong}"), exchanges=True)

    def root_problem(self, root: int) -> str | None:
        return None if 0 <= root < self.size else (
            f"root rank {root} is not a rank of this group of {self.size}")

    # -- the one path -------------------------------------------------------------------------
    def exact(self, method: str, outputs: list[Any], *args: Any,
              source_rank: Callable[[Any], int] | None = None, check: Check | None = None,
              problem: Callable[[], str | None] | None = None) -> Any:
        """Queue ``inner.<method>(*args)`` (CUDA tensors: issue ``nccl.<method>(*args)`` now);
        the Work's value is ``outputs`` flattened. ``source_rank(inner_work)`` (receives only)
        names the sender once the inner work has completed (see `LocoWork`). ``check``: the
        call's descriptor, which CPU calls exchange first where the group checks data
        movements (`checked`). ``problem()``: what is wrong with this rank's arguments as gloo
        would refuse them (None: nothing); where the call exchanges a descriptor, a problem
        makes this rank refuse the call in the exchange, so that every rank raises; elsewhere
        gloo raises its own error."""
        state.STATS.add("exact", calls=1, tensor_bytes=nbytes(flat(list(args[:1]))))
        tensors = [t for t in flat([a for a in args if isinstance(a, list | tuple | torch.Tensor)])
                   if isinstance(t, torch.Tensor)]
        if self.on_cuda(method, tensors):
            return self._cuda.native(method, flat(outputs), *args)
        if check is not None and problem is not None:
            self._refuse_if(check[0], problem)
        posted: list[Any] = []
        sender = None if source_rank is None else lambda: source_rank(posted[0])
        job = self.inner_job(method, outputs, *args, posted=posted)
        if check is not None:
            job = self.checked(check, job)
        return self._queue.submit(job, sender)

    def on_cuda(self, what: str, tensors: list[Any]) -> bool:
        """Whether the call's tensors are CUDA tensors (checked: one device type, served)."""
        device_type = check_tensors(what, flat(tensors))
        if device_type == "cuda" and self._cuda is None:
            raise ValueError(
                f"lowbitcc: {what} got CUDA tensors, but this process cannot serve them "
                f"(torch {torch.__version__}: CUDA {torch.cuda.is_available()}, NCCL "
                f"{dist.is_nccl_available()}); the 'loco' backend needs a CUDA build of torch "
                "with NCCL and a visible GPU for CUDA tensors")
        return device_type == "cuda"

    def checked(self, check: Check, job: Job, op: int = 0) -> Job:
        """``job`` preceded by the descriptor exchange of ``check`` where the group checks
        data movements (`CompressedCalls.checks_data_movement`), else ``job``."""
        if not self._compressed.checks_data_movement():
            return job
        kind, described, root = check
        dtype = described[0].dtype if described else torch.uint8
        return self._compressed.checked(kind, dtype, sum(t.numel() for t in described), job,
                                        op=op, root=root)

    def inner_job(self, method: str, outputs: list[Any], *args: Any,
                  posted: list[Any] | None = None) -> Job:
        """The worker job that posts ``inner.<method>(*args)`` (appending its Work to
        ``posted``); the call's value is ``outputs`` flattened."""
        def job() -> InnerWork:
            work = getattr(self._inner, method)(*args)
            if posted is not None:
                posted.append(work)
            return InnerWork(work, lambda: flat(outputs))

        return job

    # -- the calls ----------------------------------------------------------------------------
    def reduce(self, tensors: list[torch.Tensor], opts: Any, call: ExactReduction,
               op_wrong: Exception | None, op_code: int) -> Any:
        """The exact reduce ``call`` (``op_wrong``: this rank's refusal of its op)."""
        if self.on_cuda("reduce", tensors):
            return self._cuda.native("reduce", tensors, tensors, opts)
        self._refuse_if("reduce", lambda: self.root_problem(opts.rootRank))
        if op_wrong is not None:
            self.refuse("reduce", op_wrong, exchanges=self._compressed.checks_data_movement())
        return self._queue.submit(self.checked(("reduce", tensors, opts.rootRank), call, op_code))

    def all_gather_single(self, output: torch.Tensor, source: torch.Tensor, opts: Any,
                          param_bits: int) -> Any:
        opts = opts or AllgatherOptions()
        config = self._compressed.config
        if param_bits and self._gathers_compressibly(output, source):
            wants = config.policy != "never" and policy.mode("always") != "never"
            if wants or config.check:
                job = self._compressed.unplaced(GatherCall(
                    self._compressed, output, source, _CountedExact(self.inner_job(
                        "_allgather_base", [output], output, source, opts), source), wants))
                return self._queue.submit(self._queue.sequence([job], [output]))
        return self.exact("_allgather_base", [output], output, source, opts,
                          check=("all_gather", [source], 0),
                          problem=lambda: holds_problem(output, source, self.size))

    def _gathers_compressibly(self, output: torch.Tensor, source: torch.Tensor) -> bool:
        """An all-gather that ``param_bits`` applies to: CPU float tensors, at least
        ``min_size`` elements per rank, an output of ``size`` inputs of the same dtype."""
        check_tensors("all_gather", [output, source])
        return (source.device.type == "cpu" and policy.eligible(source, dist.ReduceOp.SUM)
                and output.dtype == source.dtype
                and source.numel() >= self._compressed.config.min_size
                and output.numel() == source.numel() * self.size)

    def all_gather_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                             opts: Any) -> Any:
        opts = opts or AllgatherOptions()
        if self.on_cuda("all_gather", [*outputs, *inputs]):
            return self.exact("allgather_into_tensor_coalesced", outputs, outputs, inputs, opts)
        state.STATS.add("exact", calls=1, tensor_bytes=nbytes(inputs))
        jobs = [self.inner_job("_allgather_base", [o], o, i, opts)
                for o, i in zip(outputs, inputs)]
        return self._queue.submit(
            self.checked(("all_gather", inputs, 0), self._queue.sequence(jobs, outputs)))

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        return self.exact("broadcast", tensors, tensors, opts,
                          check=("broadcast", tensors, opts.rootRank),
                          problem=lambda: self.root_problem(opts.rootRank))

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: Any) -> Any:
        return self.exact("allgather", outputs, outputs, inputs, opts,
                          check=("all_gather", inputs, 0),
                          problem=lambda: list_problem("output", outputs, inputs, self.size))

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
               opts: Any) -> Any:
        return self.exact("gather", outputs, outputs, inputs, opts,
                          check=("gather", inputs, opts.rootRank),
                          problem=self._lists_problem("output", outputs, inputs, opts.rootRank))

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                opts: Any) -> Any:
        return self.exact("scatter", outputs, outputs, inputs, opts,
                          check=("scatter", outputs, opts.rootRank),
                          problem=self._lists_problem("input", inputs, outputs, opts.rootRank))

    def _lists_problem(self, name: str, lists: list[list[torch.Tensor]],
                       like: list[torch.Tensor], root: int) -> Callable[[], str | None]:
        """The problem of a gather's outputs or a scatter's inputs (``lists``, on ``root``)."""
        return lambda: self.root_problem(root) or (
            list_problem(name, lists, like, self.size) if self.rank == root else None)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Any:
        if self.on_cuda("recv_anysource", tensors):
            raise ValueError("lowbitcc: recv without a source rank needs CPU tensors "
                             "(NCCL has no receive from any source)")
        return self.exact("recv_anysource", tensors, tensors, tag,
                          source_rank=lambda inner: inner._source_rank())

    def barrier(self, opts: Any) -> LocoWork:
        if self._compressed.checks_data_movement():  # the exchange is a barrier itself
            return self._queue.submit(self.checked(("barrier", [], 0), lambda: []))
        return self._queue.submit(lambda: InnerWork(self._inner.barrier(opts), lambda: []))

    def monitored_barrier(self, timeout: datetime.timedelta | float | None,
                          wait_all_ranks: bool) -> None:
        """gloo's debugging barrier, run on the inner gloo group after every call issued before
        it: rank 0 raises naming the first rank (``wait_all_ranks``: every rank) that did not
        arrive within ``timeout`` (seconds or a timedelta; default the group's), the others
        raise that rank 0 failed. Blocks the calling thread; the group's later calls wait."""
        if timeout is None:
            timeout = self._timeout
        elif not isinstance(timeout, datetime.timedelta):
            timeout = datetime.timedelta(seconds=float(timeout))

        def job() -> list[torch.Tensor]:
            self._inner.monitored_barrier(timeout, wait_all_ranks)
            return []

        self._queue.submit(job).wait()


class _CountedExact:
    """The exact fallback of a ``param_bits`` all-gather of ``source``, counted when it runs."""

    def __init__(self, gather: Job, source: torch.Tensor) -> None:
        self._gather, self._source = gather, source

    def __call__(self) -> Any:
        state.STATS.add("exact", calls=1, tensor_bytes=nbytes([self._source]))
        return self._gather()


class GatherCall:
    """An all-gather of flat ``source`` (``m`` elements per rank) into ``output`` (``size *
    m`` elements, same dtype) as ``config.param_bits``-bit codes (`LocoConfig.param_bits`;
    `schedules.gather`). No error feedback (parameters are not accumulated) and nearest
    rounding, so ``output`` is bitwise the same on every rank, its own slot included;
    ``source`` is not modified. Ranks exchange descriptors first (``config.check``) and gather
    exact unless every rank would compress (``wants``: this rank's policy allows it;
    ``exact``: the fallback)."""

    collective = "all_gather"

    def __init__(self, group: CallGroup, output: torch.Tensor, source: torch.Tensor,
                 exact: Job, wants: bool) -> None:
        cfg = group.config
        self.group, self.output, self.source, self.exact = group, output, source, exact
        self.route = group.route(source.device)
        self.desc = wire.CallDescriptor(
            collective=self.collective, dtype=source.dtype, op=0, numel=source.numel(),
            seq=group.agreement.next_seq(), bits=cfg.param_bits,
            group_size=cfg.group_for("int"), compressed=wants, parent=callback_parent())

    def __call__(self) -> Any:
        group = self.group
        try:
            agreed = not group.config.check or group.agreement.agree(self.desc).compressed
        except CorruptFrameError as exc:
            return group.agreement.then_raise(exc, self.exact)
        if not agreed:
            return self.exact()
        self.compress()
        return None

    def compress(self) -> None:
        group, cfg, source, output = self.group, self.group.config, self.source, self.output
        n, numel, itemsize = group.size, source.numel(), source.element_size()
        state.STATS.add_call("compressed", numel * itemsize,
                             COLLECTIVES[self.collective].logical_bytes(n * numel * itemsize, n))
        codec = ShardCodec(
            bits=cfg.param_bits, group_size=cfg.group_for("int"),
            dtype_code=wire.DTYPE_CODES[source.dtype], seq=self.desc.seq, world=n,
            signature=wire.call_signature(self.collective, numel, source.dtype),
            kernels=self.route.kernels, checksum=cfg.checksum_for(source.device.type))
        # no feedback, and no residual sums: the statistics' error is the gradients'
        comp = CallCompressor(codec, state.FEEDBACK, "", state.STATS, error_dtype=None, beta=0.0,
                              reset_interval=0, rank=group.rank, count_sums=False)
        out = output.view(-1) if output.is_contiguous() else torch.empty_like(output).view(-1)
        flat = source.detach().reshape(-1).contiguous()
        schedules.all_gather(Source(flat, 1, numel), out, comp, self.route.links)
        comp.finish()  # no error states: the codec time counted
        comp.raise_deferred()
        if out.data_ptr() != output.data_ptr():
            output.copy_(out.view(output.shape))
