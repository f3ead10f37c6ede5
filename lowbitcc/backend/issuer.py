"""`Issuer`: how one "loco" group issues the reductions of one device type, chosen once.

The process group writes each c10d reduction once (`process_group`): it checks the call, asks
the policy, builds the call's exact form (`exact.ExactReduction`: as gloo runs it, and as c10d
asked for it, ``native``) and its compressed jobs (`compressed_call.CompressedCall`), and hands
them to the issuer of the tensors' device. The issuers are the device-specific layer, and
neither imports the other:

- `worker_issue.WorkerIssuer` (CPU tensors, ``LOCO_ISSUER=auto``): the group's worker thread
  runs the jobs in issue order (`issue_queue`), exact calls on the inner gloo group, calls
  that run as their place's exact entry at once on the direct gloo group;
- `inline_issue.InlineIssuer` (CPU tensors under ``LOCO_ISSUER=inline``): every reduction
  issued in the calling thread, in call order, as the CUDA path issues them, over the direct
  gloo group (the descriptor exchange still goes to the worker, which owns the inner gloo
  group): the least host time per synchronous call, and the CUDA path's logic in CPU CI;
- `cuda_issue.CudaIssuer` (CUDA tensors): the calling thread, streams and NCCL.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist

from lowbitcc.backend.exact import ExactReduction
from lowbitcc.backend.issue_queue import Job


class Issuer(Protocol):
    """What the process group needs of a device's issuing (see the module docstring).

    ``inline``: compressed jobs run in the calling thread (no chunks, no calls carried in the
    descriptor frames, calls under ``min_size`` exact without an exchange, a refused call
    raised without one)."""

    inline: bool
    native_ops: frozenset
    """The reduction ops (``RedOpType``) the inner backend runs itself (gloo: not AVG or
    PREMUL_SUM)."""

    def exact(self, call: ExactReduction, parts: list[ExactReduction]) -> dist.Work:
        """Issue ``call`` now with the caller's options, without an exchange (``parts``: the
        same call a tensor at a time, for where the inner backend has no one operation)."""
        ...

    def exact_now(self, call: ExactReduction, size_class: Any) -> dist.Work:
        """Issue ``call``, which runs as its place's exact entry, in the calling thread now
        (``size_class``: the cost model's, timed for it now and then; None: not timed)."""
        ...

    def native_now(self, method: str, args: tuple, outputs: list[torch.Tensor],
                      size_class: Any, nbytes: int) -> dist.Work:
        """Issue ``inner.<method>(*args)``, a reduction of one tensor by one of the inner
        backend's own ops exactly as c10d asked for it (the caller's options included), which
        runs as its place's exact entry (``size_class``: the cost model's, timed for it now and
        then; ``nbytes`` input bytes), in the calling thread now; ``outputs``: what it writes.
        The caller has counted it.
        ``size_class`` None: not timed for the cost model (a place's deviation)."""
        ...

    def planned(self, work: dist.Work, outputs: list[torch.Tensor]) -> dist.Work:
        """The Work to return for ``work``, a place's exact entry's call issued now that writes
        ``outputs``: where the inner backend completes futures on its own threads (gloo), one
        whose callbacks are tagged as the group's other Works' (`issue_queue.IssueQueue.follow`);
        else ``work``."""
        ...

    def canary(self, output: torch.Tensor, work: dist.Work) -> Any:
        """What tells, one period later, whether an exact all-reduce issued now (its ``work``)
        left NaN in the last element of ``output``: an object whose ``nan()`` reads it
        (`call_schedule`; waiting for the call if it has not completed)."""
        ...

    def fallback(self, part: ExactReduction) -> Job:
        """The exact job of one tensor of a compressed call, after an exchange."""
        ...

    def run(self, jobs: list[Job], parts: list[ExactReduction], tensors: list[torch.Tensor],
            outputs: list[torch.Tensor], async_op: bool) -> dist.Work:
        """Issue a call's compressed ``jobs`` (one per tensor; ``parts`` their exact forms);
        ``tensors``: every tensor the call reads or writes; ``outputs`` the Work's value."""
        ...

    def run_plan(self, run: Any, native: tuple[str, tuple]) -> dist.Work:
        """Issue ``run``, a call's run as its place's compressed entry (`plan_run.PlanRun`:
        calling it runs it and returns its outputs, the Work's value); ``native``: c10d's
        method and arguments, for where the call must run exact (a CUDA graph's capture)."""
        ...
