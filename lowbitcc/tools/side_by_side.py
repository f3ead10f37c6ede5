"""`side_by_side`: the training-and-measurement loop of `lowbitcc bench-train` and `lowbitcc hybrid`.

Each rank holds one model copy per scheme. Every step, each scheme trains on the same batch, one
scheme after the other in an order that rotates per step (so that neither always finds the
caches the other left), after a barrier on the ``metrics`` group outside the timing (so the
network and the machine's load treat every scheme alike). Per scheme the loop keeps this rank's
seconds over the timed steps (those after ``warmup``), the phase seconds the step reports, the
growth of the ``meter``'s counters (bytes sent, calls, codec seconds: whatever the tool counts)
over the timed steps and over every step, and each step's loss averaged over the ranks.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from tqdm import tqdm

Step = Callable[[str, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, float]]]
"""``step(scheme, x, y)`` trains ``scheme``'s copy one step: its loss and phase seconds."""
Meter = Callable[[], dict[str, float]]
"""``meter()``: this rank's counters so far (only their growth is kept)."""


@dataclasses.dataclass
class Trained:
    """One scheme's record (see the module docstring): ``slowest_s`` is the timed steps'
    seconds of the slowest rank (a step ends on its last rank)."""

    seconds: float = 0.0
    slowest_s: float = 0.0
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    timed: dict[str, float] = dataclasses.field(default_factory=dict)
    every: dict[str, float] = dataclasses.field(default_factory=dict)
    losses: list[float] = dataclasses.field(default_factory=list)


def train(schemes: Sequence[str], steps: int, warmup: int, batch: Callable[[int], tuple],
          step: Step, meter: Meter, metrics: dist.ProcessGroup, *, desc: str,
          barrier_after: bool = False) -> dict[str, Trained]:
    """Train every scheme ``steps`` steps side by side on ``batch(step)`` (every rank calls it);
    ``barrier_after``: the ranks meet again after each scheme's step, before the meter reads
    (so that counted bytes include the peers' last sends)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {s: Trained() for s in schemes}
    bar = tqdm(total=steps, desc=desc, leave=False,
               disable=rank != 0 or not sys.stderr.isatty())
    for i in range(steps):
        x, y = batch(i)
        k = i % len(schemes)
        step_loss = torch.zeros(len(schemes), dtype=torch.float64)
        for scheme in [*schemes[k:], *schemes[:k]]:
            record = out[scheme]
            dist.barrier(group=metrics)
            before = meter()
            start = time.perf_counter()
            loss, phases = step(scheme, x, y)
            elapsed = time.perf_counter() - start
            if barrier_after:
                dist.barrier(group=metrics)
            after = meter()
            _add(record.every, before, after)
            if i >= warmup:
                record.seconds += elapsed
                _add(record.timed, before, after)
                for name, seconds in phases.items():
                    record.phases[name] = record.phases.get(name, 0.0) + seconds
            step_loss[schemes.index(scheme)] = float(loss.detach())
        dist.all_reduce(step_loss, group=metrics)
        for j, scheme in enumerate(schemes):
            out[scheme].losses.append(float(step_loss[j]) / world)
        bar.update(1)
    bar.close()
    totals = torch.tensor([out[s].seconds for s in schemes], dtype=torch.float64)
    dist.all_reduce(totals, op=dist.ReduceOp.MAX, group=metrics)
    for j, scheme in enumerate(schemes):
        out[scheme].slowest_s = float(totals[j])
    return out


def _add(into: dict[str, float], before: dict[str, float], after: dict[str, float]) -> None:
    for name, value in after.items():
        into[name] = into.get(name, 0.0) + value - before.get(name, 0.0)
