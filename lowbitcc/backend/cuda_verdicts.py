"""What a CUDA call leaves for the host to read later, without a host synchronisation now.

A CUDA call returns before the GPU has run it. What the host must learn of it afterwards is
copied by the GPU into pinned host memory on the call's stream, behind an event:

- the *verdict word* of a compressed call (`verdict_word`): set where a received message did
  not belong to the call (its values decoded as NaN); the group's `watchdog.Watchdog` reads it
  once the call's event has passed and fails the call's Work;
- the *canary* of a call that ran as its place's entry in the call schedule (`call_schedule`):
  for an exact all-reduce, the last element of its output (`DeviceCanary`: NaN where a rank
  ran the place's call on a NaN-filled buffer, see `deviation.ExactDeviation`); for a
  compressed call, its verdict flag (`FlagCanary`, `keep_canaries`). The place's second run
  after it, two periods later, reads it (`call_entry.Entry.keep`; waiting for the event, long
  passed by then, while the run just before may still be on the GPU): every rank reads the
  same there, and exchanges a descriptor where it says something went wrong.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist


def verdict_word(calls: list[Any]) -> torch.Tensor | None:
    """Pinned host memory the current stream sets non-zero where one of ``calls`` received a
    foreign message (their ``verdict`` device flags, OR-ed on the device; no host wait); None
    where none has a flag."""
    flags = [f for f in (getattr(c, "verdict", None) for c in calls)
             if isinstance(f, torch.Tensor)]
    if not flags:
        return None
    word = torch.empty((), dtype=torch.uint8, pin_memory=True)
    flag = flags[0] if len(flags) == 1 else torch.stack(flags).any()
    word.copy_(flag.view(torch.uint8), non_blocking=True)  # a bool's byte: no kernel
    return word


def keep_canaries(calls: list[Any]) -> None:
    """Each of ``calls`` that ran as its place's compressed entry (its ``canary_entry``) leaves
    its verdict flag as the place's canary (`FlagCanary`): a deviation another rank made there
    shows at every rank's next run of the place, which then exchanges (`call_schedule`)."""
    for call in calls:
        entry, flag = getattr(call, "canary_entry", None), getattr(call, "verdict", None)
        if entry is not None and isinstance(flag, torch.Tensor):
            entry.keep(FlagCanary(flag))


class FlagCanary:
    """A 0-dim device ``flag`` copied into pinned host memory on the current stream, with an
    event after the copy; `nan` (the canary's question: did the place's last run go wrong)
    waits for that event and reads it."""

    __slots__ = ("_host", "_event")

    def __init__(self, flag: torch.Tensor) -> None:
        self._host = torch.empty((), dtype=torch.uint8, pin_memory=True)
        self._host.copy_(flag.view(torch.uint8), non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def nan(self) -> bool:
        self._event.synchronize()
        return bool(self._host.item())


class DeviceCanary:
    """The last element of a CUDA all-reduce's ``output`` (its ``work``, NCCL's), copied into
    pinned host memory on a stream ordered after the call (the work's CUDA-aware future runs
    the copy as its callback: no host wait), with an event after the copy; `nan` waits for
    that event (a call one period old has long passed it) and reads the copy."""

    __slots__ = ("_host", "_event")

    def __init__(self, output: torch.Tensor, work: dist.Work) -> None:
        self._host = torch.empty((), dtype=output.dtype, pin_memory=True)
        self._event = torch.cuda.Event()
        last = output[(-1,) * output.dim()]

        def copy(_: Any) -> None:
            self._host.copy_(last, non_blocking=True)
            self._event.record()

        work.get_future().then(copy)

    def nan(self) -> bool:
        self._event.synchronize()
        return math.isnan(self._host.item())
