"""`Reductions`: how a "loco" group issues a reduction: its place, then the steady call or the
general path.

Every tensor of a reduction takes its place in its device's call schedule (`call_schedule`) in
the calling thread, once (`take`, `CallSchedule.take`): one key, one wish, one matcher. What it
gets there decides the call:

- an `Entry`: **the steady-state call** (`run`), nothing built but its Work. An *exact* entry
  runs the inner group's own call at once, counted as its job would count it (call number,
  feedback-key ordinal, statistics, the cost model's count and one timing in
  `worker_issue.EXACT_TIMED`; for an all-reduce the issuer keeps a view of the output's last
  element, the place's *canary*; the C++ runners, `steady_runner`, serve such a call whole
  before it reaches this module, doing the same on the same objects: on CPU the group's
  runner, on CUDA its device runner, which of a compressed entry takes the place and calls
  `run` itself). A *compressed*
  entry runs by the place's
  `call_plan.CallPlan`, made by its first run: a `plan_run.PlanRun` handed to the device's
  issuer (the worker on the CPU, the calling thread inline and on CUDA), which runs the
  schedule's own code with the plan's kept buffers;
- a `Place` deviating from an exact entry: `deviation.ExactDeviation` at once (every rank
  deviated alike: the schedule starts again and the call exchanges as a new one; else this rank
  raises `CollectiveMismatchError` and reports it at its next exchange);
- anything else (an exchange, a deviation from a compressed entry, a call of several tensors):
  the general path (`reduce`), where the process group has checked the call and built its exact
  forms (`exact.ExactReduction`): one job per tensor, a compressed entry's `PlanRun` or a
  `compressed_call.CompressedCall`, issued by the device's `issuer.Issuer`.

A reduction issued by a future's callback, or (CPU tensors) by another thread than the main
one, takes no place and exchanges a descriptor every time: gloo completes its futures on its
own threads, and callbacks issue their calls in orders that differ between ranks. A call this
rank refuses (its own arguments are invalid) takes its place too (`refuse`), so that the others
do not wait on it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from lowbitcc import policy, state
from lowbitcc.backend.arguments import op_problem
from lowbitcc.backend.call_agreement import CollectiveMismatchError
from lowbitcc.backend.call_plan import CallPlan
from lowbitcc.backend.call_schedule import (
    DEVIATE,
    EXCHANGE,
    Entry,
    Place,
    Poisoned,
    takes_place,
)
from lowbitcc.backend.compressed_calls import CompressedCalls
from lowbitcc.backend.deviation import INVALID_SIGNATURE, Deviation, ExactDeviation
from lowbitcc.backend.exact import RAISED, ExactReduction, count_exact, op_type, when_done
from lowbitcc.backend.issue_queue import IssueQueue
from lowbitcc.backend.issuer import Issuer
from lowbitcc.backend.plan_run import PlanRun

Pairs = Callable[[], tuple[list[torch.Tensor], list[torch.Tensor]]]
"""``pairs()``: each tensor's output and flat source, made only when jobs are built."""
Taken = Entry | Place
"""What a tensor of a reduction got at its place (`CallSchedule.take`)."""

_STRIDED = torch.strided


def _stop_when_done(work: Any, stop: Callable[[], None], device_type: str) -> None:
    """End a timing (`CompressedCalls.clock`) of an exact call issued now (its ``work``): a
    CUDA call's at once (the clock's events are recorded on the stream), a CPU call's when its
    gloo work completes (on gloo's thread; untimed where the work has no future)."""
    if device_type != "cpu":
        stop()
    else:
        when_done(work, stop)


def _keep_canaries(issuer: Issuer, jobs: list[Any], work: Any) -> None:
    """Each of ``jobs`` that runs as its place's compressed entry off the direct schedule
    (`plan_run.PlanRun`) keeps its output's canary at the place (`Issuer.canary`: ``work``'s,
    read at the place's run after next, `Entry.keep`): there a deviation shows on some ranks
    only as NaN (`deviation.Deviation`)."""
    for job in jobs:
        if type(job) is PlanRun and job.plan.schedule != "direct":
            job.canary_entry.keep(issuer.canary(
                job.tensor if job.output is None else job.output, work))


class Reductions:
    """The reductions of one group of ``world`` ranks (see the module docstring): ``compressed``
    its compressed calls and call schedules, ``issuers`` by device type, ``queue`` its
    worker."""

    def __init__(self, world: int, compressed: CompressedCalls, issuers: dict[str, Issuer],
                 queue: IssueQueue) -> None:
        self._world, self._compressed, self._issuers, self._queue = (
            world, compressed, issuers, queue)
        self._schedules = compressed.call_schedules
        self.native = {device: frozenset(int(op) for op in issuer.native_ops)
                       for device, issuer in issuers.items()}
        """Per device type, the ops (`wire.CallDescriptor.op`) its inner backend runs itself."""
        self._policy = compressed.config.policy
        self._min_size = compressed.config.min_size

    # -- the place -------------------------------------------------------------------------
    def take(self, collective: str, tensor: torch.Tensor, numel: int, op: Any) -> Taken | None:
        """The place of a reduction of one dense ``tensor`` (``numel`` elements in all) by
        ``op`` issued now, taken (`CallSchedule.take`): its `Entry` (the steady call, `run`)
        or its `Place`; None: it takes no place (no schedule for its device, issued by a
        callback or another thread, not a dense tensor)."""
        device_type = "cpu" if tensor.is_cpu else tensor.device.type  # (no torch.device made)
        schedule = self._schedules.get(device_type)
        if (schedule is None or type(tensor) is not torch.Tensor or tensor.layout != _STRIDED
                or not takes_place(device_type)):
            return None
        kind = op_type(op)
        try:
            return schedule.take((collective, tensor.dtype, int(kind), numel, False, 0),
                                 self._wish(tensor, kind, numel))
        except BaseException:  # a renewal's, which every rank raises here
            self._take_seqs(1)
            raise

    def _wish(self, like: torch.Tensor, kind: Any, numel: int) -> str | None:
        """What the policy in force demands of a call issued now: "exact" (`lowbitcc.exact`, a
        policy "never"), "compressed" (a `lowbitcc.compressed` block around an eligible call of
        at least ``min_size`` elements: the cost model is not asked), else None (the place's
        agreement decides, the cost model's suggestion included)."""
        mode = policy.mode(self._policy)
        if mode == "never":
            return "exact"
        if mode == "always" and numel >= self._min_size and policy.eligible(like, kind):
            return "compressed"
        return None

    def _places(self, issuer: Issuer, collective: str, like: torch.Tensor, numels: list[int],
                op: Any, first: Taken | None) -> list[Taken] | None:
        """Each tensor's place (None: no call schedule, or the call takes none), ``first``
        where the caller took the first tensor's already. A deviation from an exact entry runs
        here, at once (`deviate_exact`)."""
        device_type = like.device.type
        schedule = self._schedules.get(device_type)
        if first is None and (schedule is None or not takes_place(device_type)):
            return None
        several = len(numels) > 1
        kind = op_type(op)
        taken: list[Taken] = []
        try:
            for numel in numels:
                if taken or first is None:
                    place = schedule.take((collective, like.dtype, int(kind), numel, several, 0),
                                          self._wish(like, kind, numel), wait=not taken)
                else:
                    place = first
                taken.append(place)
                if type(place) is Place and place.kind == DEVIATE and place.entry.exact:
                    self.deviate_exact(issuer, place, like.device)
        except BaseException:  # a deviation's error, or a renewal's that a place took
            for place in taken:
                if type(place) is Place:
                    place.settle()
            self._take_seqs(len(numels))
            raise
        return taken

    def _take_seqs(self, count: int) -> None:
        """A call of ``count`` tensors raised before its jobs took their call numbers: take
        them, as the other ranks' calls do (every rank raises alike), so that the ranks'
        numbers stay in step."""
        for _ in range(count):
            self._compressed.agreement.next_seq()

    # -- the steady call -------------------------------------------------------------------
    def run(self, entry: Entry, collective: str, tensor: torch.Tensor, output: torch.Tensor,
            numel: int, op: Any, native: tuple[str, tuple]) -> Any:
        """Run a reduction of one tensor as its place's ``entry``: an exact entry as the inner
        group's own call, as c10d asked for it (``native``: method and arguments; the op one
        the inner group runs itself, `Issuer.native_ops`), a compressed one by the place's
        plan. Its Work; its value ``[output]``."""
        issuer = self._issuers[tensor.device.type]
        if entry.exact:
            return self._run_exact(issuer, entry, collective, tensor, output, numel, native)
        run = self._plan_run(entry, collective, tensor, op,
                             None if collective == "all_reduce" else output)
        try:
            work = issuer.run_plan(run, native)
        except BaseException:
            if run.plan.schedule != "direct":  # (inline: the run raised, as its Work would)
                entry.keep(RAISED)
            raise
        if run.plan.schedule != "direct":
            _keep_canaries(issuer, [run], work)
        return work

    def _plan_run(self, entry: Entry, collective: str, source: torch.Tensor, op: Any,
                  output: torch.Tensor | None) -> PlanRun:
        """A run of ``entry``'s plan (made by its first run) on ``source`` (into ``output``:
        a reduce-scatter), its call number, feedback key and cost-model count taken now: in
        issue order."""
        group = self._compressed
        plan = entry.plan
        if plan is None:
            plan = entry.plan = CallPlan(group, group.route(source.device), source, collective)
        seq = group.agreement.next_seq()
        key, buffer = "", None
        if plan.comp.error_dtype is not None:  # keys name error states: a call without
            key, derived = group.key(collective, source, plan.numel)  # feedback has none
            buffer = StorageWeakRef(source.untyped_storage()) if derived else None
        else:  # counted all the same: a `feedback_key` block may also name another group's calls
            policy.explicit_key()
        timed = plan.modelled and not policy.forced()
        if timed:
            group.cost_model.count(plan.size_class)
        return PlanRun(plan, entry, source, op, output, seq, key, buffer, timed)

    def _run_exact(self, issuer: Issuer, entry: Entry, collective: str, like: torch.Tensor,
                   output: torch.Tensor, numel: int,
                   call: tuple[str, tuple] | ExactReduction) -> Any:
        """Run a call as its place's exact ``entry``: counted, started (``call``: c10d's
        method and arguments, `Issuer.native_now`, or the exact reduction,
        `Issuer.exact_now`, which counts itself in the statistics, save the cost model's choice
        of it), and (all-reduce) its output's canary kept at the place."""
        nbytes = numel * like.element_size()
        size_class = self._compressed.count_planned(collective, like, numel, entry)
        by_model = entry.by_model and size_class is not None
        native = type(call) is tuple
        if native:
            count_exact(collective, nbytes, self._world, model_exact=by_model)
        elif by_model:
            state.STATS.add("exact", model_exact=1)
        timed, entry.timed = entry.timed and size_class is not None, False
        # timed here: the issuer's own timing (one in 8 on the worker, else none) left out
        stop = self._compressed.clock(size_class, True, nbytes) if timed else None
        issued_class = None if timed else size_class
        work = (issuer.native_now(call[0], call[1], [output], issued_class, nbytes) if native
                else issuer.exact_now(call, issued_class))
        if stop is not None:
            _stop_when_done(work, stop, like.device.type)
        if collective == "all_reduce":
            entry.keep(issuer.canary(output, work))
        return issuer.planned(work, [output])

    # -- the general path ------------------------------------------------------------------
    def reduce(self, issuer: Issuer, collective: str, whole: ExactReduction,
               parts: list[ExactReduction], pairs: Pairs, opts: Any,
               first: Taken | None = None) -> Any:
        """Issue a reduction: ``whole`` exact where no rank may compress it and no descriptor
        is exchanged, or as its place's exact entry; else one job per part (each part's output
        and flat source from ``pairs()``). ``first``: the first tensor's place, where the
        caller took it."""
        like = parts[0].outputs[0]
        op = opts.reduceOp
        compress = self._compressed.wants(op_type(op), [t for p in parts for t in p.outputs])
        numels = [sum(t.numel() for t in p.inputs) for p in parts]
        if first is None and not compress and not self._compressed.agrees_on(numels):
            return issuer.exact(whole, parts)
        places = self._places(issuer, collective, like, numels, op, first)
        if places is not None and type(places[0]) is Entry and places[0].exact:
            return self._run_exact(issuer, places[0], collective, like, like, numels[0], whole)
        outputs, sources = pairs()
        several = len(parts) > 1
        jobs = [self._job(issuer, collective, out, src, op, p, compress,
                          places and places[i], several)
                for i, (out, src, p) in enumerate(zip(outputs, sources, parts))]
        work = issuer.run(jobs, parts, [*whole.outputs, *sources, *whole.inputs], outputs,
                          opts.asyncOp)
        _keep_canaries(issuer, jobs, work)
        return work

    def _job(self, issuer: Issuer, collective: str, output: torch.Tensor,
             source: torch.Tensor, op: Any, part: ExactReduction, compress: bool,
             place: Taken | None, several: bool) -> Any:
        """One tensor's job: its place's compressed entry's `PlanRun`, else its
        `compressed_call.CompressedCall` (an exchange or a deviation from a compressed entry;
        without a schedule, its own descriptor exchange)."""
        if type(place) is Entry:
            return self._plan_run(place, collective, source, op,
                                  None if collective == "all_reduce" else output)
        return self._compressed.call(collective, output, source, op, issuer.fallback(part),
                                     compress, plan=place, part=several)

    def deviate_exact(self, issuer: Issuer, place: Place, device: torch.device,
                      refused: bool = False) -> None:
        """This rank's call is not its place's exact entry (``refused``: this rank refused its
        own arguments): run `ExactDeviation`; where every rank deviated alike (and none
        refused), start the schedule again, ``place`` becoming an exchange at its first index;
        else raise `CollectiveMismatchError`, to be reported at the next exchange."""
        entry = place.entry
        assert entry is not None
        alike = ExactDeviation(entry, self._world, device,
                               lambda method, args, outputs: issuer.native_now(
                                   method, args, outputs, None, 0)).run()
        if alike and not refused:
            place.schedule.restart(place)
            return
        if not alike:
            place.schedule.deviated = True
        if entry.desc.collective == "all_reduce":  # its next run exchanges, as the others'
            entry.keep(Poisoned())
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
    def refuse_invalid_op(self, op: Any, issuer: Issuer, outputs: list[torch.Tensor],
                          collective: str = "reduce_scatter", first: Taken | None = None) -> None:
        """`refuse` if ``op`` cannot reduce ``outputs`` (`arguments.op_problem`; ``first``:
        the first tensor's place, where taken)."""
        wrong = op_problem(op, outputs)
        if wrong is not None:
            self.refuse(wrong, issuer, outputs, collective, first)

    def refuse(self, error: Exception, issuer: Issuer, outputs: list[torch.Tensor],
               collective: str = "reduce_scatter", first: Taken | None = None) -> NoReturn:
        """Raise ``error``, this rank's verdict on a reduction of ``outputs`` (one call per
        tensor), after taking part in what the valid call does: the descriptor exchange it
        would make, flagged invalid (`CompressedCalls.refused`); under the call schedule, at a
        place with an entry, the entry's call run as a deviation (so that the others raise at
        this call, or, at an exact entry, at their next exchange). ``first``: the first
        tensor's place, where the caller took it (an entry the call matched is no refusal's:
        such a call is valid)."""
        first = first if type(first) is Place else None
        world = self._world if collective == "reduce_scatter" else 1
        numels = [o.numel() * world for o in outputs]
        if first is None and not self._compressed.agrees_on(numels):
            raise error
        try:
            places = self._refusal_places(outputs[0], numels, first)
        except BaseException:  # a renewal's error, which every rank raises here
            self._take_seqs(len(numels))
            raise
        head = places[0] if places else None
        try:
            if head is not None and head.kind != EXCHANGE:
                self._deviate_refused(issuer, head, len(numels), outputs[0])
            else:
                job = self._compressed.refused(collective, error, numels, outputs[0], head)
                self._queue.submit(job).wait()  # raises error
        finally:
            for place in places or []:
                place.settle()
        raise error

    def _refusal_places(self, like: torch.Tensor, numels: list[int],
                        first: Place | None) -> list[Place] | None:
        """The places of a call this rank refused, one per tensor (None: no schedule, or the
        call takes none), ``first`` where the caller took the first tensor's: such a call
        matches no entry."""
        device_type = like.device.type
        schedule = self._schedules.get(device_type)
        if first is None and (schedule is None or not takes_place(device_type)):
            return None
        places: list[Place] = [] if first is None else [first]
        try:
            for n in numels[len(places):]:
                place = schedule.take(("refused", n), wait=not places)
                assert type(place) is Place  # no entry's key is a refused one
                places.append(place)
        except BaseException:  # a renewal's error (`CallSchedule.entry`)
            for place in places:
                place.settle()
            raise
        return places

    def _deviate_refused(self, issuer: Issuer, place: Place, count: int,
                         like: torch.Tensor) -> None:
        """Run a refused call's place's entry as a deviation (see `refuse`), taking the call
        numbers of its ``count`` tensors."""
        group = self._compressed
        seq = [group.agreement.next_seq() for _ in range(count)][0]
        if place.entry.exact:
            self.deviate_exact(issuer, place, like.device, refused=True)
            return
        deviation = Deviation(group, group.route(like.device), seq, like.device, place.entry,
                              INVALID_SIGNATURE)
        if issuer.inline:
            deviation.run()
        else:
            self._queue.submit(lambda: deviation.run() and []).wait()
