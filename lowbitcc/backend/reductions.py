"""`Reductions`: how a "loco" group issues a reduction the process group has checked and built.

The process group writes each c10d reduction once (`process_group`): it checks the call and
builds its exact forms (`exact.ExactReduction`: the whole call, and one per tensor). Here, in
the calling thread, each tensor of the call takes its place in the route's call schedule
(`call_schedule`) and does what the place says:

- a place whose *exact* entry the call matches runs the inner group's own call at once, counted
  as its job would count it (call number, feedback-key ordinal, statistics, the cost model's
  count and one timing in `worker_issue.EXACT_TIMED`); for an all-reduce the issuer keeps a
  view of the output's last element, the place's *canary*. `at_issue` serves the commonest such
  call (one dense tensor by one of the inner group's own ops) before the process group builds
  anything, with the arguments c10d passed;
- a call that differs from its place's exact entry runs `deviation.ExactDeviation` at once:
  every rank deviated alike (the schedule starts again and the call exchanges as a new one), or
  this rank raises `CollectiveMismatchError` and reports it at its next exchange;
- everything else becomes one compressed job per tensor (`compressed_call.CompressedCall`),
  which exchanges a descriptor, runs its place's compressed entry, or deviates from it, issued
  by the device's `issuer.Issuer`.

A call this rank refuses (its own arguments are invalid) takes its place too (`refuse`), so that
the others do not wait on it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch

from lowbitcc import state
from lowbitcc.backend.call_agreement import CollectiveMismatchError
from lowbitcc.backend.call_plan import PLAN_COLLECTIVES, CallPlan
from lowbitcc.backend.call_schedule import DEVIATE, EXCHANGE, PLANNED, Entry, Plan, Poisoned
from lowbitcc.backend.compressed_calls import CompressedCalls
from lowbitcc.backend.deviation import INVALID_SIGNATURE, Deviation, ExactDeviation
from lowbitcc.backend.exact import ExactReduction, count_exact, op_type, when_done
from lowbitcc.backend.issue_queue import IssueQueue
from lowbitcc.backend.issuer import Issuer

Pairs = Callable[[], tuple[list[torch.Tensor], list[torch.Tensor]]]
"""``pairs()``: each tensor's output and flat source, made only when jobs are built."""


def _stop_when_done(work: Any, stop: Callable[[], None], device_type: str) -> None:
    """End a timing (`CompressedCalls.clock`) of an exact call issued now (its ``work``): a
    CUDA call's at once (the clock's events are recorded on the stream), a CPU call's when its
    gloo work completes (on gloo's thread; untimed where the work has no future)."""
    if device_type != "cpu":
        stop()
    else:
        when_done(work, stop)


class Reductions:
    """The reductions of one group of ``world`` ranks (see the module docstring): ``compressed``
    its compressed calls and schedules, ``issuers`` by device type, ``queue`` its worker."""

    def __init__(self, world: int, compressed: CompressedCalls, issuers: dict[str, Issuer],
                 queue: IssueQueue) -> None:
        self._world, self._compressed, self._issuers, self._queue = (
            world, compressed, issuers, queue)

    # -- the short path --------------------------------------------------------------------
    def at_issue(self, collective: str, tensor: torch.Tensor, output: torch.Tensor,
                 numel: int, op: Any, method: str, args: tuple) -> Any:
        """The commonest call at its cheapest: a reduction of one dense ``tensor`` (``numel``
        elements in all, into ``output``) that its place's exact entry sends exact, by an op
        the inner group runs itself; started now as c10d asked for it (``method``, ``args``).
        None: not such a call, nothing taken (the process group builds it and calls
        `reduce`)."""
        device_type = "cpu" if tensor.is_cpu else tensor.device.type  # (no torch.device made)
        issuer = self._issuers.get(device_type)
        if issuer is None or type(tensor) is not torch.Tensor or tensor.layout != torch.strided:
            return None
        kind = op_type(op)
        if issuer.plans and self._compressed.config.call_plans:
            work = self._run_plan(issuer, collective, tensor, output, numel, op, kind,
                                  device_type, (method, args))
            if work is not None:
                return work
        if kind not in issuer.native_ops:
            return None
        entry = self._planned(collective, tensor, numel, kind, True, device_type)
        if entry is None:
            return None
        return self._run_exact(issuer, entry, collective, tensor, output, numel, op,
                               lambda size_class, nbytes: issuer.native_now(
                                   method, args, [output], size_class, nbytes))

    def _run_plan(self, issuer: Issuer, collective: str, tensor: torch.Tensor,
                  output: torch.Tensor, numel: int, op: Any, kind: Any, device_type: str,
                  native: tuple[str, tuple]) -> Any:
        """Run an all-reduce of ``tensor`` (or a reduce-scatter of it into ``output``) as its
        place's compressed entry, by the place's `call_plan.CallPlan` (made on the first such
        run), where the place holds such an entry that the call matches (its dtype floating
        point: no op is refused); None: nothing taken. ``kind``: ``op``'s type (`op_type`),
        ``device_type`` the tensor's; ``native``: c10d's method and arguments (the exact call
        where a graph is being captured, on CUDA)."""
        if collective not in PLAN_COLLECTIVES or not tensor.is_contiguous():
            return None
        entry = self._planned(collective, tensor, numel, kind, False, device_type)
        if entry is None:
            return None
        plan = entry.plan
        if plan is None:
            plan = entry.plan = CallPlan(self._compressed, self._compressed.route(tensor.device),
                                         tensor, collective)
        plan.canary_entry = entry
        try:
            return issuer.run_plan(plan, tensor, op, native,
                                   None if collective == "all_reduce" else output)
        finally:
            plan.canary_entry = None  # the entry holds the plan: no cycle left behind

    def _run_exact(self, issuer: Issuer, entry: Entry, collective: str, like: torch.Tensor,
                   output: torch.Tensor, numel: int, op: Any,
                   start: Callable[[Any, int], Any], start_counts: bool = False) -> Any:
        """Run a call as its place's exact ``entry``: counted, started by ``start(size_class,
        nbytes)``, and (all-reduce) its output's canary kept at the place. ``start_counts``:
        ``start`` counts the call in the statistics itself (an issuer's ``exact_now``, through
        `ExactReduction.count`), save the cost model's choice of it."""
        nbytes = numel * like.element_size()
        size_class = self._compressed.count_planned(collective, like, numel, op, entry)
        by_model = entry.by_model and size_class is not None
        if not start_counts:
            count_exact(collective, nbytes, self._world, model_exact=by_model)
        elif by_model:
            state.STATS.add("exact", model_exact=1)
        timed, entry.timed = entry.timed and size_class is not None, False
        if timed:  # the issuer's own timing (one in 8 on the worker, else none) left out
            stop = self._compressed.clock(size_class, True, nbytes)
            work = start(None, nbytes)
            _stop_when_done(work, stop, like.device.type)
        else:
            work = start(size_class, nbytes)
        if collective == "all_reduce":
            entry.canary = issuer.canary(output, work)
        return issuer.planned(work, [output])

    # -- the general path ------------------------------------------------------------------
    def reduce(self, issuer: Issuer, collective: str, whole: ExactReduction,
               parts: list[ExactReduction], pairs: Pairs, opts: Any) -> Any:
        """Issue a reduction: ``whole`` exact where no rank may compress it and no descriptor
        is exchanged, or as its place's exact entry; else one compressed job per part (each
        part's output and flat source from ``pairs()``)."""
        like = parts[0].outputs[0]
        op = opts.reduceOp
        compress = self._compressed.wants(op_type(op), [t for p in parts for t in p.outputs])
        numels = [sum(t.numel() for t in p.inputs) for p in parts]
        if not compress and not self._compressed.agrees_on(numels):
            return issuer.exact(whole, parts)
        plans = self._plans(issuer, collective, like, numels, op)
        if plans is not None and plans[0].kind == PLANNED and plans[0].entry.exact:
            return self._run_exact(issuer, plans[0].entry, collective, like, like, numels[0],
                                   op, lambda size_class, _: issuer.exact_now(whole, size_class),
                                   start_counts=True)
        outputs, sources = pairs()
        several = len(parts) > 1
        jobs = [self._compressed.call(collective, out, src, op, issuer.fallback(p), compress,
                                      plan=plans and plans[i], part=several)
                for i, (out, src, p) in enumerate(zip(outputs, sources, parts))]
        return issuer.run(jobs, parts, [*whole.outputs, *sources, *whole.inputs], outputs,
                          opts.asyncOp)

    def _plans(self, issuer: Issuer, collective: str, like: torch.Tensor, numels: list[int],
               op: Any) -> list[Plan] | None:
        """Each tensor's place (None: no call schedule). A deviation from an exact entry runs
        here, at once (`deviate_exact`)."""
        several = len(numels) > 1
        plans: list[Plan] = []
        try:
            for numel in numels:
                plan = self._compressed.places.plan(collective, like, numel, op, part=several,
                                                    first=not plans)
                if plan is None:
                    return None
                plans.append(plan)
                if plan.kind == DEVIATE and plan.entry.exact:
                    self.deviate_exact(issuer, plan, like.device)
        except BaseException:  # a deviation's error, or a renewal's that a place took
            for taken in plans:
                taken.settle()
            self._take_seqs(len(numels))
            raise
        return plans

    def _take_seqs(self, count: int) -> None:
        """A call of ``count`` tensors raised before its jobs took their call numbers: take
        them, as the other ranks' calls do (every rank raises alike), so that the ranks'
        numbers stay in step."""
        for _ in range(count):
            self._compressed.agreement.next_seq()

    def _planned(self, collective: str, tensor: torch.Tensor, numel: int, kind: Any,
                 exact: bool, device_type: str) -> Entry | None:
        """`CallPlaces.planned` of a call of one tensor; where taking its place raised (a
        place's renewal, `renewal`), the call takes its call number first (`_take_seqs`)."""
        try:
            return self._compressed.places.planned(collective, tensor, numel, kind, exact,
                                                   device_type)
        except BaseException:
            self._take_seqs(1)
            raise

    def deviate_exact(self, issuer: Issuer, plan: Plan, device: torch.device,
                      refused: bool = False) -> None:
        """This rank's call is not its place's exact entry (``refused``: this rank refused its
        own arguments): run `ExactDeviation`; where every rank deviated alike (and none
        refused), start the schedule again, ``plan`` becoming an exchange at its first place;
        else raise `CollectiveMismatchError`, to be reported at the next exchange."""
        entry = plan.entry
        assert entry is not None
        alike = ExactDeviation(entry, self._world, device,
                               lambda method, args, outputs: issuer.native_now(
                                   method, args, outputs, None, 0)).run()
        if alike and not refused:
            plan.schedule.restart(plan)
            return
        if not alike:
            plan.schedule.deviated = True
        if entry.desc.collective == "all_reduce":  # its next run exchanges, as the others'
            entry.canary = Poisoned()
        if refused:
            return
        expected = entry.desc
        raise CollectiveMismatchError(
            f"lowbitcc: rank {self._compressed.rank} issued a call that is not the "
            f"{expected.collective} of {expected.numel} {expected.dtype} elements the ranks had "
            "agreed on at this place in their sequence of calls (an exact call); it ran that "
            "call on a NaN-filled buffer instead, so the other ranks' outputs are NaN, and "
            "every rank raises at its next descriptor exchange")

    # -- refusals --------------------------------------------------------------------------
    def refuse(self, error: Exception, issuer: Issuer, outputs: list[torch.Tensor],
               collective: str = "reduce_scatter") -> NoReturn:
        """Raise ``error``, this rank's verdict on a reduction of ``outputs`` (one call per
        tensor), after taking part in what the valid call does: the descriptor exchange it
        would make, flagged invalid (`CompressedCalls.refused`); under the call schedule, at a
        place with an entry, the entry's call run as a deviation (so that the others raise at
        this call, or, at an exact entry, at their next exchange)."""
        world = self._world if collective == "reduce_scatter" else 1
        numels = [o.numel() * world for o in outputs]
        if not self._compressed.agrees_on(numels):
            raise error
        try:
            plans = self._compressed.places.refusal_plans(collective, outputs[0], numels)
        except BaseException:  # a renewal's error, which every rank raises here
            self._take_seqs(len(numels))
            raise
        first = plans[0] if plans else None
        try:
            if first is not None and first.kind != EXCHANGE:
                self._deviate_refused(issuer, first, len(numels), outputs[0])
            else:
                job = self._compressed.refused(collective, error, numels, outputs[0], first)
                self._queue.submit(job).wait()  # raises error
        finally:
            for plan in plans or []:
                plan.settle()
        raise error

    def _deviate_refused(self, issuer: Issuer, plan: Plan, count: int,
                         like: torch.Tensor) -> None:
        """Run a refused call's place's entry as a deviation (see `refuse`), taking the call
        numbers of its ``count`` tensors."""
        group = self._compressed
        seq = [group.agreement.next_seq() for _ in range(count)][0]
        if plan.entry.exact:
            self.deviate_exact(issuer, plan, like.device, refused=True)
            return
        deviation = Deviation(group, group.route(like.device), seq, like.device, plan.entry,
                              INVALID_SIGNATURE)
        if issuer.inline:
            deviation.run()
        else:
            self._queue.submit(lambda: deviation.run() and []).wait()
