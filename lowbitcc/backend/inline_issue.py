"""`InlineIssuer`: CPU reductions issued in the calling thread, as the CUDA path issues its own.

Selected by ``LOCO_ISSUER=inline``: less host time per synchronous call than the worker, which
it spares, but the caller waits for the whole call (docs/configuration.md). It runs the logic
of the CUDA path (`cuda_issue`: steady calls and compressed jobs run in call order by the
calling thread, no chunks, the descriptor exchange handed to the worker) with the C++ kernels,
so that CPU CI covers it and its host cost per call can be measured without a GPU. Exact calls and the
compressed schedules' transfers go over the group's direct gloo group (the role NCCL plays on
CUDA), which only the calling thread uses; a compressed call's Work is complete when returned
(on CUDA: ordered on the stream), and its errors raise from the call itself.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lowbitcc.backend.exact import PLAIN_OPS, ExactReduction, HostCanary, start_now
from lowbitcc.backend.issue_queue import IssueQueue, Job, closing
from lowbitcc.backend.works import InnerWork


class InlineIssuer:
    """Issues CPU reductions in the calling thread over ``direct`` (see the module docstring)."""

    inline = True
    native_ops = PLAIN_OPS

    def __init__(self, direct: dist.ProcessGroup, queue: IssueQueue) -> None:
        self._direct = direct
        self._queue = queue

    def exact(self, call: ExactReduction, parts: list[ExactReduction]) -> dist.Work:
        if call.issue is None:  # no one gloo operation: its parts, one after the other
            return self.run([p.on(self._direct) for p in parts], parts, [], call.outputs, False)
        return start_now(call.on(self._direct))

    def exact_now(self, call: ExactReduction, size_class: Any) -> dist.Work:
        return start_now(call.on(self._direct))

    def native_now(self, method: str, args: tuple, outputs: list[torch.Tensor],
                      size_class: Any, nbytes: int) -> dist.Work:
        return getattr(self._direct, method)(*args)

    def planned(self, work: dist.Work, outputs: list[torch.Tensor]) -> dist.Work:
        return self._queue.follow(work, outputs)

    def canary(self, output: torch.Tensor, work: Any) -> HostCanary:
        return HostCanary(output, work)

    def fallback(self, part: ExactReduction) -> Job:
        return part.on(self._direct)

    def run(self, jobs: list[Job], parts: list[ExactReduction], tensors: list[torch.Tensor],
            outputs: list[torch.Tensor], async_op: bool) -> dist.Work:
        with torch.no_grad(), closing(jobs):  # outputs written in place, as the worker's jobs
            for job in jobs:
                result = job()
                if isinstance(result, InnerWork):
                    result.work.wait()
                    result.finish()
        return self._queue.completed(outputs)

    def run_plan(self, run: Any, native: tuple[str, tuple]) -> dist.Work:
        if run.tensor.requires_grad or (run.output is not None and run.output.requires_grad):
            with torch.no_grad():  # written in place, as by `run`'s jobs
                return self._queue.completed(run())
        return self._queue.completed(run())
