"""`PlanRun`: one steady-state run of a call place's `call_plan.CallPlan` as its issuer takes it
(`issuer.Issuer.run_plan`): its call number and feedback key taken in the calling thread, in
issue order, and the plan's ``run`` called where the issuer runs it (the group's worker on the
CPU, the calling thread inline and on CUDA, on the call's stream)."""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from lowbitcc.backend.call_plan import CallPlan


class PlanRun:
    """One run of ``plan``, its place's ``entry``, as its issuer takes it: ``tensor`` by ``op``
    (into ``output``: a reduce-scatter), call number ``seq``, feedback key ``key`` and
    ``buffer``, ``timed`` for the cost model (`CallPlan.run`'s), all taken in the calling
    thread. Calling it runs it (on the issuer's thread) and returns the call's outputs; the
    CUDA issuer also reads ``verdict`` and ``canary_entry`` after it ran (`cuda_verdicts`)."""

    __slots__ = ("plan", "canary_entry", "tensor", "op", "output", "seq", "key", "buffer",
                 "timed")

    def __init__(self, plan: CallPlan, entry: Any, tensor: torch.Tensor, op: Any,
                 output: torch.Tensor | None, seq: int, key: str,
                 buffer: StorageWeakRef | None, timed: bool) -> None:
        self.plan, self.canary_entry, self.tensor, self.op, self.output = (
            plan, entry, tensor, op, output)
        self.seq, self.key, self.buffer, self.timed = seq, key, buffer, timed

    def __call__(self) -> list[torch.Tensor]:
        output = self.output
        self.plan.run(self.tensor, self.op, output, self.seq, self.key, self.buffer, self.timed)
        return [self.tensor if output is None else output]

    @property
    def verdict(self) -> torch.Tensor | None:
        return self.plan.verdict

    def describe(self) -> str:
        return self.plan.describe()
