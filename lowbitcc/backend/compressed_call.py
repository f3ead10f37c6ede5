"""One compressed call of a "loco" group, as an object whose methods are its phases.

A `CompressedCall` is built in the issuing thread, when c10d's call arrives: it takes the call's
number and error-feedback key (`CompressedCalls.key`) and builds its `wire.CallDescriptor`.
Calling it runs it, as the call's job on the group's worker (or in the issuing thread, on an
inline route), phase by phase:

1. under the call schedule (`lowbitcc.backend.call_schedule`), its ``plan``, taken when it was
   issued: a call that differs from its place's compressed entry `deviate`s (a call that runs
   as its place's entry is no job: `plan_run.PlanRun`); otherwise rank 0's cost model may
   `suggest` a path (`lowbitcc.cost_model`);
2. `agree`: the descriptor exchange (`call_agreement.CallAgreement`): the call is compressed
   only if every rank would compress it and rank 0's model did not choose exact;
3. `record`: the outcome becomes its place's entry; then one of `run_exact` (the caller's exact
   fallback, timed for the cost model where it chose), `reduce_framed` (a small exact
   reduction carried in the frames themselves) and `compress`: the call's `ShardCodec` and
   `CallCompressor`, the schedule (`schedules`), and the compressor's `finish` (new error
   states stored).

Subclasses say which schedule runs and where results go: `AllReduceCall` and
`ReduceScatterCall` (the ``param_bits`` all-gather is `data_movement.GatherCall`).

A `Route` is the device-specific part: which codec kernels and which links (transports) serve
tensors of one device type, whether its jobs run in the calling thread (``inline``: CUDA, see
`cuda_issue`) and which schedules its links can run. Schedules, keys, feedback, descriptor
agreement and byte accounting are shared by every device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from lowbitcc import policy, schedules, state
from lowbitcc.backend.call_agreement import (
    CallAgreement,
    CollectiveMismatchError,
    CorruptFrameError,
    InvalidPeerCallError,
)
from lowbitcc.backend.call_schedule import (
    DEVIATE,
    EXCHANGE,
    Place,
    Poisoned,
    runs_for,
)
from lowbitcc.backend.deviation import Deviation
from lowbitcc.backend.exact import (
    Reduction,
    count_exact,
    op_type,
    reduce_in_rank_order,
    reduces_in_rank_order,
)
from lowbitcc.backend.issue_queue import Job
from lowbitcc.backend.place_graph import LiveGraphs
from lowbitcc.backend.routes import Route
from lowbitcc.backend.works import callback_parent
from lowbitcc.buffers import Buffers
from lowbitcc.codec import exchange_frame, wire
from lowbitcc.codec.shard_codec import ShardCodec
from lowbitcc.collectives import COLLECTIVES
from lowbitcc.compressor import CallCompressor, Source
from lowbitcc.config import LocoConfig
from lowbitcc.cost_model import CostModel, SizeClass, Suggestion


class CallGroup(Protocol):
    """What a call needs of its group (`compressed_calls.CompressedCalls`): its settings, ranks,
    descriptor exchanges, cost model, and the group-wide helpers below."""

    rank: int
    size: int
    config: LocoConfig
    agreement: CallAgreement
    cost_model: CostModel
    scratch: Buffers
    graphs: LiveGraphs
    submit: Callable[[Callable[[], Any]], Any] | None

    def route(self, device: torch.device) -> Route: ...
    def forget_places(self) -> None: ...
    def key(self, collective: str, tensor: torch.Tensor, numel: int) -> tuple[str, bool]: ...
    def key_prefix(self, collective: str | None = None, dtype: torch.dtype | None = None,
                   numel: int = 0) -> str: ...
    def modelled(self, numel: int) -> bool: ...
    def clock(self, size_class: SizeClass, exact: bool, nbytes: int) -> Callable[[], None]: ...
    def timed_exact(self, exact: Job, size_class: SizeClass, nbytes: int) -> Any: ...
    def schedule_for(self, nbytes: int, route: Route, device_type: str) -> str: ...
    def chunk(self, route: Route, m: int) -> int: ...
    def codec(self, collective: str, dtype: torch.dtype, numel: int, device_type: str,
              route: Route) -> ShardCodec: ...
    def compressor(self, codec: ShardCodec, key: str = "", buffer: StorageWeakRef | None = None,
                   scratch: Buffers | None = None) -> CallCompressor: ...


class CompressedCall:
    """One compressible reduction of ``source`` on ``group`` (see the module docstring).

    ``output``: where the result goes; ``op``: the c10d reduction; ``exact``: the exact
    fallback after an exchange (a job on the group's worker, or on an inline route an exact
    call issued in the calling thread); ``wants``: whether this rank would compress it (its
    policy said so); ``plan``: its place in the call schedule and
    what it does there (`call_schedule.Place`; None: no schedule), taken by the issuing
    thread: an exchange, or a deviation from a compressed entry (an entry's run is its place's
    `plan_run.PlanRun`, and exact entries never reach a job); ``part``: one tensor of a call
    of several.
    """

    collective: ClassVar[str]

    def __init__(self, group: CallGroup, output: torch.Tensor, source: torch.Tensor, op: Any,
                 exact: Job, wants: bool, plan: Place | None = None, part: bool = False) -> None:
        cfg = group.config
        self.group, self.output, self.source, self.op = group, output, source, op
        self.exact = exact
        self.numel = source.numel()
        self.nbytes = self.numel * source.element_size()
        self.route = group.route(source.device)
        self.seq = group.agreement.next_seq()
        self.key, derived = group.key(self.collective, source, self.numel) if wants else ("", False)
        # a derived key's layout is checked by the buffer it reduces; an explicit one is trusted
        self.buffer = StorageWeakRef(source.untyped_storage()) if derived else None
        self.modelled = group.modelled(self.numel) and not policy.forced()
        self.framed = (cfg.check and not self.route.inline and self.nbytes <= exchange_frame.FRAME_PAYLOAD
                       and source.layout == torch.strided
                       and reduces_in_rank_order(op, source.dtype))
        self.plan, self.part = plan, part
        self.verdict: torch.Tensor | None = None
        """After a compressed run on CUDA: the device flag of a foreign message received
        (`CallCompressor.foreign`), which the issuer turns into the Work's verdict word."""
        self.desc = self.descriptor(wants)
        self.reduction = Reduction.of(op, group.size)

    def descriptor(self, wants: bool) -> wire.CallDescriptor:
        """What this rank says of the call in the exchange."""
        cfg = self.group.config
        return wire.CallDescriptor(
            collective=self.collective, dtype=self.source.dtype, op=int(op_type(self.op)),
            numel=self.numel, seq=self.seq, bits=cfg.bits, group_size=cfg.wire_group_size,
            compressed=wants and self.numel >= cfg.min_size, fmt=cfg.wire_format,
            framed=self.framed, parent=callback_parent(), part=self.part,
            deviated=self.plan is not None and self.plan.kind == EXCHANGE
            and self.plan.schedule.take_deviated())

    def __call__(self) -> Any:
        """Run the call (its job); its value is the job's (None, or inner work in flight)."""
        try:
            return self.run()
        finally:
            self.close()

    def close(self) -> None:
        """The call ran, or will not run (an earlier call of its sequence raised): settle its
        place's plan (idempotent)."""
        if self.plan is not None:
            self.plan.settle()

    def run(self) -> Any:
        plan = self.plan
        if plan is not None and plan.kind == DEVIATE:
            self.deviate(plan)  # raises, unless every rank deviated to this call
        suggestion = self.suggest()
        try:
            leader, inputs = self.agree(suggestion)
        except CorruptFrameError as exc:
            return self.group.agreement.then_raise(exc, self.exact)
        except (CollectiveMismatchError, InvalidPeerCallError):
            if plan is not None:  # every rank raises here: every rank starts again
                self.group.forget_places()
            raise
        if not leader.compressed:  # some rank would not compress it (or it is too small)
            self.record(compressed=False)
            return self.exact() if inputs is None else self.reduce_framed(inputs)
        if suggestion is not None and leader.prefer_exact:
            self.record(compressed=False, by_model=True, explore=leader.explore)
            return self.run_exact(leader, suggestion)
        self.record(compressed=True, explore=suggestion is not None and leader.explore)
        return self.compress(suggestion)

    def record(self, compressed: bool, by_model: bool = False, explore: bool = False) -> None:
        """Leave the call's place the agreed outcome (`call_schedule.runs_for`; ``by_model``:
        rank 0's cost model chose the exact path; ``explore``: its choice was a warm-up or an
        exploration) and settle it."""
        plan = self.plan
        if plan is None:
            return
        if compressed:
            self.schedule_name()  # raises where the configured schedule cannot run here
        runs = runs_for(dataclasses.replace(self.desc, explore=explore), compressed, True,
                        self.group.size)
        plan.schedule.agreed(plan.index, self.desc, runs, exact=not compressed,
                             by_model=by_model,
                             eligible=policy.eligible(self.output, op_type(self.op)))
        plan.settle()

    def deviate(self, plan: Place) -> None:
        """This rank's call is not its place's compressed entry: run the entry in its place
        (`deviation.Deviation`) and raise; unless every rank deviated to this call: then
        every rank restarts its schedule with this call, which the caller agrees on as on a
        new one. (A schedule is kept where ranks raise: on CUDA the ranks that did not deviate
        see only NaN, and every rank must keep counting alike.)"""
        assert plan.entry is not None
        signature = wire.call_signature(self.collective, self.numel, self.source.dtype)
        deviation = Deviation(self.group, self.route, self.seq, self.source.device, plan.entry,
                              signature)
        alike = deviation.run()
        if alike:
            plan.schedule.restart(plan)
        else:
            # the others see it at this call from the headers on CPU and the direct schedule;
            # on CUDA only as NaN and a verdict word, and off the direct schedule some only as
            # NaN: every rank exchanges at the place's run after next and raises there
            if self.source.device.type != "cpu" or not deviation.direct:
                plan.schedule.deviated = True
                plan.entry.keep(Poisoned())
            expected = plan.entry.desc
            raise CollectiveMismatchError(
                f"lowbitcc: rank {self.group.rank} issued a {self.collective} of {self.numel} "
                f"{self.source.dtype} elements where the ranks had agreed on a "
                f"{expected.collective} of {expected.numel} {expected.dtype} elements (this "
                "call's place in the sequence of calls); every rank raises")

    def describe(self) -> str:
        """The call, for messages."""
        return f"{self.collective} of {self.numel} {self.source.dtype} elements (call #{self.seq})"

    def schedule_name(self) -> str:
        """The compressed schedule this call runs on."""
        return self.group.schedule_for(self.nbytes, self.route, self.source.device.type)

    def suggest(self) -> Suggestion | None:
        """This rank's cost model's suggestion where the model chooses the path (None: it does
        not; every rank follows rank 0's)."""
        if not self.modelled:
            return None
        return self.group.cost_model.suggest(self.collective, self.nbytes,
                                             self.source.device.type)

    def agree(self, suggestion: Suggestion | None
              ) -> tuple[wire.CallDescriptor, torch.Tensor | None]:
        """The descriptor exchange: rank 0's descriptor as agreed, and for a framed call every
        rank's frame (`CallAgreement.exchange`); without ``check``, this rank's own."""
        call = self.desc if suggestion is None else dataclasses.replace(
            self.desc, prefer_exact=suggestion.exact,
            explore=suggestion.explore)
        group = self.group
        if not group.config.check or group.size == 1:
            return call, None
        if self.route.inline and group.submit is not None:
            agreed: list[wire.CallDescriptor] = []
            group.submit(lambda: agreed.append(group.agreement.agree(call)) or []).wait()
            return agreed[0], None
        mine = self.reduction.scaled(self.source.detach().reshape(-1)) if self.framed else None
        return group.agreement.exchange(call, mine)

    def run_exact(self, leader: wire.CallDescriptor, suggestion: Suggestion) -> Any:
        """Rank 0's model chose the exact path: run the exact call, timed for the model."""
        state.STATS.add("exact", model_exact=1)
        return self.group.timed_exact(self.exact, suggestion.size_class, self.nbytes)

    def reduce_framed(self, inputs: torch.Tensor) -> None:
        """Reduce the call from every rank's frame (``inputs``, uint8, a row per rank)."""
        n = self.group.size
        count_exact(self.collective, self.nbytes, n)
        rows = [inputs[r, :self.nbytes].clone().view(self.source.dtype) for r in range(n)]
        self.deliver(reduce_in_rank_order(rows, self.op, n))

    def compress(self, suggestion: Suggestion | None) -> None:
        """Run the compressed schedule, then store the call's new error states."""
        group = self.group
        stop = None if suggestion is None else group.clock(suggestion.size_class, False,
                                                           self.nbytes)
        n = group.size
        m = -(-self.numel // n)
        itemsize = self.source.element_size()
        state.STATS.add_call("compressed", self.nbytes,
                             COLLECTIVES[self.collective].logical_bytes(n * m * itemsize, n))
        comp = self.compressor()
        flat = self.source.detach().reshape(-1).contiguous()
        self.schedule(Source(flat, n, m, self.reduction.input_factor()), comp)
        self.verdict = comp.foreign()
        comp.finish()
        comp.raise_deferred(CollectiveMismatchError)
        if stop is not None:
            stop()

    def compressor(self) -> CallCompressor:
        """The call's codec and compressor (error feedback under its key)."""
        group = self.group
        codec = group.codec(self.collective, self.source.dtype, self.numel,
                            self.source.device.type, self.route).with_seq(self.seq)
        return group.compressor(codec, self.key, self.buffer,
                                None if self.route.inline else group.scratch)

    def schedule(self, source: Source, comp: CallCompressor) -> None:
        """Run the compressed schedule of ``source`` and write the call's outputs."""
        raise NotImplementedError

    def deliver(self, reduced: torch.Tensor) -> None:
        """Write the reduction of every rank's whole source (flat) to the call's outputs."""
        raise NotImplementedError


class AllReduceCall(CompressedCall):
    """A compressed all-reduce of ``source`` in place (``output`` is ``source``)."""

    collective = "all_reduce"

    def schedule(self, source: Source, comp: CallCompressor) -> None:
        tensor, route = self.source, self.route
        out = tensor.view(-1) if tensor.is_contiguous() else torch.empty_like(source.tensor)
        schedules.all_reduce(self.schedule_name(), source, out, comp,
                             route.links, self.group.chunk(route, source.m))
        if out.data_ptr() != tensor.data_ptr():
            tensor.copy_(out.view(tensor.shape))

    def deliver(self, reduced: torch.Tensor) -> None:
        self.source.copy_(reduced.view(self.source.shape))


class ReduceScatterCall(CompressedCall):
    """A compressed reduce-scatter of flat ``source`` (``size`` rows of ``output.numel()``)
    into ``output``."""

    collective = "reduce_scatter"

    def schedule(self, source: Source, comp: CallCompressor) -> None:
        route = self.route
        reduced = schedules.reduce_scatter(self.schedule_name(), source, comp,
                                           route.links, self.group.chunk(route, source.m))
        self.output.copy_(reduced.view(self.output.shape))

    def deliver(self, reduced: torch.Tensor) -> None:
        rows = reduced.view(self.group.size, -1)
        self.output.copy_(rows[self.group.rank].view(self.output.shape))


CALLS: dict[str, type[CompressedCall]] = {
    "all_reduce": AllReduceCall, "reduce_scatter": ReduceScatterCall}
"""The compressed reductions by collective (`lowbitcc.collectives`): a new one is a row here,
a subclass, and its schedule function."""
