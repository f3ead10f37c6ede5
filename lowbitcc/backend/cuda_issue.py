"""`CudaIssuer`: how one "loco" group issues calls on CUDA tensors (the stream/Work plumbing).

CPU calls go through the group's worker thread (`issue_queue`). CUDA calls do not: the current
stream and device are per host thread, a worker would see neither the caller's stream (DDP's
backward stream, FSDP2's reduce-scatter stream) nor its device, and NCCL needs one issue order
on every rank. So every CUDA call is issued in the calling thread, in call order, and returns
a Work whose waiting is stream-ordered, as ProcessGroupNCCL's is (docs/gpu.md):

- exact calls go to the inner ``ProcessGroupNCCL`` with the caller's options; its Work is
  returned, or, in synchronous mode where it returns none, a Work around a completed
  CUDA-aware future (`ready_work`);
- a compressed call runs its job (encode kernels, NCCL transfers, decode kernels, all enqueued
  on one stream S) and returns a Work around a future completed on S. S is the caller's
  current stream for synchronous calls, and a side stream per device that first waits on the
  current one for ``async_op=True`` (the inputs and outputs are then marked as used on S, so the
  caching allocator keeps them until S is done). Consecutive compressed calls of the group are
  chained with an event, so their error states and NCCL transfers are ordered on the GPU
  whatever streams the callers used.

While a CUDA graph is being captured, a compressed call takes its exact path (the compressed
path reads Python-side state that a graph would freeze).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future


def ready_work(outputs: list[torch.Tensor], device: torch.device) -> dist.Work:
    """A Work whose future holds ``outputs``, completed on ``device``'s current stream: waiting
    on it makes the waiter's current stream wait for what was enqueued before (no host wait)."""
    future = torch.futures.Future(devices=[device])
    future.set_result(outputs)
    return _create_work_from_future(future)


class CudaIssuer:
    """Issues the CUDA calls of one group (see the module docstring) on ``nccl``, its inner
    ``ProcessGroupNCCL``. Used only from the threads that call the group."""

    def __init__(self, nccl: Any) -> None:
        self.nccl = nccl
        self._side: dict[torch.device, torch.cuda.Stream] = {}
        self._last: dict[torch.device, torch.cuda.Event] = {}

    def exact(self, method: str, outputs: list[torch.Tensor], *args: Any) -> dist.Work:
        """``nccl.<method>(*args)`` (the caller's options included); its Work, or `ready_work`."""
        work = getattr(self.nccl, method)(*args)
        if work is not None:
            return work
        device = _device([*outputs, *args]) or torch.device("cuda", torch.cuda.current_device())
        return ready_work(outputs, device)

    def compressed(self, job: Callable[[], Any], exact: Callable[[], Any],
                   tensors: list[torch.Tensor], outputs: list[torch.Tensor],
                   async_op: bool) -> dist.Work:
        """Run ``job`` (``exact`` while a graph is captured) on the call's stream; ``tensors``
        are every tensor the call reads or writes, ``outputs`` the Work's value."""
        device = outputs[0].device
        with torch.cuda.device(device):
            current = torch.cuda.current_stream(device)
            if torch.cuda.is_current_stream_capturing():
                exact()
                return ready_work(outputs, device)
            stream = self._side_stream(device) if async_op else current
            if stream != current:
                stream.wait_stream(current)
            last = self._last.get(device)
            if last is not None:
                stream.wait_event(last)
            with torch.cuda.stream(stream):
                job()
                done = torch.cuda.Event()
                done.record(stream)
                self._last[device] = done
                work = ready_work(outputs, device)
            if stream != current:
                for t in tensors:
                    t.record_stream(stream)
        return work

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._side.get(device)
        if stream is None:
            stream = self._side[device] = torch.cuda.Stream(device)
        return stream


def _device(items: list[Any] | tuple[Any, ...]) -> torch.device | None:
    """The device of the first tensor in ``items`` (nested lists searched), else None."""
    for item in items:
        found = item.device if isinstance(item, torch.Tensor) else (
            _device(item) if isinstance(item, list | tuple) else None)
        if found is not None:
            return found
    return None
