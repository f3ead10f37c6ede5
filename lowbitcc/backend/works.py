"""The Works and futures a "loco" group returns for calls on CPU tensors.

Each call returns a `LocoWork` (its job queued on the group's worker, `issue_queue`), a
`FollowedWork` (a gloo call the calling thread started itself: a place's exact entry,
`reductions`) or a `DoneWork` (a call the calling thread ran to its end, `inline_issue`): its
future's value is the list of output tensors (DDP's reducer reads it);
``wait()`` re-raises any error of the call, and ``wait(timeout)`` raises
`torch.distributed.DistBackendError` when the call has not completed in time, as gloo does.
`InnerWork` is an inner gloo operation in flight and how to finish the call.

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
import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lowbitcc.backend import deviated_output, native
from lowbitcc.backend.eager import eager_methods


@dataclasses.dataclass
class InnerWork:
    """An inner gloo operation in flight, and how to finish the call once it has completed."""

    work: Any
    finish: Callable[[], list[torch.Tensor]]



class _CallbackContext(threading.local):
    """Per thread: the tag of the call whose future's callback the thread runs (0: none; a
    class default, read several times faster than ``getattr`` with a default)."""

    parent = 0


_context = _CallbackContext()


def callback_parent() -> int:
    """The tag of the call whose future's callback this thread is running (0: none)."""
    return _context.parent


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
    with ``then``, run with the tag as their `callback_parent`.

    `complete_unless_called_back` completes it where it is, unless a Python callback was added
    (``then``, ``add_done_callback``): C++ callbacks (DDP's reducer, ``wait_all``) never block,
    but a Python one may issue a call and wait for it, so those futures are completed on a
    completer thread instead (`IssueQueue`)."""

    def __init__(self, tag: int) -> None:
        super().__init__()
        self.tag = tag
        self._lock = threading.Lock()
        self._called_back = False

    def then(self, callback: Callable[[Any], Any]) -> LocoFuture:  # type: ignore[override]
        self._mark_called_back()
        child = super().then(_within(self.tag, callback))
        chained = LocoFuture(self.tag)
        child.add_done_callback(lambda done: _forward(done, chained))
        return chained

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        self._mark_called_back()
        super().add_done_callback(_within(self.tag, callback))

    def on_done(self, callback: Callable[[Any], None]) -> None:
        """Add ``callback``, which never blocks, without moving the completion elsewhere."""
        super().add_done_callback(callback)

    def _mark_called_back(self) -> None:
        with self._lock:  # waits for a completion in progress: the callback then runs here
            self._called_back = True

    def complete_unless_called_back(self, result: Any = None,
                                    error: BaseException | None = None) -> bool:
        """Complete the future now, in this thread, where no Python callback was added (True);
        else do nothing (False)."""
        with self._lock:
            if self._called_back:
                return False
            if error is not None:
                self.set_exception(error)
            else:
                self.set_result(result)
            return True


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

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Block until the call completed and re-raise its error. A positive ``timeout`` bounds
        the wait (c10d's default, zero, means no bound)."""
        seconds = 0.0 if timeout is None else timeout.total_seconds()
        future = self._future
        if seconds > 0 and not future.done():
            done = threading.Event()  # set by the completion (at once where it came meanwhile)
            add = future.on_done if isinstance(future, LocoFuture) else future.add_done_callback
            add(lambda _: done.set())
            if not done.wait(seconds):
                raise dist.DistBackendError(
                    f"lowbitcc: Work.wait timed out after {seconds:g} s (the call is still queued "
                    "or in flight; a peer may be stalled)"
                )
        future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

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
    """The Work of a gloo ``work`` that the calling thread started itself (`IssueQueue.follow`:
    a place's exact entry) and that writes ``outputs``: waiting (and ``is_completed``,
    ``exception``) is gloo's own, without a thread hop, but for an output that a deviating
    peer left NaN (`deviated_output`), for which ``wait`` and the future raise
    `CollectiveMismatchError`. Its future is made on first use (DDP asks for it; a synchronous
    ``dist.all_reduce`` does not), tagged ``tag``, and ``queue``'s waiter completes it once
    the work is done; it runs the callbacks added to it."""

    def __init__(self, queue: Any, tag: int, work: Any,
                 outputs: list[torch.Tensor]) -> None:
        dist.Work.__init__(self)
        self._source, self._work, self._outputs = None, work, outputs
        self._queue, self._tag = queue, tag
        self._future: LocoFuture | None = None

    @property
    def inner(self) -> Any:
        """The inner gloo Work it follows (as the C++ ``FollowedWork``'s ``inner``)."""
        return self._work

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            self._future = completed_later(self._queue, self._tag, self._work, self._outputs)
        return self._future

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if timeout is not None and timeout.total_seconds() > 0:
            done = self._work.wait(timeout)
        else:
            done = self._work.wait()
        deviated_output.checked(self._outputs)
        return done

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def exception(self) -> BaseException | None:
        if not self._work.is_completed():
            return None
        try:
            self.wait()
        except Exception as exc:  # noqa: BLE001 (the call's error, returned to the caller)
            return exc
        return None


@eager_methods
class DoneWork(LocoWork):
    """The Work of a call the calling thread has run to its end itself (`IssueQueue.completed`:
    the inline issuer's calls, whose errors raise from the call): complete, with ``outputs``.
    Its future, tagged ``tag``, is made (complete) on first use: DDP asks for it, a synchronous
    ``dist.all_reduce`` does not."""

    _source = None
    _future: LocoFuture | None = None  # made by `get_future`

    def __init__(self, tag: int, outputs: list[torch.Tensor]) -> None:
        dist.Work.__init__(self)
        self._outputs, self._tag = outputs, tag

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            self._future = LocoFuture(self._tag)
            self._future.set_result(self._outputs)
        return self._future

    def result(self) -> list[torch.Tensor]:
        return self._outputs

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def exception(self) -> BaseException | None:
        return None


def completed_later(queue: Any, tag: int, work: Any, outputs: list[torch.Tensor],
                    checked: bool = True) -> LocoFuture:
    """The future a Python caller gets of a gloo ``work`` the calling thread started itself (a
    place's exact entry): a `LocoFuture` tagged ``tag``, which ``queue``'s waiter completes with
    ``outputs``, in order, once ``work`` is done (`IssueQueue.complete_later`), or where
    ``checked`` with the error of an output a deviating peer left NaN
    (`deviated_output.checked`)."""
    future = LocoFuture(tag)
    finish = functools.partial(deviated_output.checked, outputs) if checked else lambda: outputs
    queue.complete_later(InnerWork(work, finish), future)
    return future


@functools.cache
def native_followed() -> type | None:
    """`FollowedWork` in C++ (`native`: waiting, errors and the future c10d's C++ callers ask
    for, completed on gloo's thread without Python; a deviated output's error,
    `deviated_output`, raised as `CollectiveMismatchError`), as a Python class whose ``get_future``
    serves Python callers as `FollowedWork`'s does (a `LocoFuture` tagged with the call,
    completed by the queue's waiter, its callbacks run with the tag); its ``queue`` is set by
    `IssueQueue.follow`. None where the C++ Works cannot be built."""
    module = native.load()
    if module is None:
        return None
    module.set_deviation(deviated_output.PROBE, deviated_output.MESSAGE,
                         deviated_output.CollectiveMismatchError)

    @eager_methods
    class NativeFollowedWork(module.FollowedWork):
        __doc__ = native_followed.__doc__

        def get_future(self) -> torch.futures.Future:
            future = self.__dict__.get("_future")
            if future is None:
                # (the waiter waits on this Work: a point-to-point call's inner Work is waited
                # for once, followed_work.h)
                future = self._future = completed_later(self.queue, self.tag, self,
                                                        self.outputs, self.checked)
            return future

    return NativeFollowedWork
