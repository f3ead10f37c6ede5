"""`WorkerIssuer`: the CPU reductions of a "loco" group, issued through its worker thread.

Every job is queued on the group's `issue_queue.IssueQueue` in issue order: compressed calls
run their schedules there, exact ones start on the inner gloo group and are finished by the
waiter. A reduction that runs as its place's exact entry skips the worker: it starts at once on
the group's *direct* gloo group, which carries nothing else, and its Work is gloo's own (or,
for AVG and PREMUL_SUM, a Work whose future finishes it). One such call in `EXACT_TIMED` is
timed for the cost model (`clock`); the timing callback takes the GIL on gloo's completing
thread, which costs more than the rest of the call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lowbitcc.backend.exact import PLAIN_OPS, ExactReduction, HostCanary, start_now, when_done
from lowbitcc.backend.issue_queue import IssueQueue, Job
from lowbitcc.backend.works import InnerWork, LocoWork
from lowbitcc.transports.gloo import GlooTransport

EXACT_TIMED = 8
"""One in this many exact calls issued at once is timed for the cost model."""

Clock = Callable[[Any, bool, int], Callable[[], None]]
"""``clock(size_class, exact, nbytes)`` starts timing a call on a path (`CompressedCalls.clock`);
calling the result ends it."""


class WorkerIssuer:
    """Issues CPU reductions through ``queue`` (see the module docstring); ``direct`` is the
    direct gloo group, ``clock`` times an exact call issued at once for the cost model."""

    inline = False
    native_ops = PLAIN_OPS

    def __init__(self, queue: IssueQueue, direct: dist.ProcessGroup, clock: Clock) -> None:
        self._queue = queue
        self._direct = direct
        self._retired = GlooTransport(direct)
        self._clock = clock
        self._issued = 0

    def exact(self, call: ExactReduction, parts: list[ExactReduction]) -> LocoWork:
        if call.issue is None:
            return self._queue.submit(self._queue.sequence(list(parts), call.outputs))
        return self._queue.submit(call)

    def exact_now(self, call: ExactReduction, size_class: Any) -> dist.Work:
        direct = call.on(self._direct)
        if size_class is None or not self._times_next():
            return start_now(direct, complete=self._complete)
        stop = self._clock(size_class, True, sum(t.numel() * t.element_size() for t in call.inputs))
        return start_now(direct, lambda work: self._timed(stop, work), self._complete)

    def native_now(self, method: str, args: tuple, outputs: list[torch.Tensor],
                      size_class: Any, nbytes: int) -> dist.Work:
        issue = getattr(self._direct, method)
        if size_class is None or not self._times_next():
            return issue(*args)
        stop = self._clock(size_class, True, nbytes)
        work = issue(*args)
        when_done(work, lambda: self._timed(stop, work))  # untimed where gloo's op has no future
        return work

    def _times_next(self) -> bool:
        """Whether the next exact call issued at once is one of the `EXACT_TIMED` that are
        timed."""
        self._issued += 1
        return self._issued % EXACT_TIMED == 0

    def _timed(self, stop: Callable[[], None], work: dist.Work) -> None:
        """A timed exact call's gloo ``work`` is done (on gloo's thread): end its timing."""
        stop()
        self._retired.retire(work)

    def _complete(self, inner: InnerWork) -> LocoWork:
        """The Work of a call started at once whose gloo op has no future: the worker's waiter
        finishes it, in issue order."""
        return self._queue.submit(lambda: inner)

    def planned(self, work: dist.Work, outputs: list[torch.Tensor]) -> dist.Work:
        return self._queue.follow(work, outputs)

    def canary(self, output: torch.Tensor, work: Any) -> HostCanary:
        return HostCanary(output, work)

    def fallback(self, part: ExactReduction) -> Job:
        return part

    def run(self, jobs: list[Job], parts: list[ExactReduction], tensors: list[torch.Tensor],
            outputs: list[torch.Tensor], async_op: bool) -> LocoWork:
        return self._queue.submit(self._queue.sequence(jobs, outputs))

    def run_plan(self, run: Job, native: tuple[str, tuple]) -> LocoWork:
        return self._queue.submit(run)
