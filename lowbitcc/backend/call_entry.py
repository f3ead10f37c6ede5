"""`Entry` and `Place`: what a reduction finds at its place in its call schedule.

A call schedule (`call_schedule.CallSchedule`) keeps one `Entry` per place: the call the ranks
agreed on there (its `call_key`), how it runs (exact, or compressed by the place's
`call_plan.CallPlan`), how many more runs it may make without an exchange, and what its last
run left to read (its *canary*) and to take (its *renewal*). A call that runs as its place's
entry gets the entry itself (the steady state); any other gets a `Place`: an exchange, or a
deviation from the entry. `takes_place` says which calls take places at all.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from lowbitcc.backend.works import callback_parent
from lowbitcc.codec import wire

_MAIN_THREAD = threading.main_thread().ident


def takes_place(device_type: str) -> bool:
    """Whether a call on ``device_type`` tensors issued now takes a place in its schedule: not
    one issued by a future's callback (`works.callback_parent`), nor, of CPU tensors, one
    issued by another thread than the main one (gloo completes its futures on its own threads,
    and callbacks issue their calls in orders that differ between ranks); those exchange a
    descriptor every time."""
    return not callback_parent() and (device_type != "cpu"
                                      or threading.get_ident() == _MAIN_THREAD)


def call_key(desc: wire.CallDescriptor) -> tuple:
    """What must be the same on every rank for a call to run as its place's entry (not whether
    this rank would compress it: the agreement at the place decided that for every rank)."""
    return (desc.collective, desc.dtype, desc.op, desc.numel, desc.part, desc.parent)


EXCHANGE, DEVIATE = "exchange", "deviate"
"""What a call that does not run as its place's entry does there (`Place.kind`): exchange a
descriptor (no entry, or none left), or deviate from the entry."""


@dataclasses.dataclass
class Place:
    """A reduction's place in ``schedule`` (``index``) where it does not run as the place's
    entry, and what it does there (``kind``, with the place's ``entry`` where it deviates from
    it). A place whose outcome is recorded later is open in the schedule until `settle`
    (idempotent)."""

    schedule: Any
    """The `call_schedule.CallSchedule` it is a place of."""
    index: int
    kind: str
    entry: Entry | None = None
    opened: bool = False

    def settle(self) -> None:
        if self.opened:
            self.opened = False
            self.schedule.settle()


class Poisoned:
    """The canary of an exact place whose last run this rank ran on a NaN-filled buffer
    (`deviation.ExactDeviation`): the others' outputs ended in NaN, and so would its own."""

    @staticmethod
    def nan() -> bool:
        return True


@dataclasses.dataclass
class Entry:
    """The call the ranks agreed on at one place (``desc``: this rank's descriptor then), how
    it ran (``exact``; ``by_model``: because rank 0's cost model chose it), and how many more
    runs it may make without an exchange (``left``). ``canary``: for an exact all-reduce (and
    a compressed entry off the direct schedule), the issuer's view of the output of the run
    before its last (`Issuer.canary`, kept by `keep`), whose ``nan()`` says whether that
    output ended in NaN; ``latest``: its last run's, read one run later. ``plan``: for a
    compressed entry, what its runs keep
    (`call_plan.CallPlan`, made by the first; passed on to the place's next entry of the
    same call)."""

    desc: wire.CallDescriptor
    left: int
    exact: bool = False
    by_model: bool = False
    canary: Any = None
    latest: Any = None
    plan: Any = None
    eligible: bool = True
    """This rank's tensor and op could be compressed (`policy.eligible`): what its
    descriptor says of the call at a renewal, with the policy in force then."""
    timed: bool = False
    """Its next run is timed for the cost model (rank 0's model chose it exact at a renewal:
    timed once per agreement, as the exchange that chose it was)."""
    renewal: Any = None
    """The place's next agreement (`renewal.PlaceRenewal`), started in the background by a run
    of the entry (`CallSchedule.ran`), taken by the run after its last (`CallSchedule.entry`)."""

    def __post_init__(self) -> None:
        self.key = call_key(self.desc)

    def keep(self, canary: Any) -> None:
        """Keep ``canary`` as the view of this run's output (None: no view, as in a CUDA graph
        capture). The place's next run reads the canary of the run before this one, never
        this one's: a run issued just before (on CUDA still running, on the worker still
        queued) is not waited for, so back-to-back runs of one place overlap, and every rank
        reads the same run's output. A NaN output thus makes the ranks exchange at the
        place's second run after it."""
        self.canary, self.latest = self.latest, canary

    def matches(self, key: tuple) -> bool:
        return key == self.key

    @property
    def renews(self) -> bool:
        """Whether the place agrees again on this call in the background (not for one tensor
        of several: an exploration of the exact path could not run as an entry)."""
        return not self.desc.part
