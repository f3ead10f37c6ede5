"""`CallPlaces`: where a reduction issued now takes its place in its route's call schedule.

The calling thread asks here, for each tensor of a reduction, for its `call_schedule.Plan`:
its place and what it does there (`plan`), or, for the short path, whether the next place's
entry takes it (`planned`). A call issued by a future's callback, or (CPU tensors)
by another thread than the main one, takes no place and exchanges a descriptor every time, as
without the schedule: gloo completes its futures on its own threads, and callbacks issue their
calls in orders that differ between ranks.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from lowbitcc import policy
from lowbitcc.backend.call_schedule import CallSchedule, Entry, Plan
from lowbitcc.backend.exact import op_type
from lowbitcc.backend.works import callback_parent
from lowbitcc.config import LocoConfig

_MAIN_THREAD = threading.main_thread().ident


class CallPlaces:
    """The places of one group's reductions: ``schedules`` by device type (empty: no call
    schedule), under ``config``."""

    def __init__(self, schedules: dict[str, CallSchedule], config: LocoConfig) -> None:
        self._schedules, self._config = schedules, config

    def plan(self, collective: str, like: torch.Tensor, numel: int, op: Any,
             part: bool = False, first: bool = True) -> Plan | None:
        """The place of a reduction of ``numel`` elements of ``like``'s dtype by ``op``, issued
        now, in its route's `call_schedule.CallSchedule`, and what it does there (None: no
        schedule). Call once per tensor of a call, in issue order (``first``: its first)."""
        schedule = self._schedule_for(like)
        if schedule is None:
            return None
        return schedule.plan(self.call_key(collective, like.dtype, op, numel, part),
                             self._wish(like, op, numel), wait=first)

    def planned(self, collective: str, like: torch.Tensor, numel: int, kind: Any,
                exact: bool, device_type: str) -> Entry | None:
        """`CallSchedule.planned` for a reduction of one tensor (on a ``device_type`` device)
        by an op of type ``kind`` (`exact.op_type`) issued now: its place's ``exact`` (else
        compressed) entry where it runs as it (the place taken), else None (nothing taken)."""
        schedule = self._schedules.get(device_type)
        if schedule is None or not self._takes_place(device_type):
            return None
        if exact and self._wish(like, kind, numel) == "compressed":
            return None
        if not exact and policy.mode(self._config.policy) == "never":  # `_wish`'s "exact"
            return None
        return schedule.planned(self.call_key(collective, like.dtype, kind, numel, False), exact)

    def refusal_plans(self, collective: str, like: torch.Tensor,
                      numels: list[int]) -> list[Plan] | None:
        """The places of a call this rank refused, one per tensor (None: no schedule): such a
        call matches no entry."""
        schedule = self._schedule_for(like)
        if schedule is None:
            return None
        plans: list[Plan] = []
        try:
            for n in numels:
                plans.append(schedule.plan(("refused", collective, n), wait=not plans))
        except BaseException:  # a renewal's error (`CallSchedule.entry`)
            for plan in plans:
                plan.settle()
            raise
        return plans

    def _schedule_for(self, like: torch.Tensor,
                      device_type: str | None = None) -> CallSchedule | None:
        """The call schedule of a reduction of ``like``'s device issued now, where it takes a
        place: not one issued by a future's callback (`issue_queue.callback_parent`), nor, of
        CPU tensors, one issued by another thread than the main one (gloo completes its
        futures on its own threads, whose callbacks issue calls in an order that differs
        between ranks). Those exchange a descriptor every time, as without the schedule.
        ``device_type``: ``like``'s, where the caller has it."""
        device_type = device_type or like.device.type
        schedule = self._schedules.get(device_type)
        return schedule if schedule is not None and self._takes_place(device_type) else None

    @staticmethod
    def _takes_place(device_type: str) -> bool:
        """Whether a reduction of a ``device_type`` device issued now takes a place
        (`_schedule_for`)."""
        return not callback_parent() and (device_type != "cpu"
                                          or threading.get_ident() == _MAIN_THREAD)

    def _wish(self, like: torch.Tensor, op: Any, numel: int) -> str | None:
        """What the policy in force demands of a call issued now: "exact" (`lowbitcc.exact`, a
        policy "never"), "compressed" (a `lowbitcc.compressed` block around an eligible call of
        at least ``min_size`` elements: the cost model is not asked), else None (the place's
        agreement decides, the cost model's suggestion included)."""
        mode = policy.mode(self._config.policy)
        if mode == "never":
            return "exact"
        if (mode == "always" and policy.forced() and numel >= self._config.min_size
                and policy.eligible(like, op_type(op))):
            return "compressed"
        return None

    @staticmethod
    def call_key(collective: str, dtype: torch.dtype, op: Any, numel: int, part: bool) -> tuple:
        """`call_schedule.call_key` of a call issued now (taking a place: parent 0)."""
        return (collective, dtype, int(op_type(op)), numel, part, 0)
