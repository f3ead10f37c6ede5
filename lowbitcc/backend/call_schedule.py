"""`CallSchedule`: every reduction's place in the cycle of calls, as the ranks agreed on it once.

On by default (``LocoConfig.call_schedule``), on every route of a group of more than one rank
that exchanges descriptors (``check``, a policy that may compress).

Training issues the same calls in the same order step after step. Before each reduction the
ranks would exchange a call descriptor (`call_agreement`): a host round trip that costs more
than an exact call on a fast link. The schedule removes it from the steady state:

- every reduction takes the next *index* (`advance`), in issue order, the same on every rank
  while ranks issue the same calls;
- while the *period* is not known every call exchanges; it becomes known when the first call
  of an epoch (`policy.epoch`: a backward pass, or the calls between optimizer steps) is
  agreed equal to the first call of an earlier epoch, or, where no epoch marks it, when the
  calls have repeated a cycle a few times in a row (`call_cycle.CycleLearner`). From then on a
  call's *place* is its index modulo the period, and epochs no longer matter (DDP's ``Join``:
  the joined rank's shadow calls run outside backward, yet take the places of the calls they
  shadow);
- each agreement leaves its place an `Entry`: the agreed call and its outcome, for
  ``REAGREE_EVERY - 1`` more runs where the outcome can run without an exchange (`runs_for`),
  else for none; every rank derives the count from the agreed descriptors alike. The next
  agreement (with rank 0's cost-model suggestion) is a *renewal* (`lowbitcc.backend.renewal`),
  started in the background where the entry has `renew_ahead` runs left and taken by the
  place's run after the entry's last, on every rank alike;
- a call whose place holds an entry with runs left, and which is the entry's call
  (`Entry.matches`: collective, dtype, op, size, form, parent), runs as the entry says without
  an exchange: *compressed* entries (every schedule) run the place's plan at once, *exact* ones
  (floating-point SUM, AVG and PREMUL_SUM of one tensor of at least 2 elements per rank) are
  the inner group's own call, issued by the calling thread.

A rank whose call is not its place's entry *deviates* and knows it locally
(`lowbitcc.backend.deviation`). It never waits on a transfer of another size than the others':
it runs the entry's call in place of its own. At a compressed entry of the direct schedule it
sends zeros in messages flagged `wire.FLAG_DEVIATED`, which every rank reads: where every rank
deviated to the same call, every rank starts its schedule again (`restart`) and agrees on the
call; else every rank raises `CollectiveMismatchError` at that call. At a compressed entry of
another schedule (ring, tree, hierarchical: not every rank reads every rank's messages) it
contributes NaN in flagged messages and raises; the ranks that read a flagged message, or one
built from it, raise at that call, and the others' outputs are NaN, which their canary (below)
turns into an exchange at the place's run after next. At an exact entry it contributes a buffer
of NaN with a few -0.0 elements: where every rank deviated, those elements come back -0.0 and
every rank starts again; else this rank raises, the others' outputs of that call are NaN, and
they raise at the next exchange or renewal, where this rank's descriptor carries
`wire.DESC_DEVIATED` (`take_deviated`). Every rank exchanges again at a place where the output
of the run before its last ended in NaN (its *canary*, read by the issuer, kept by exact
all-reduces and by compressed calls on CUDA or off the direct schedule; the same on every rank
for an all-reduce), so that exchange is at most two periods away. The canary read is one run
behind (`Entry.keep`) so that a run never waits for the one issued just before it at its place:
on CUDA the host would otherwise wait for the GPU whenever one place runs back to back.

Threads: the calling threads decide (`advance`, `entry`, `ran`; they take renewals too); on
the worker route the exchanges and compressed deviations run later on the group's worker, which
records their outcomes (`agreed`, `restart`). A decision must see every earlier outcome on every
rank alike, so a call that will record one *opens* it (`open`) and the next call waits until it
is *settled* (`wait_settled`): only behind exchanges, not in the steady state.
"""

from __future__ import annotations

__all__ = ["DEVIATE", "EXCHANGE", "CallSchedule", "Entry", "Place", "Poisoned", "call_key",
           "renew_ahead", "runs_for", "takes_place"]

import threading
from collections.abc import Callable
from typing import Any

import torch

from lowbitcc.backend.call_agreement import DeviatedPeerError
from lowbitcc.backend.call_cycle import CycleLearner
from lowbitcc.backend.call_entry import (
    DEVIATE,
    EXCHANGE,
    Entry,
    Place,
    Poisoned,
    call_key,
    takes_place,
)
from lowbitcc.backend.exact import ReduceOp
from lowbitcc.codec import wire

REAGREE_EVERY = 64
"""Runs of a place per agreement on its call: the first agreement is the exchange of the
place's call, the later ones renewals in the background (`lowbitcc.backend.renewal`)."""


def renew_ahead() -> int:
    """Runs of an entry left when its renewal starts (`lowbitcc.backend.renewal`): half a cycle for
    the exchange to end on the worker (gloo's take 0.4-5 ms); the outcome lags rank 0's model as much."""
    return REAGREE_EVERY // 2


EXACT_OPS = frozenset({int(ReduceOp.SUM), int(ReduceOp.AVG), int(ReduceOp.PREMUL_SUM)})
"""The ops of calls that may keep an exact entry: a NaN in one rank's input makes every
output NaN (`deviation.ExactDeviation`)."""
EXACT_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})


def runs_for(leader: wire.CallDescriptor, compressed: bool, schedulable: bool,
             world: int) -> int:
    """Runs without an exchange that the agreed call ``leader`` (rank 0's descriptor) keeps at
    its place: none after a cost-model warm-up or exploration (``leader.explore``), for a
    compressed call whose schedule cannot run on its route (``schedulable`` False: the place's
    run exchanges, and raises there), or for an exact call whose deviation cannot be made
    visible (`EXACT_OPS`, `EXACT_DTYPES`, one tensor, at least 2 elements per rank)."""
    if leader.explore:
        return 0
    if compressed:
        return REAGREE_EVERY - 1 if schedulable else 0
    per_rank = leader.numel // world if leader.collective == "reduce_scatter" else leader.numel
    nan_capable = (leader.op in EXACT_OPS and leader.dtype in EXACT_DTYPES
                   and not leader.part and per_rank >= 2)
    return REAGREE_EVERY - 1 if nan_capable else 0


class CallSchedule:
    """The places and entries of one group's route (see the module docstring). All of this
    depends only on the calls and the agreements, the same on every rank."""

    def __init__(self, settle_timeout_s: float = 1800.0,
                 renew: Callable[[Entry, bool], Any] | None = None) -> None:
        """``renew(entry, deviated)``: start agreeing on ``entry``'s call again in the
        background (`renewal.PlaceRenewal`), reporting this rank's deviation where
        ``deviated`` (None: every place exchanges at its run after its entry's last)."""
        self._renew = renew
        self._renew_at = renew_ahead()
        self._settled = threading.Condition()
        self._open = 0
        self._timeout = settle_timeout_s
        self.deviated = False
        """This rank ran a place's exact entry in place of another call since its last
        exchange (`take_deviated`)."""
        self._learner = CycleLearner()
        self._reset()

    def _reset(self) -> None:
        self._learner.reset()
        self._entries: dict[int, Entry] = self._learner.entries  # learning: by index
        self._period: int | None = None
        self._origin = 0
        self._next = 0

    # -- in the calling thread -------------------------------------------------------------
    def take(self, key: tuple, wish: str | None = None, wait: bool = True) -> Entry | Place:
        """Take the next place for the call of ``key`` (`call_key`): its entry where the call
        runs as it (the steady state, read where it lies), else the `Place` and what the call
        does there (see the module docstring). ``wish``: "exact" where the caller demands the
        exact path (`lowbitcc.exact`), "compressed" where it demands compression
        (`lowbitcc.compressed`), so that an entry of the other path does not match. An
        exchange, and a deviation from a compressed entry, open the place. ``wait`` False: the
        call is a later tensor of one call, whose places are all taken before any of its jobs
        runs (on every rank alike)."""
        if wait and self._open:
            self.wait_settled()
        index = self._next
        if self._period is None:
            index = self.advance()
            entry = None
        else:
            self._next = index + 1  # `advance`: the period is known
            entry = self._entries.get(self._origin + (index - self._origin) % self._period)
            if entry is None or entry.left <= 0 or (entry.canary is not None
                                                    and entry.canary.nan()):
                entry = self.entry(index)  # (it reads the canary again)
        if entry is None:
            return self._opened(Place(self, index, EXCHANGE))
        self.ran(entry)  # a deviating call runs the entry's call in its place too
        if entry.key == key and wish != ("compressed" if entry.exact else "exact"):
            return entry
        place = Place(self, index, DEVIATE, entry)
        return place if entry.exact else self._opened(place)

    def _opened(self, place: Place) -> Place:
        self.open()
        place.opened = True
        return place

    def advance(self) -> int:
        """The index of the call issued now (counts it; while the period is unknown, a call
        of a new epoch starts one)."""
        index = self._next
        self._next += 1
        if self._period is None:
            self._learner.advance(index)
        return index

    def entry(self, index: int) -> Entry | None:
        """The entry a call at ``index`` runs as, if it has runs left and, for an exact one,
        its last run did not end in NaN (None: exchange; a NaN canary ends the entry)."""
        if self._period is None:
            return None
        place = self._place(index)
        entry = self._entries.get(place)
        if entry is None:
            return None
        if entry.canary is not None and entry.canary.nan():
            if entry.renewal is not None:  # it may report a deviation: every rank raises
                self._taken(place, entry)
            del self._entries[place]
            return None
        if entry.left <= 0:
            return None if entry.renewal is None else self._renewed(place, entry)
        return entry

    def _taken(self, place: int, entry: Entry) -> Any:
        """The `renewal.Outcome` of ``entry``'s renewal (waited for; None: no entry). Where the
        exchange raised, the place has no entry, and where a rank reported a deviation
        (`call_agreement.DeviatedPeerError`) every rank starts its schedule again."""
        renewal, entry.renewal = entry.renewal, None
        assert renewal is not None
        try:
            return renewal.outcome()
        except DeviatedPeerError:
            self.forget()
            raise
        except BaseException:
            self._entries.pop(place, None)
            raise

    def _renewed(self, place: int, entry: Entry) -> Entry | None:
        """``entry``'s renewal taken: the entry again (or, where the agreement chose the other
        path, a new one) with its runs, else None (the place exchanges)."""
        outcome = self._taken(place, entry)
        if outcome is None:
            del self._entries[place]
            return None
        if (outcome.exact, outcome.by_model) != (entry.exact, entry.by_model):
            # a compressed entry's plan is kept across an exploration of the exact path
            kept = entry.plan if outcome.explore or not outcome.exact else None
            entry = self._entries[place] = Entry(entry.desc, outcome.left, outcome.exact,
                                                 outcome.by_model, plan=kept,
                                                 eligible=entry.eligible)
        entry.left = outcome.left
        entry.timed = outcome.exact and outcome.by_model
        return entry

    def ran(self, entry: Entry) -> None:
        """A call runs as ``entry`` without an exchange; where that leaves it `renew_ahead`
        runs or fewer, its renewal starts (`Entry.renews`), for the place's run after the
        entry's last to take; it reports this rank's deviation since its last exchange
        (`take_deviated`), as an exchange would."""
        entry.left -= 1
        if (entry.left <= self._renew_at and entry.renewal is None and self._renew is not None
                and entry.renews):
            deviated = self.take_deviated()
            try:
                entry.renewal = self._renew(entry, deviated)
            except BaseException:
                self.deviated = self.deviated or deviated
                raise

    def take_deviated(self) -> bool:
        """Whether this rank deviated since its last exchange (`wire.DESC_DEVIATED`); the call
        that exchanges now reports it, so it is cleared."""
        deviated, self.deviated = self.deviated, False
        return deviated

    def open(self) -> None:
        """A call that will record an outcome later (on the worker) was issued."""
        with self._settled:
            self._open += 1

    def wait_settled(self) -> None:
        """Wait until every opened outcome is recorded (`settle`); at once when none is open."""
        if not self._open:
            return
        with self._settled:
            if not self._settled.wait_for(lambda: self._open == 0, self._timeout):
                raise RuntimeError(
                    "lowbitcc: an earlier call's descriptor exchange did not complete within the "
                    f"group's timeout ({self._timeout:g} s); a peer may be stalled or dead")

    # -- where the outcome is known (the worker, or the calling thread inline) ---------------
    def settle(self) -> None:
        """An opened outcome is recorded (or its call ended without one)."""
        with self._settled:
            self._open -= 1
            self._settled.notify_all()

    def agreed(self, index: int, desc: wire.CallDescriptor, runs: int, exact: bool,
               by_model: bool = False, eligible: bool = True) -> None:
        """The ranks agreed at ``index`` on ``desc``'s call, ``exact`` (``by_model``) or
        compressed, which keeps ``runs`` runs without an exchange (`runs_for`); ``eligible``:
        this rank's tensor and op could be compressed (`Entry.eligible`)."""
        entry = Entry(desc, runs, exact, by_model, eligible=eligible)
        if self._period is None:
            self._learn(index, entry)
        elif index < self._next:
            place = self._place(index)
            last = self._entries.get(place)
            if last is not None and not exact and not last.exact and last.matches(entry.key):
                entry.plan = last.plan
            self._entries[place] = entry

    def forget(self) -> None:
        """Forget everything (every rank raised at the same exchange): the next call issued is
        index 0. A deviation a renewal not yet taken reported is reported again."""
        self.deviated |= any(e.renewal is not None and e.renewal.deviated
                             for e in self._entries.values())
        self._reset()

    def restart(self, place: Place | None = None) -> int:
        """Forget everything (every rank deviated alike): the call issued now is index 0, and
        ``place``, its place, becomes an exchange there (open). Where the period was a guess
        from the calls themselves, the next guess needs more repeats."""
        if self._period is not None:
            self._learner.wrong_guess()
        self.forget()
        index = self.advance()
        if place is not None:
            place.index, place.kind, place.entry = index, EXCHANGE, None
            if not place.opened:
                self._opened(place)
        return index

    def _place(self, index: int) -> int:
        assert self._period is not None
        return self._origin + (index - self._origin) % self._period

    def _learn(self, index: int, entry: Entry) -> None:
        """Keep the call agreed at ``index`` while learning; where that closes the period
        (`call_cycle.CycleLearner.learn`), the schedule's places are its cycle's calls."""
        found = self._learner.learn(index, entry)
        self._entries = self._learner.entries
        if found is not None:
            self._period, self._origin = found
