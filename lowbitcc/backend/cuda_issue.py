"""`CudaIssuer`: how one "loco" group issues calls on CUDA tensors (the stream/Work plumbing).

CPU calls go through the group's worker thread (`issue_queue`). CUDA calls do not: the current
stream and device are per host thread, a worker would see neither the caller's stream (DDP's
backward stream, FSDP2's reduce-scatter stream) nor its device, and NCCL needs one issue order
on every rank. So every CUDA call is issued in the calling thread, in call order, and returns
a Work whose waiting is stream-ordered, as ProcessGroupNCCL's is (docs/gpu.md):

- exact calls go to the inner ``ProcessGroupNCCL`` with the caller's options; its Work is
  returned, or, in synchronous mode where it returns none, a `StreamWork` ordered after the
  call on the caller's stream;
- a compressed call runs its job (encode kernels, NCCL transfers, decode kernels, all enqueued
  on one stream S) and returns a `StreamWork` ordered after the job on S. S is the caller's
  current stream for synchronous calls, and a side stream per device that first waits on the
  current one for ``async_op=True`` (the inputs and outputs are then marked as used on S, so the
  caching allocator keeps them until S is done). Consecutive compressed calls of the group are
  chained with an event, so their error states and NCCL transfers are ordered on the GPU
  whatever streams the callers used.

A lock makes each call's issue (its stream choice, its job, the chaining) one step when several
threads call the group: the calls then chain in the order they took the lock. Ranks must still
issue their calls in the same order, as with NCCL.

While a CUDA graph is being captured, a compressed call takes its exact path (the compressed
path reads Python-side state that a graph would freeze).

`StreamTimings` times calls on their stream with CUDA events for the cost model, without host
waits.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from lowbitcc.backend.call_agreement import CollectiveMismatchError
from lowbitcc.backend.cuda_verdicts import DeviceCanary, keep_canaries, verdict_word
from lowbitcc.backend.exact import ExactReduction
from lowbitcc.backend.issue_queue import closing
from lowbitcc.backend.watchdog import Watchdog

WAIT_POLL_S = 0.0005
"""Seconds between two looks at the GPU in ``StreamWork.wait(timeout)``."""


def ready_work(outputs: list[torch.Tensor], device: torch.device) -> dist.Work:
    """A Work whose future holds ``outputs``, completed on ``device``'s current stream: waiting
    on it makes the waiter's current stream wait for what was enqueued before (no host wait)."""
    future = torch.futures.Future(devices=[device])
    future.set_result(outputs)
    return _create_work_from_future(future)


class StreamWork(dist.Work):
    r"""The Work of a call enqueued on ``stream`` (a compressed call's stream, or the caller's
    current one for an exact call that NCCL ran in synchronous mode), whose results are
    ``outputs``: they are ready in that stream's order. `wait` and `synchronize` make the
    waiter's current stream wait for ``event``, recorded after the call (no host wait), as
    ProcessGroupNCCL's Work does; ``wait(timeout)`` first waits on the host until the GPU has
    passed the event, at most ``timeout``; `is_completed` asks the GPU whether it has passed it
    (no wait); `get_future` makes, on first use, a CUDA-aware future completed on ``stream`` (so
    also after whatever was enqueued there since). What `ready_work` gives, without building
    the future where the caller only waits (``dist.*(async_op=False)``). The group's
    `watchdog.Watchdog` watches it (``name``: the call, for messages): where the GPU wrote
    ``verdict_word`` (pinned host memory, before the event) non-zero, or the call outlived the
    group's timeout, it `fail`\ s the Work: `exception` returns the error and `wait` raises it."""

    def __init__(self, outputs: list[torch.Tensor], stream: torch.cuda.Stream, name: str = "",
                 verdict_word: torch.Tensor | None = None) -> None:
        super().__init__()
        self._outputs = outputs
        self._stream = stream
        self.name = name or "a CUDA call"
        self._verdict_word = verdict_word
        self._error: BaseException | None = None
        self.event = torch.cuda.Event()
        self.event.record(stream)
        self._future: torch.futures.Future | None = None

    @property
    def device(self) -> torch.device:
        """Where the call runs (its stream's device)."""
        return self._stream.device

    def wait(self, timeout: Any = None) -> bool:
        seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else (timeout or 0)
        if seconds > 0:
            deadline = time.monotonic() + seconds
            while self._error is None and not self.event.query():
                if time.monotonic() > deadline:
                    raise dist.DistBackendError(
                        f"lowbitcc: Work.wait timed out after {seconds:g} s: {self.name} has "
                        "not completed on the GPU (a peer may be stalled)")
                time.sleep(WAIT_POLL_S)
        if self._error is not None:
            raise self._error
        torch.cuda.current_stream(self._stream.device).wait_event(self.event)
        return True

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            future = torch.futures.Future(devices=[self._stream.device])
            with torch.cuda.stream(self._stream):
                future.set_result(self._outputs)
            self._future = future
        return self._future

    def is_completed(self) -> bool:
        return self._error is not None or self.event.query()

    def is_success(self) -> bool:
        return self._error is None and self.event.query()

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        return self._outputs

    # -- what the watchdog asks ------------------------------------------------------------
    def done(self) -> bool:
        return self.event.query()

    def verdict(self) -> BaseException | None:
        """Once `done`: the error the GPU reported in the verdict word, if any."""
        if self._verdict_word is None or not int(self._verdict_word.item()):
            return None
        return CollectiveMismatchError(
            f"lowbitcc: {self.name} received a message that does not belong to it (another "
            "rank issued a call other than the one the ranks agreed on at its place, or a "
            "message was corrupted in transit): its outputs are NaN")

    def fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error


class CudaIssuer:
    """Issues the CUDA calls of one group (see the module docstring) on ``nccl``, its inner
    ``ProcessGroupNCCL``. Used only from the threads that call the group; one call at a time
    (``_lock``). ``watchdog``: the group's (`watchdog.Watchdog`), which watches every
    compressed call's `StreamWork` and aborts ``nccl`` when one outlives the group's timeout;
    every call first raises the error that ended the group, if one did."""

    def __init__(self, nccl: Any, watchdog: Watchdog | None = None) -> None:
        self.nccl = nccl
        self.watchdog = watchdog or Watchdog(1800.0, lambda: nccl.abort())
        self._side: dict[torch.device, torch.cuda.Stream] = {}
        self._last: dict[torch.device, torch.cuda.Event] = {}
        self._lock = threading.RLock()

    inline = True
    native_ops = frozenset(dist.ReduceOp.RedOpType.__members__.values())

    def exact(self, call: ExactReduction, parts: list[ExactReduction]) -> dist.Work:
        """`Issuer.exact`: the call as c10d asked for it, on NCCL."""
        call.count()
        method, args = call.native
        return self.native(method, call.outputs, *args)

    def exact_now(self, call: ExactReduction, size_class: Any) -> dist.Work:
        call.count()
        method, args = call.native
        return self.native(method, call.outputs, *args)

    def native_now(self, method: str, args: tuple, outputs: list[torch.Tensor],
                      size_class: Any, nbytes: int) -> dist.Work:
        return self.native(method, outputs, *args)

    def planned(self, work: dist.Work, outputs: list[torch.Tensor]) -> dist.Work:
        return work  # NCCL completes its futures when the call is enqueued

    def canary(self, output: torch.Tensor, work: dist.Work) -> DeviceCanary | None:
        """None while a graph is captured (no pinned buffer or event inside a capture: the
        place's next run reads no canary)."""
        if torch.cuda.is_current_stream_capturing():
            return None
        return DeviceCanary(output, work)

    def fallback(self, part: ExactReduction) -> Callable[[], Any]:
        """One tensor's exact call on NCCL, synchronous (enqueued on the current stream)."""
        method, args = part.native
        issue = getattr(self.nccl, method)
        single = sync_options(args[-1])

        def run() -> Any:
            part.count()
            return issue(*args[:-1], single)

        return run

    def run(self, jobs: list[Callable[[], Any]], parts: list[ExactReduction],
            tensors: list[torch.Tensor], outputs: list[torch.Tensor],
            async_op: bool) -> dist.Work:
        fallbacks = [self.fallback(p) for p in parts]

        def run_jobs() -> None:
            with closing(jobs):
                for job in jobs:
                    job()

        return self.compressed(run_jobs, lambda: [f() for f in fallbacks], tensors, outputs,
                               async_op, jobs)

    def run_plan(self, run: Any, native: tuple[str, tuple]) -> dist.Work:
        """`Issuer.run_plan`: the run on the call's stream, as a compressed job's
        (`compressed`); while a graph is captured, c10d's own call (``native``), as every
        captured compressed call runs (the compressed path reads Python-side state that a
        graph would freeze)."""
        tensor, output = run.tensor, run.output
        outputs = [tensor if output is None else output]
        method, args = native
        return self.compressed(run, lambda: getattr(self.nccl, method)(*args),
                               [tensor] + ([] if output is None else [output]), outputs,
                               args[-1].asyncOp, [run])

    def native(self, method: str, outputs: list[torch.Tensor], *args: Any) -> dist.Work:
        """``nccl.<method>(*args)`` (the caller's options included); its Work, or where it
        returned none, `synced`'s."""
        self.watchdog.check()
        work = getattr(self.nccl, method)(*args)
        return work if work is not None else self.synced(outputs, args)

    def synced(self, outputs: list[torch.Tensor], args: tuple = ()) -> dist.Work:
        """The Work of a call NCCL ran synchronously and returned none for (c10d's
        ``asyncOp`` false), whose results are ``outputs``: a `StreamWork` ordered after it on
        the current stream of its tensors' device (``outputs``', else ``args``'), or while a
        graph is captured a `ready_work`. The group's device runner asks for it too
        (`steady_runner.device_runner`)."""
        device = _device([*outputs, *args]) or torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_current_stream_capturing():
            return ready_work(outputs, device)
        return StreamWork(outputs, torch.cuda.current_stream(device))

    def compressed(self, job: Callable[[], Any], exact: Callable[[], Any] | None,
                   tensors: list[torch.Tensor], outputs: list[torch.Tensor],
                   async_op: bool, calls: list[Any] = ()) -> dist.Work:
        """Run ``job`` (``exact`` while a graph is captured; None: never issued then) on the
        call's stream; ``tensors``
        are every tensor the call reads or writes, ``outputs`` the Work's value; ``calls``:
        the compressed calls ``job`` runs (their ``verdict``, a device flag, after it ran: a
        foreign message; their ``describe()`` names them)."""
        self.watchdog.check()
        device = outputs[0].device
        with self._lock, torch.cuda.device(device):
            current = torch.cuda.current_stream(device)
            if torch.cuda.is_current_stream_capturing():  # nothing of the call left open
                with closing(calls):
                    if exact is None:
                        raise RuntimeError("lowbitcc: a call plan was run during a graph capture")
                    exact()
                return ready_work(outputs, device)
            stream = self._side_stream(device) if async_op else current
            if stream != current:
                stream.wait_stream(current)
            last = self._last.get(device)
            if last is not None:
                stream.wait_event(last)
            with torch.cuda.stream(stream), torch.no_grad():
                try:
                    job()
                except BaseException:
                    # what the call enqueued before it raised still runs: the next call is
                    # ordered after it, as after a call that returned (kept buffers)
                    failed = torch.cuda.Event()
                    failed.record(stream)
                    self._last[device] = failed
                    raise
                word = verdict_word(calls)
                keep_canaries(calls)
            name = " and ".join(c.describe() for c in calls if hasattr(c, "describe"))
            work = StreamWork(outputs, stream, name, word)
            self.watchdog.watch(work)
            self._last[device] = work.event
            if stream != current:
                for t in tensors:
                    t.record_stream(stream)
        return work

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._side.get(device)
        if stream is None:
            stream = self._side[device] = torch.cuda.Stream(device)
        return stream


def sync_options(options: Any) -> Any:
    """A copy of ``options`` (c10d's options of a reduction) with their reduction and timeout,
    synchronous (NCCL then runs the call on the current stream)."""
    out = type(options)()
    out.reduceOp = options.reduceOp
    out.timeout = options.timeout
    out.asyncOp = False
    return out


def cuda_usable() -> bool:
    """Whether this process can serve CUDA tensors: torch with CUDA and NCCL, and a GPU."""
    return dist.is_nccl_available() and torch.cuda.is_available()


class _Model(Protocol):
    def record(self, size_class: Any, exact: bool, seconds: float, nbytes: int) -> None: ...


class StreamTimings:
    """GPU times of CUDA calls for the cost model (`lowbitcc.cost_model`), read without host waits.

    `start` records a timing event on the current stream (the call's stream) before the call's
    work is enqueued there, `stop` another after it and keeps the pair with the host seconds
    the enqueueing took; `harvest` hands ``model.record`` the calls whose end the GPU has
    passed (``Event.query``, which never blocks), oldest first, and keeps the rest for a later
    call. A call's time is the larger of its GPU time (which includes its stream's waits for
    peers in NCCL) and its host time: a call whose stream was busy shows only the GPU time of
    its kernels, but the issuing thread still spent the host time on it. Used from the threads
    that issue the group's CUDA calls; ``event`` makes the events (``torch.cuda.Event``; tests
    pass a fake). With ``model``, each `start` first harvests into it, so that what is kept
    stays bounded wherever calls are timed."""

    def __init__(self, event: Callable[..., Any] | None = None,
                 model: _Model | None = None) -> None:
        self._event = event or torch.cuda.Event
        self._model = model
        self._pending: collections.deque[tuple[Any, Any, float, Any, bool, int]] = (
            collections.deque())

    def start(self) -> tuple[Any, float]:
        """Record the start event of a call on the current stream; it and the host clock."""
        if self._model is not None:
            self.harvest(self._model)
        event = self._event(enable_timing=True)
        event.record()
        return event, time.perf_counter()

    def stop(self, start: tuple[Any, float], size_class: Any, exact: bool, nbytes: int) -> None:
        """Record the end of the call begun at ``start`` (on the current stream) and keep it."""
        end = self._event(enable_timing=True)
        end.record()
        begun, host_start = start
        self._pending.append((begun, end, time.perf_counter() - host_start, size_class, exact,
                              nbytes))

    def harvest(self, model: _Model) -> None:
        """Report every finished call, oldest first, up to the first unfinished one."""
        while self._pending and self._pending[0][1].query():
            begun, end, host_s, size_class, exact, nbytes = self._pending.popleft()
            model.record(size_class, exact, max(begun.elapsed_time(end) / 1e3, host_s), nbytes)

    def __len__(self) -> int:
        return len(self._pending)


def _device(items: list[Any] | tuple[Any, ...]) -> torch.device | None:
    """The device of the first tensor in ``items`` (nested lists searched), else None."""
    for item in items:
        found = item.device if isinstance(item, torch.Tensor) else (
            _device(item) if isinstance(item, list | tuple) else None)
        if found is not None:
            return found
    return None
