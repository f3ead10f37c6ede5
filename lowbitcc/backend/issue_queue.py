"""Issue order: one worker thread per group runs every call in the order it was issued.

Every call of a "loco" group, sync or async, becomes a job queued to the group's worker thread,
which runs the jobs one at a time in issue order: it issues the inner gloo operations and runs
compressed schedules, so every rank issues the same inner operations in the same order. A job
returns the call's outputs, or an `InnerWork` (inner gloo work in flight plus how to finish the
call), which the waiter thread completes in issue order. Gloo progresses its operations on its
own threads, so waiting in order only orders completion notices, never the operations: a send
and a recv posted in either order cannot deadlock.

Each call returns a `works.LocoWork` (the Works and futures: `lowbitcc.backend.works`).

A second thread issues on the same inner gloo group: the group's issue lane (``lane``, the C++
``IssueLane``, ``backend/csrc/issue_lane.h``), on which the steady runner queues the plan cores'
whole runs (the tree's, the ring's, the hierarchical schedule's, an all-reduce's two phases on
more ranks) so that their calls return at once. The worker waits until the lane is idle before
each job it runs, so the jobs' inner operations are issued after the lane's runs queued before
them, on every rank alike. ``lane`` is None where the C++ module cannot be built (no plan core
runs then). The lane is closed by `shutdown`, and at the process's exit (before the interpreter
finalizes), each time waiting up to the group's timeout for the runs queued on it.

Jobs and finishes run without autograd (grad mode is per thread: the worker and waiter, this
module's threads, turn it off once when they start): a collective writes its outputs in place, as
gloo's C++ does, also into a parameter that requires grad. Futures with Python callbacks are
completed on a third kind of thread, a pool of completers, never by the worker or the waiter
(futures whose only callbacks are C++ ones, DDP's reducer's, are completed where they are
done): a future's callbacks (``.then()``) run where it is completed, and a callback may issue
a collective and wait for it (torch's PowerSGD hook does), which needs the worker and the
waiter free. The pool starts one completer and adds one whenever all are busy (completing a
future, or blocked in a callback), up to `COMPLETERS`; so callbacks of different calls may run
at once, as on gloo.
"""

from __future__ import annotations

import atexit
import itertools
import queue
import threading
import weakref
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from lowbitcc.backend import native
from lowbitcc.backend.works import (
    DoneWork,
    FollowedWork,
    InnerWork,
    LocoFuture,
    LocoWork,
    native_followed,
)

Job = Callable[[], Any]
"""A call's work on the worker: returns the output tensors or an `InnerWork`."""

COMPLETERS = 64
"""Most completer threads of one group: as many callbacks may block in a wait at once."""


class closing:  # noqa: N801 (used as a context manager, like contextlib.closing)
    """Around running a call's ``jobs`` in order: whatever happens, ``close()`` each job that
    has one (`compressed_call.CompressedCall.close`, idempotent), so that jobs left unrun after
    an earlier one raised still settle their call-schedule places."""

    def __init__(self, jobs: list[Job]) -> None:
        self.jobs = jobs

    def __enter__(self) -> list[Job]:
        return self.jobs

    def __exit__(self, *exc: object) -> None:
        for job in self.jobs:
            close = getattr(job, "close", None)
            if close is not None:
                close()


class _AllOf:
    """The inner works of a sequence, waited in order (each retired)."""

    def __init__(self, inners: list[InnerWork], retire: Callable[[Any], None]) -> None:
        self.inners, self.retire = inners, retire

    def wait(self) -> None:
        for inner in self.inners:
            inner.work.wait()
            self.retire(inner.work)


_GLOO_WORK = dist.Work
"""The type of an inner gloo call's Work as Python sees it (c10d's own, not a Python subclass)."""


def _nothing() -> None:
    """`IssueQueue.wait_idle`'s job."""


class IssueQueue:
    """The worker and waiter threads of one group (see the module docstring).

    ``retire(work)`` is called on every finished inner gloo Work (see `GlooTransport.retire`).
    `name_group` sets the group's part of the futures' tags, once c10d has named the group.
    """

    def __init__(self, name: str, retire: Callable[[Any], None],
                 timeout_s: float = dist.default_pg_timeout.total_seconds()) -> None:
        self._retire = retire
        self._native = native_followed()
        """`works.native_followed`: the C++ Work of calls the calling thread starts (`follow`)."""
        self._group_tag = 0
        self._issued = itertools.count(1)
        self._lock = threading.Lock()
        self._closed = False
        self._pending = 0
        """Jobs submitted and not yet run to their end by the worker (under ``_lock``): the
        steady runner's compressed call waits until none is (`wait_idle`): the worker's calls
        on the same gloo group go first (`steady_runner`)."""
        module = native.load()
        self.lane = None if module is None else module.IssueLane()
        """The group's issue lane (see the module docstring), or None."""
        if self.lane is not None:
            atexit.register(_close_at_exit, weakref.ref(self.lane), timeout_s)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._in_flight: queue.SimpleQueue = queue.SimpleQueue()
        self._completers = ThreadPoolExecutor(COMPLETERS, thread_name_prefix=f"{name}-completer")
        self._worker = threading.Thread(target=self._run_jobs, name=f"{name}-worker", daemon=True)
        self._waiter = threading.Thread(target=self._complete_in_order, name=f"{name}-waiter",
                                        daemon=True)
        self._worker.start()
        self._waiter.start()

    def name_group(self, group_name: str) -> None:
        """The futures' tags take the group's name (the same on every rank) in their high 32
        bits: the CRC-32 of ``group_name``."""
        self._group_tag = zlib.crc32(group_name.encode()) << 32

    def submit(self, job: Job, source_rank: Callable[[], int] | None = None) -> LocoWork:
        """Queue ``job`` (run on the worker, in issue order) and return its Work
        (``source_rank``: see `LocoWork`)."""
        future = self._tagged()
        # The Work (and its done callback) first: once queued, the worker takes the GIL for
        # the job, and the caller would wait for it to come back (0.1 ms a call, measured).
        work = LocoWork(future, source_rank)
        with self._lock:
            if self._closed:
                raise RuntimeError("lowbitcc: this process group has been shut down")
            self._pending += 1
            self._jobs.put((job, future))
        return work

    def completed(self, outputs: list[torch.Tensor]) -> DoneWork:
        """The Work of a call the calling thread has run itself (`inline_issue`): complete with
        ``outputs``, and tagged as `submit` tags its calls, so the calls its callbacks issue
        name it (`callback_parent`)."""
        return DoneWork(self._next_tag(), outputs)

    def follow(self, work: Any, outputs: list[torch.Tensor]) -> dist.Work:
        """The Work of a gloo ``work`` the calling thread started itself (a place's exact entry,
        `reductions`), with ``outputs``: tagged as `submit` tags its calls; the future a Python
        caller asks for is completed by the waiter, in order, once ``work`` is done. Not gloo's
        own Work: a Python callback added to gloo's future runs on gloo's thread, or in the
        caller's if the call already completed, and a call it issues must not look like the
        calling thread's (`reductions`). Where the C++ Works are built it is their
        ``FollowedWork`` (`works.native_followed`), whose future for c10d's C++ callers (DDP's
        reducer) completes on gloo's thread without Python; else `works.FollowedWork`."""
        native = self._native
        if native is None or type(work) is not _GLOO_WORK:  # a Python Work: AVG's division
            return FollowedWork(self, self._next_tag(), work, outputs)
        followed = native(work, outputs, self._next_tag())
        followed.queue = self
        return followed

    def complete_later(self, inner: InnerWork, future: torch.futures.Future) -> None:
        """Complete ``future`` with ``inner``'s outputs once its work is done (the waiter, in
        order with the worker's calls)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("lowbitcc: this process group has been shut down")
            self._in_flight.put((inner, future))

    def _tagged(self) -> LocoFuture:
        """The future of the next call (`_next_tag`)."""
        return LocoFuture(self._next_tag())

    def _next_tag(self) -> int:
        """The next call's tag: the group's and the call's ordinal, the same call having the
        same tag on every rank."""
        return self._group_tag | next(self._issued) & 0xFFFFFFFF  # next() holds the GIL throughout

    def complete(self, inner: InnerWork) -> list[torch.Tensor]:
        """Wait for ``inner``'s gloo work, retire it, and finish the call (on the waiter: without
        autograd)."""
        inner.work.wait()
        self._retire(inner.work)
        return inner.finish()

    def sequence(self, jobs: list[Job], outputs: list[torch.Tensor]) -> Job:
        """One job running ``jobs`` in order. Inner work they leave in flight (exact fallbacks)
        is completed by the waiter, as a plain exact call's is, so the worker goes on to the
        next call meanwhile (completing it here serialised DDP's buckets behind each other)."""

        def run_all() -> list[torch.Tensor] | InnerWork:
            with closing(jobs):
                started = [r for r in (job() for job in jobs) if isinstance(r, InnerWork)]
            if not started:
                return outputs

            def finish() -> list[torch.Tensor]:
                for inner in started:
                    inner.finish()
                return outputs

            return InnerWork(_AllOf(started, self._retire), finish)

        return run_all

    def shutdown(self, timeout_s: float) -> bool:
        """Stop accepting calls, let the queued ones finish (each thread waited for at most
        ``timeout_s``); False if it was already shut down. True also where a thread outlived
        its wait (a transfer a peer never answers): the group then shuts its inner groups down
        under it, which is what ends such a transfer where the inner group's shutdown aborts its
        work (NCCL's; gloo's does nothing in torch 2.13, and its transfer ends at its own
        timeout)."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            self._jobs.put(None)
        self._worker.join(timeout=timeout_s)
        if self.lane is not None:  # (its runs queued before the worker's last job have run)
            self.lane.shut_down()
            self.lane.close(timeout_s)
        self._waiter.join(timeout=timeout_s)
        self._completers.shutdown(wait=False)
        return True

    def _settle(self, future: torch.futures.Future, result: Any = None,
                error: BaseException | None = None) -> None:
        """Complete ``future``: here where only C++ callbacks wait on it, else on a completer
        thread (its Python callbacks run there)."""
        if isinstance(future, LocoFuture) and future.complete_unless_called_back(result, error):
            return
        if error is not None:
            self._completers.submit(future.set_exception, error)
        else:
            self._completers.submit(future.set_result, result)

    def _run_jobs(self) -> None:
        torch.set_grad_enabled(False)  # this thread's own mode: every job without autograd
        lane_idle = (lambda: None) if self.lane is None else self.lane.wait_idle
        while True:
            item = self._jobs.get()
            if item is None:
                self._in_flight.put(None)
                return
            job, future = item
            error: BaseException | None = None
            lane_idle()  # the lane's runs queued before it go first (see the module docstring)
            try:
                result = job()
            except BaseException as exc:  # noqa: BLE001 (delivered to the caller's wait())
                error = exc
            with self._lock:  # (inline: no Python frame per job)
                self._pending -= 1
            if error is not None:
                self._settle(future, error=error)
            elif isinstance(result, InnerWork):
                self._in_flight.put((result, future))
            else:
                self._settle(future, result)

    def wait_idle(self) -> None:
        """Wait until the worker has run every job submitted so far to its end (each ends once
        its transfers do, each within the group's timeout): a job that does nothing, queued
        behind them without a tag (it is no call), waited for without the GIL."""
        done = torch.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("lowbitcc: this process group has been shut down")
            self._pending += 1
            self._jobs.put((_nothing, done))
        done.wait()

    def _complete_in_order(self) -> None:
        torch.set_grad_enabled(False)  # this thread's own mode: every finish without autograd
        while True:
            item = self._in_flight.get()
            if item is None:
                return
            inner, future = item
            try:
                self._settle(future, self.complete(inner))
            except BaseException as exc:  # noqa: BLE001
                self._settle(future, error=exc)


def _close_at_exit(lane: weakref.ref, timeout_s: float) -> None:
    """At the process's exit: close the issue ``lane`` if it is still there, its queued runs
    waited for up to ``timeout_s`` seconds, so that none is left to run while the interpreter
    finalizes."""
    kept = lane()
    if kept is not None:
        kept.close(timeout_s)
