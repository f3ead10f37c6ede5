"""What one steady-state compressed call dispatches to torch: a budget that only goes down.

The launch path is to be thin (no allocation in steady state, a handful of launches on
CUDA). The CPU path under ``LOCO_ISSUER=inline`` runs the CUDA path's issuing logic, so the
torch operations it dispatches per call (`TorchDispatchMode`; the C++ codec kernels are called
directly and not counted) are the budget of Python-side work the GPU path will also pay. The
numbers below are today's (2026-11-27); lower them as the path gets thinner.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import lowbitcc
from tests.support.ranks import run_ranks

OPS_PER_CALL = 20
"""torch operations one planned 1 Mi-element fp32 all-reduce dispatches on 2 ranks (63 before
the kernels framed and verified messages themselves and decoded gathered columns in place; 24
before the place's `CallPlan` ran it)."""
ALLOCATING_PER_CALL = 5
"""Of them, the ones that allocate: 3 empty (the all-gather's output and gloo's own), 2 zeros
(the encode's non-finite flags and sums); the plan keeps its messages."""
ALLOCATING = ("aten.empty", "aten.zeros", "aten.clone", "aten._to_copy", "aten.new_")


class _Counted(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _planned_call_ops(rank, world, gloo):
    group = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(
        issuer="inline"))
    x = torch.randn(1 << 18)

    def step() -> None:
        with lowbitcc.compressed(), lowbitcc.feedback_key("budget"):
            dist.all_reduce(x, group=group)
        lowbitcc.end_step()

    for _ in range(3):  # the first agrees; the next run as agreed
        step()
    with _Counted() as counted:
        step()
    return dict(counted.ops)


@pytest.mark.parametrize("world", [2])
def test_a_planned_call_stays_within_its_torch_operation_budget(world):
    for ops in run_ranks(_planned_call_ops, world):
        allocating = sum(n for op, n in ops.items() if op.startswith(ALLOCATING))
        assert sum(ops.values()) <= OPS_PER_CALL, ops
        assert allocating <= ALLOCATING_PER_CALL, ops
