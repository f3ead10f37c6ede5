"""`Watchdog`: a group's watch over its in-flight device Works, as ProcessGroupNCCL's watchdog.

A CUDA call returns before the GPU has run it, so what goes wrong there is not seen by the call
itself: a peer that never calls leaves the call's NCCL kernels waiting forever, and a message
that does not belong to the call (another rank deviated from the call schedule, or a message
was corrupted) only turns outputs into NaN. The watchdog is a daemon thread, started with the
first Work it watches, that every `POLL_S` looks at the Works in flight, oldest first, without
waiting on the GPU:

- a Work whose device work has passed (``done()``: ``Event.query``) leaves the watch; where its
  *verdict word* (pinned host memory the GPU wrote before that point) is set, the Work fails
  (``fail``: its ``exception()``, and ``wait()`` raises) with the error it names;
- a Work still in flight past the group's timeout fails with ``DistBackendError`` naming the
  call; the watchdog then calls ``abort`` (the group's inner NCCL communicator: its kernels end,
  so later Works complete with errors instead of hanging) and the group is *dead*: `check`
  raises that error at every later call.

Works are watched in issue order, and those of one group complete in that order on the GPU
(one communicator, chained events), so the oldest one in flight decides when to look again.

The thread works on the device of the first Work it watches (``torch.cuda.set_device``: its
event queries, the frees of the Works it lets go and a graph's reset make no context on
another GPU), and in the relaxed stream-capture mode (`relax_capture_mode`), so that its event
queries are legal, and invalidate nothing, while another thread captures a CUDA graph in the
default ("global") mode.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

POLL_S = 0.05
"""Seconds between two looks at the Works in flight."""

CAPTURE_MODE_RELAXED = 2
"""``cudaStreamCaptureModeRelaxed``: the calling thread is not prohibited from "potentially
unsafe" CUDA calls by another thread's capture (the CUDA runtime's ``cudaStreamCaptureMode``)."""


def relax_capture_mode() -> bool:
    """Put the calling thread in the relaxed stream-capture mode
    (``cudaThreadExchangeStreamCaptureMode``, through the CUDA runtime torch was built with):
    where another thread captures a CUDA graph in the global mode, this thread's event queries
    then neither fail nor invalidate that capture. Whether it took (False, logged, where the
    runtime or the call is missing)."""
    name = f"libcudart.so.{(torch.version.cuda or '12').split('.')[0]}"
    try:
        runtime = ctypes.CDLL(name)
        mode = ctypes.c_int(CAPTURE_MODE_RELAXED)
        status = runtime.cudaThreadExchangeStreamCaptureMode(ctypes.byref(mode))
    except (OSError, AttributeError) as exc:
        log.warning("lowbitcc: the watchdog could not relax its CUDA stream-capture mode (%s): "
                    "a CUDA graph captured in the global mode while calls are in flight may "
                    "be invalidated by its event queries", exc)
        return False
    if status != 0:
        log.warning("lowbitcc: cudaThreadExchangeStreamCaptureMode returned %d", status)
    return status == 0


def enter_device(device: torch.device | None) -> None:
    """What the watchdog thread does first: work on ``device`` (a CUDA device; None: leave
    the thread's device as it is) in the relaxed capture mode (`relax_capture_mode`)."""
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
    relax_capture_mode()


class Watched(Protocol):
    """What the watchdog needs of a Work (`cuda_issue.StreamWork`); ``device``: where its
    device work runs."""

    name: str
    device: Any

    def done(self) -> bool: ...
    def verdict(self) -> BaseException | None: ...
    def fail(self, error: BaseException) -> None: ...


class Watchdog:
    """The watch over one group's in-flight Works (see the module docstring); ``timeout_s``: the
    group's timeout; ``abort()``: what ends the group's device work (its inner communicator's
    abort); ``group``: the group's name in messages."""

    def __init__(self, timeout_s: float, abort: Callable[[], None], group: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s, self.group = timeout_s, group
        self._abort, self._clock = abort, clock
        self._lock = threading.Lock()
        self._flight: collections.deque[tuple[float, Any]] = collections.deque()
        self._thread: threading.Thread | None = None
        self.dead: BaseException | None = None
        """The error that ended the group (a Work past its timeout), raised by `check`."""

    def watch(self, work: Watched) -> None:
        """Watch ``work``, issued now."""
        with self._lock:
            self._flight.append((self._clock() + self.timeout_s, work))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run,
                                                args=(getattr(work, "device", None),),
                                                daemon=True, name=f"lowbitcc-watchdog{self.group}")
                self._thread.start()

    def check(self) -> None:
        """Raise the error that ended the group, if one did (at every call's issue)."""
        if self.dead is not None:
            raise self.dead

    def in_flight(self) -> int:
        with self._lock:
            return len(self._flight)

    def poll(self) -> None:
        """One look at the Works in flight (what the thread does every `POLL_S`)."""
        while True:
            with self._lock:
                if not self._flight:
                    return
                deadline, work = self._flight[0]
            if work.done():
                with self._lock:
                    self._flight.popleft()
                error = work.verdict()
                if error is not None:
                    log.error("lowbitcc: %s", error)
                    work.fail(error)
                continue
            if self._clock() < deadline or self.dead is not None:
                return
            self._expire(work)
            return

    def _expire(self, work: Watched) -> None:
        """``work`` is past the group's timeout: fail every Work in flight, abort, die."""
        self.dead = dist.DistBackendError(
            f"lowbitcc: {work.name} of group '{self.group}' did not complete on the GPU within "
            f"the group's timeout ({self.timeout_s:g} s): a peer may be stalled or dead; the "
            "watchdog aborted the group's communicator, and every later call of the group "
            "raises this error")
        log.error("%s", self.dead)
        with self._lock:
            stuck = [w for _, w in self._flight]
            self._flight.clear()
        for w in stuck:
            w.fail(self.dead)
        try:
            self._abort()
        except Exception:
            log.exception("lowbitcc: aborting group '%s' after a timeout failed", self.group)

    def _run(self, device: torch.device | None) -> None:
        try:
            enter_device(device)
        except Exception:
            log.exception("lowbitcc: the watchdog of group '%s' could not enter device %s",
                          self.group, device)
        while self.dead is None:
            time.sleep(POLL_S)
            try:
                self.poll()
            except Exception:
                log.exception("lowbitcc: the watchdog of group '%s' failed a look", self.group)
