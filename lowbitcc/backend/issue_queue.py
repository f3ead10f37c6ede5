"""Issue order: one worker thread per group runs every call in the order it was issued.

Every call of a "loco" group, sync or async, becomes a job queued to the group's worker thread,
which runs the jobs one at a time in issue order: it issues the inner gloo operations and runs
compressed schedules, so every rank issues the same inner operations in the same order. A job
returns the call's outputs, or an `InnerWork` (inner gloo work in flight plus how to finish the
call), which the waiter thread completes in issue order. Gloo progresses its operations on its
own threads, so waiting in order only orders completion notices, never the operations: a send
and a recv posted in either order cannot deadlock.

Each call returns a `LocoWork`: its future's value is the list of output tensors (DDP's reducer
reads it); ``wait()`` re-raises any error of the call, and ``wait(timeout)`` raises
`torch.distributed.DistBackendError` when the call has not completed in time, as gloo does.

Jobs and finishes run without autograd (``torch.no_grad()``; the worker and waiter are this
module's threads, whose grad mode is their own): a collective writes its outputs in place, as
gloo's C++ does, also into a parameter that requires grad. Futures are completed on a third
kind of thread, a pool of completers, never by the worker or the waiter: a future's callbacks
(``.then()``) run where it is completed, and a callback may issue a collective and wait for it
(torch's PowerSGD hook does), which needs the worker and the waiter free. The pool starts one
completer and adds one whenever all are busy (completing a future, or blocked in a
callback), up to `COMPLETERS`; so callbacks of different calls may run at once, as on gloo.

A call's future is a `LocoFuture` tagged with the call (group and issue ordinal): a callback
added with ``then`` or ``add_done_callback`` (and the callbacks chained after it) runs with that
tag as its context, wherever it runs (inline, if the future was already complete, or on a
completer), and the calls it issues name it as their parent (`callback_parent`) in their
descriptors. Callbacks of two calls that run at once may issue their calls in either order, and
in different orders on different ranks (torch's PowerSGD hook with several buckets does): the
descriptors then differ in their parents and every rank raises `CollectiveMismatchError`,
instead of reducing one bucket's tensor with another's.
"""

from __future__ import annotations

import dataclasses
import datetime
import queue
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from lowbitcc.backend.eager import eager_methods

Job = Callable[[], Any]
"""A call's work on the worker: returns the output tensors or an `InnerWork`."""

COMPLETERS = 64
"""Most completer threads of one group: as many callbacks may block in a wait at once."""


@dataclasses.dataclass
class InnerWork:
    """An inner gloo operation in flight, and how to finish the call once it has completed."""

    work: Any
    finish: Callable[[], list[torch.Tensor]]


class closing:  # noqa: N801 (used as a context manager, like contextlib.closing)
    """Around running a call's ``jobs`` in order: whatever happens, ``close()`` each job that
    has one (`compressed_call.CompressedCall.close`, idempotent), so that jobs left unrun after
    an earlier one raised still settle their lease tickets and call-schedule places."""

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


_context = threading.local()


def callback_parent() -> int:
    """The tag of the call whose future's callback this thread is running (0: none)."""
    return getattr(_context, "parent", 0)


def _within(tag: int, callback: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``callback``, run with ``tag`` as this thread's `callback_parent`."""

    def run(future: Any) -> Any:
        outer = callback_parent()
        _context.parent = tag
        try:
            return callback(future)
        finally:
            _context.parent = outer

    return run


class LocoFuture(torch.futures.Future):
    """The future of a call tagged ``tag``: its callbacks, and the callbacks chained after them
    with ``then``, run with the tag as their `callback_parent`."""

    def __init__(self, tag: int) -> None:
        super().__init__()
        self.tag = tag

    def then(self, callback: Callable[[Any], Any]) -> LocoFuture:  # type: ignore[override]
        child = super().then(_within(self.tag, callback))
        chained = LocoFuture(self.tag)
        child.add_done_callback(lambda done: _forward(done, chained))
        return chained

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        super().add_done_callback(_within(self.tag, callback))


def _forward(done: torch.futures.Future, to: torch.futures.Future) -> None:
    """Complete ``to`` as ``done`` completed."""
    try:
        value = done.value()
    except Exception as exc:  # noqa: BLE001 (handed on to the chained future)
        to.set_exception(exc)
        return
    to.set_result(value)


@eager_methods
class LocoWork(dist.Work):
    """A queued call; its future's value is the list of output tensors."""

    def __init__(self, future: torch.futures.Future,
                 source_rank: Callable[[], int] | None = None) -> None:
        """``source_rank`` (receives only) names the sender once the call has completed."""
        super().__init__()
        self._future = future
        self._source = source_rank
        self._done = threading.Event()
        future.add_done_callback(lambda _: self._done.set())

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Block until the call completed and re-raise its error. A positive ``timeout`` bounds
        the wait (c10d's default, zero, means no bound)."""
        seconds = 0.0 if timeout is None else timeout.total_seconds()
        if seconds > 0 and not self._done.wait(seconds):
            raise dist.DistBackendError(
                f"lowbitcc: Work.wait timed out after {seconds:g} s (the call is still queued or "
                "in flight; a peer may be stalled)"
            )
        self._future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and self.exception() is None

    def exception(self) -> BaseException | None:
        if not self._future.done():
            return None
        try:
            self._future.value()
        except Exception as exc:  # noqa: BLE001 (the call's error, returned to the caller)
            return exc
        return None

    def result(self) -> list[torch.Tensor]:
        return self._future.wait()

    def _source_rank(self) -> int:
        """The sender's rank of a completed receive (``dist.recv`` without ``src`` reads it)."""
        if self._source is None:
            raise ValueError("lowbitcc: sourceRank() may only be called on work objects that "
                             "correspond to a recv or recv-from-any call")
        self._future.wait()
        return self._source()


@eager_methods
class FollowedWork(LocoWork):
    """The Work of a gloo ``work`` that the calling thread started itself (`IssueQueue.follow`)
    and that writes ``outputs``: waiting (and ``is_completed``, ``exception``) is gloo's own,
    without a thread hop. Its future is made on first use (DDP asks for it; a synchronous
    ``dist.all_reduce`` does not), tagged ``tag``, and ``queue``'s waiter completes it once
    the work is done; it runs the callbacks added to it."""

    def __init__(self, queue: IssueQueue, tag: int, work: Any,
                 outputs: list[torch.Tensor]) -> None:
        dist.Work.__init__(self)
        self._source, self._work, self._outputs = None, work, outputs
        self._queue, self._tag = queue, tag
        self._future: LocoFuture | None = None

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            self._future = LocoFuture(self._tag)
            self._queue.complete_later(InnerWork(self._work, lambda: self._outputs),
                                       self._future)
        return self._future

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if timeout is not None and timeout.total_seconds() > 0:
            return self._work.wait(timeout)
        return self._work.wait()

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_completed() and self.exception() is None

    def exception(self) -> BaseException | None:
        if not self._work.is_completed():
            return None
        try:
            self._work.wait()
        except Exception as exc:  # noqa: BLE001 (the call's error, returned to the caller)
            return exc
        return None


class IssueQueue:
    """The worker and waiter threads of one group (see the module docstring).

    ``retire(work)`` is called on every finished inner gloo Work (see `GlooTransport.retire`).
    `name_group` sets the group's part of the futures' tags, once c10d has named the group.
    """

    def __init__(self, name: str, retire: Callable[[Any], None]) -> None:
        self._retire = retire
        self._group_tag = 0
        self._issued = 0
        self._lock = threading.Lock()
        self._closed = False
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
            self._jobs.put((job, future))
        return work

    def completed(self, outputs: list[torch.Tensor]) -> LocoWork:
        """The Work of a call the calling thread has run itself (`inline_issue`): complete with
        ``outputs``, and tagged as `submit` tags its calls, so the calls its callbacks issue
        name it (`callback_parent`)."""
        future = self._tagged()
        future.set_result(outputs)
        return LocoWork(future)

    def follow(self, work: Any, outputs: list[torch.Tensor]) -> LocoWork:
        """The Work of a gloo ``work`` the calling thread started itself (a place's exact entry,
        `reductions`): tagged as `submit` tags its calls, and completed by the waiter, in order,
        once ``work`` is done, with ``outputs``. Not gloo's own Work: a callback added to
        gloo's future runs on gloo's thread, or in the caller's if the call already completed,
        and a call it issues must not look like the calling thread's (`call_places`)."""
        return FollowedWork(self, self._next_tag(), work, outputs)

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
        with self._lock:
            self._issued += 1
            ordinal = self._issued
        return self._group_tag | ordinal & 0xFFFFFFFF

    def complete(self, inner: InnerWork) -> list[torch.Tensor]:
        """Wait for ``inner``'s gloo work, retire it, and finish the call (without autograd)."""
        inner.work.wait()
        self._retire(inner.work)
        with torch.no_grad():
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
        """Stop accepting calls, let the queued ones finish; False if it was already shut down."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            self._jobs.put(None)
        self._worker.join(timeout=timeout_s)
        self._waiter.join(timeout=timeout_s)
        self._completers.shutdown(wait=False)
        return True

    def _settle(self, future: torch.futures.Future, result: Any = None,
                error: BaseException | None = None) -> None:
        """Complete ``future`` on a completer thread (its callbacks run there)."""
        if error is not None:
            self._completers.submit(future.set_exception, error)
        else:
            self._completers.submit(future.set_result, result)

    def _run_jobs(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                self._in_flight.put(None)
                return
            job, future = item
            try:
                with torch.no_grad():
                    result = job()
            except BaseException as exc:  # noqa: BLE001 (delivered to the caller's wait())
                self._settle(future, error=exc)
                continue
            if isinstance(result, InnerWork):
                self._in_flight.put((result, future))
            else:
                self._settle(future, result)

    def _complete_in_order(self) -> None:
        while True:
            item = self._in_flight.get()
            if item is None:
                return
            inner, future = item
            try:
                self._settle(future, self.complete(inner))
            except BaseException as exc:  # noqa: BLE001
                self._settle(future, error=exc)
