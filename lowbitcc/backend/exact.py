"""Exact reductions on the inner gloo group, with the ops gloo lacks emulated.

Gloo has no AVG and no PREMUL_SUM. `Reduction.of(op, world)` says how a reduction runs as a
gloo op: AVG is a SUM whose outputs are divided by the group size afterwards; PREMUL_SUM is a
SUM of the inputs multiplied by the factor first (on copies, copied back for in-place calls).
`ExactReduction` is one such call on one gloo group, run as a job on the group's worker (or,
run as its place's exact entry, issued at once by the calling thread: `start_now`); its
``issue(group, buffers, opts)`` starts the gloo op on the (possibly scaled) input buffers.
`reduce_in_rank_order` reduces inputs already gathered (the small calls that travel in a
descriptor frame).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from lowbitcc import state
from lowbitcc.backend.gloo_threads import GlooCallback
from lowbitcc.backend.works import InnerWork
from lowbitcc.collectives import COLLECTIVES

ReduceOp = dist.ReduceOp
Issue = Callable[[dist.ProcessGroup, list[torch.Tensor], Any], Any]
"""``issue(group, buffers, opts)`` starts a gloo reduction of ``buffers`` with ``opts`` on
``group``."""

_COPIED_OPTIONS = ("rootRank", "rootTensor", "timeout", "asyncOp")


_RED_OP_TYPE = ReduceOp.RedOpType


def op_type(op: ReduceOp | Any) -> Any:
    """The ``ReduceOp.RedOpType`` of ``op`` (c10d hands over either form)."""
    return op if type(op) is _RED_OP_TYPE else op.op


@dataclasses.dataclass(frozen=True)
class Reduction:
    """How a reduction runs on gloo: inputs scaled by ``factor``, outputs divided by ``divisor``."""

    op: Any
    factor: float | torch.Tensor | None = None
    divisor: int | None = None

    @classmethod
    def of(cls, op: ReduceOp | Any, world: int) -> Reduction:
        """``op`` as gloo runs it on ``world`` ranks (raises on a PREMUL_SUM without a factor)."""
        kind = op_type(op)
        if kind == ReduceOp.AVG:
            return cls(ReduceOp.SUM, divisor=world)
        if kind == ReduceOp.PREMUL_SUM:
            factor = getattr(op, "factor", None)
            if factor is None:
                raise ValueError(
                    "lowbitcc: PREMUL_SUM without a factor (use dist._make_nccl_premul_sum)")
            return cls(ReduceOp.SUM, factor=factor)
        return cls(kind)

    @property
    def plain(self) -> bool:
        """Whether gloo runs the reduction as it is (no input factor, no divisor)."""
        return self.factor is None and self.divisor is None

    @staticmethod
    def folded_kind(op: ReduceOp | Any) -> Any:
        """The element-wise op a reduction by ``op`` folds with: SUM for AVG and PREMUL_SUM
        (their scaling aside), else ``op``'s own kind."""
        kind = op_type(op)
        return ReduceOp.SUM if kind in (ReduceOp.AVG, ReduceOp.PREMUL_SUM) else kind

    def scaled(self, t: torch.Tensor) -> torch.Tensor:
        """What a rank contributes of input ``t``: times PREMUL_SUM's factor (a copy), else
        ``t`` itself."""
        if self.factor is None:
            return t
        factor = self.factor
        return t * (factor.to(t.dtype) if isinstance(factor, torch.Tensor) else factor)

    def input_factor(self) -> float:
        """What a compressed call multiplies its inputs by: the factor, ``1/divisor``, else 1."""
        if self.divisor is not None:
            return 1.0 / self.divisor
        if self.factor is not None:
            return float(self.factor)
        return 1.0


def input_factor(op: ReduceOp | Any, world: int) -> float:
    """`Reduction.of` ``(op, world)``'s ``input_factor()``, built once per op type and world
    where it does not depend on the op's own factor (every op but PREMUL_SUM)."""
    kind = op_type(op)
    if kind == ReduceOp.PREMUL_SUM:
        return Reduction.of(op, world).input_factor()
    return _fixed_factor(kind, world)


@functools.cache
def _fixed_factor(kind: Any, world: int) -> float:
    return Reduction.of(kind, world).input_factor()


@dataclasses.dataclass(frozen=True)
class ExactReduction:
    """One exact reduction of ``inputs`` into ``outputs`` on ``group``, a gloo group.

    ``opts`` are the caller's options; ``in_place`` says the outputs are the inputs (so scaled
    copies are copied back); ``world`` is the group size (AVG's divisor). `on` gives the same
    call on another group. ``native`` is the same call as c10d asked for it, ``(method, args)``
    with the caller's options last, for an inner backend that reduces every op itself (NCCL);
    ``issue`` None: gloo has no one operation for the call (the issuer runs its parts).
    """

    opts: Any
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    issue: Issue | None
    in_place: bool
    world: int
    group: dist.ProcessGroup
    collective: str = "all_reduce"
    native: tuple[str, tuple] = ("", ())

    def on(self, group: dist.ProcessGroup) -> ExactReduction:
        """The same call on ``group`` (a field-by-field copy: `dataclasses.replace` costs
        several times more, on every exact fallback a compressed call builds)."""
        if group is self.group:
            return self
        other = object.__new__(ExactReduction)
        other.__dict__.update(self.__dict__)
        other.__dict__["group"] = group
        return other

    def count(self) -> None:
        """Count the call in the statistics (`count_exact`)."""
        count_exact(self.collective, sum(t.numel() * t.element_size() for t in self.inputs),
                    self.world)

    def __call__(self) -> InnerWork:
        """Start the gloo op (on the worker thread); the returned work finishes the call."""
        self.count()
        red = Reduction.of(self.opts.reduceOp, self.world)
        if red.plain:  # gloo's own op: the caller's options
            work = self.issue(self.group, self.inputs, self.opts)
            return InnerWork(work, lambda: self.outputs)
        sum_opts = type(self.opts)()
        for field in _COPIED_OPTIONS:
            if hasattr(self.opts, field):
                setattr(sum_opts, field, getattr(self.opts, field))
        sum_opts.reduceOp = red.op
        buffers = [red.scaled(t) for t in self.inputs]
        work = self.issue(self.group, buffers, sum_opts)

        def finish() -> list[torch.Tensor]:
            if self.in_place and red.factor is not None:
                for dst, src in zip(self.outputs, buffers):
                    dst.copy_(src)
            if red.divisor is not None:
                for t in self.outputs:
                    _divide_(t, red.divisor)
            return self.outputs

        return InnerWork(work, finish)


_ELEMENTWISE = {
    ReduceOp.SUM: torch.Tensor.add_,
    ReduceOp.PRODUCT: torch.Tensor.mul_,
    ReduceOp.MIN: lambda acc, x: torch.minimum(acc, x, out=acc),
    ReduceOp.MAX: lambda acc, x: torch.maximum(acc, x, out=acc),
    ReduceOp.BAND: torch.Tensor.bitwise_and_,
    ReduceOp.BOR: torch.Tensor.bitwise_or_,
    ReduceOp.BXOR: torch.Tensor.bitwise_xor_,
}
_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
PLAIN_OPS = frozenset(_ELEMENTWISE)
"""The ops gloo runs as they are (`Reduction.plain`): not AVG, not PREMUL_SUM."""
_GLOO_REDUCES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16,
                           torch.int8, torch.uint8, torch.int32, torch.int64})
"""The real and integer dtypes gloo reduces (it refuses int16, the unsigned types past uint8
and the float8 types with "Invalid scalar type")."""


def reduces_in_rank_order(op: ReduceOp | Any, dtype: torch.dtype) -> bool:
    """Whether `reduce_in_rank_order` serves ``op`` on ``dtype``: the real and integer dtypes
    gloo reduces (so that a call behaves alike at every size), the ops gloo has and AVG and
    PREMUL_SUM (the process group refuses PREMUL_SUM on integers first); the bitwise ops on
    integers only."""
    kind = Reduction.folded_kind(op)
    if dtype not in _GLOO_REDUCES or kind not in _ELEMENTWISE:
        return False
    return not (dtype.is_floating_point and kind in _BITWISE)


def reduce_in_rank_order(rows: list[torch.Tensor], op: ReduceOp | Any,
                         world: int) -> torch.Tensor:
    """The reduction by ``op`` of every rank's contribution (``rows[r]``: rank r's input as
    `Reduction.scaled` gives it, flat, one dtype), folded in rank order one element-wise step at a time, so
    every rank that folds the same rows gets the same bits. Returns a new tensor."""
    red = Reduction.of(op, world)
    step = _ELEMENTWISE[red.op]
    acc = rows[0].clone()
    for row in rows[1:]:
        step(acc, row)
    if red.divisor is not None:
        _divide_(acc, red.divisor)
    return acc


def count_exact(collective: str, size_bytes: int, world: int, model_exact: bool = False) -> None:
    """Count an exact call of ``collective`` with ``size_bytes`` (its size as
    `lowbitcc.collectives` defines it) in the statistics: its logical bytes are its wire bytes;
    ``model_exact``: the cost model sent it exact."""
    sent = _logical_bytes(collective, size_bytes, world)
    state.STATS.add("exact", calls=1, tensor_bytes=size_bytes, logical_bytes=sent, wire_bytes=sent,
                    model_exact=int(model_exact))


@functools.lru_cache(maxsize=1024)
def _logical_bytes(collective: str, size_bytes: int, world: int) -> int:
    """`Collective.logical_bytes`, kept per size: a steady call counts the same size again."""
    return COLLECTIVES[collective].logical_bytes(size_bytes, world)


def all_reduce_of(group: dist.ProcessGroup, buffers: list[torch.Tensor], opts: Any) -> dist.Work:
    """`Issue` of gloo's all-reduce (``opts``: all-reduce or coalesced all-reduce options)."""
    if isinstance(opts, dist.AllreduceCoalescedOptions):
        return group.allreduce_coalesced(buffers, opts)
    return group.allreduce(buffers, opts)


def reduce_of(group: dist.ProcessGroup, buffers: list[torch.Tensor], opts: Any) -> dist.Work:
    """`Issue` of gloo's reduce."""
    return group.reduce(buffers, opts)


def reduce_scatter_into(output: torch.Tensor) -> Issue:
    """`Issue` of gloo's list reduce-scatter of one rank's input list into ``output``."""

    def issue(group: dist.ProcessGroup, buffers: list[torch.Tensor], opts: Any) -> dist.Work:
        return group.reduce_scatter([output], [buffers], opts)

    return issue


def reduce_scatter_flat_into(output: torch.Tensor) -> Issue:
    """`Issue` of gloo's flat reduce-scatter of one input tensor into ``output``."""

    def issue(group: dist.ProcessGroup, buffers: list[torch.Tensor], opts: Any) -> dist.Work:
        return group._reduce_scatter_base(output, buffers[0].contiguous(), opts)

    return issue


def when_done(work: dist.Work, callback: Callable[[], None]) -> None:
    """Run ``callback()`` once gloo's ``work`` has completed, on the gloo thread that completes
    it (or here, if it has; a `GlooCallback`, which lets go of it elsewhere); never where gloo
    gives the operation no future (its flat reduce-scatter)."""
    try:
        future = work.get_future()
    except RuntimeError:  # "Work::getFuture not implemented"
        return
    future.add_done_callback(GlooCallback(lambda _: callback()))


def start_now(call: ExactReduction, on_done: Callable[[dist.Work], None] | None = None,
              complete: Callable[[InnerWork], dist.Work] | None = None) -> dist.Work:
    """Start ``call`` in the calling thread and return its Work, whose value is the call's
    outputs; ``on_done(gloo_work)``, if given, runs on the gloo thread that completes it (it
    takes the GIL there, which costs the caller's wait about 0.1-0.3 ms). Where the call needs
    no finishing (no AVG or PREMUL_SUM), gloo's own Work itself; else a Work whose future
    finishes the call (AVG's division, PREMUL_SUM's copy back) without autograd on that
    thread, with the gloo op's error as its error. Gloo gives some operations no future (its
    flat reduce-scatter): those are finished by ``complete(inner_work)`` (the caller's worker),
    or without it waited for here, and are not timed. What runs on gloo's thread is a
    `GlooCallback`."""
    inner = call()
    plain = Reduction.of(call.opts.reduceOp, call.world).plain
    if plain and on_done is None:
        return inner.work
    try:
        future = inner.work.get_future()
    except RuntimeError:  # "Work::getFuture not implemented"
        if plain:
            return inner.work
        if complete is not None:
            return complete(inner)
        inner.work.wait()
        with torch.no_grad():
            done = torch.futures.Future()
            done.set_result(inner.finish())
        return _create_work_from_future(done)
    if plain:
        future.add_done_callback(GlooCallback(lambda _: on_done(inner.work)))
        return inner.work

    def finish(done: torch.futures.Future) -> list[torch.Tensor]:
        try:
            done.value()  # raises the gloo op's error
            with torch.no_grad():
                return inner.finish()
        finally:
            if on_done is not None:
                on_done(inner.work)

    return _create_work_from_future(future.then(GlooCallback(finish)))


class HostCanary:
    """The last element of a CPU all-reduce's ``output``, read once its ``work`` completed
    (waiting for it if needed: `call_schedule` reads a place's canary at the place's run after next).
    A work that failed reads as NaN (the place then exchanges again)."""

    __slots__ = ("_work", "_output")

    def __init__(self, output: torch.Tensor, work: Any) -> None:
        self._work, self._output = work, output

    def nan(self) -> bool:
        out = self._output
        if not out.numel():
            return False
        try:
            if not self._work.is_completed():
                self._work.wait()
        except Exception:  # noqa: BLE001 (the call raised to its caller already)
            return True
        return math.isnan((out if out.dim() == 1 else out.reshape(-1))[-1].item())


class RaisedCanary:
    """The canary of a run that raised in the calling thread (the inline issuer's run of a plan
    off the direct schedule): it reads as NaN, as `HostCanary` reads a Work that failed (the
    worker's), so that every rank exchanges at the place's run after next whichever issuer,
    and whichever path, ran the call."""

    __slots__ = ()

    def nan(self) -> bool:
        return True


RAISED = RaisedCanary()


def _divide_(t: torch.Tensor, divisor: int) -> None:
    if t.is_floating_point() or t.is_complex():
        t.div_(divisor)
    else:
        t.copy_(torch.div(t, divisor, rounding_mode="trunc"))
