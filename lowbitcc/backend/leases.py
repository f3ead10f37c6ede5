"""`Leases`: the calls that the cost model leased to the exact path, decided in issue order.

Rank 0's cost model may answer a call's descriptor exchange with an exact suggestion carrying a
*lease* (`lowbitcc.cost_model`): the next ``lease`` calls of that size class run exact on every
rank without an exchange. Which calls are leased must be the same on every rank, and so must
the order in which the leased calls reach gloo. Both hold if every call's lease is decided in
issue order, by one thread at a time, knowing the outcome of every earlier exchange:

- the issuing thread asks `begin` for a call's `Ticket`. Where no earlier call of the device
  type is still *undecided* (queued on the group's worker and not yet past its lease decision
  or its exchange) and ``now`` allows, it decides at once: a lease is left, the call is
  counted against it, and the issuing thread issues the exact call itself, without a job;
- otherwise the call is undecided until its job on the worker (which runs jobs in issue order)
  decides it: `Ticket.take` (a lease left: exact without an exchange), else the exchange,
  whose outcome (rank 0's lease, or none) the job hands to `Ticket.settle` exactly once, after
  it has issued whatever exact call the decision starts.

No thread ever waits for another here: while the worker lags behind, the calls go to it, and
it decides them as it always did. Thread-safe.
"""

from __future__ import annotations

import threading

from lowbitcc import state
from lowbitcc.cost_model import CostModel, SizeClass


class Ticket:
    """One call's lease decision (see the module docstring). ``leased``: decided at issue, a
    lease taken; else undecided until `settle`."""

    def __init__(self, leases: Leases, size_class: SizeClass, leased: bool) -> None:
        self.size_class = size_class
        self.leased = leased
        self._leases = leases
        self._open = not leased

    def take(self) -> bool:
        """On the worker, in issue order: count the call against its class's lease if one is
        left (True); the job then issues the exact call and settles."""
        return self._leases._take(self.size_class)

    def settle(self, lease: int = 0) -> None:
        """The call is decided: ``lease`` further calls of its class run exact (rank 0's, from
        the exchange; 0: no new lease). Call once the decided exact call (if any) is issued;
        later calls do nothing."""
        if self._open:
            self._open = False
            self._leases._settle(self.size_class, lease)


class Leases:
    """The leased calls of one group's size classes; ``model``, its cost model, counts every
    leased call."""

    def __init__(self, model: CostModel) -> None:
        self._model = model
        self._lock = threading.Lock()
        self._left: dict[SizeClass, int] = {}
        self._undecided: dict[str, int] = {}

    def begin(self, size_class: SizeClass, now: bool = True) -> Ticket:
        """The `Ticket` of the next call of ``size_class`` in issue order; decided at once (a
        lease taken) only if ``now`` and no earlier call of its device type is undecided."""
        with self._lock:
            leased = now and self._take_free(size_class)
            if not leased:
                device = size_class[1]
                self._undecided[device] = self._undecided.get(device, 0) + 1
        if leased:
            self._counted(size_class)
        return Ticket(self, size_class, leased)

    def take_at_issue(self, size_class: SizeClass) -> bool:
        """`begin`'s decision at once without a ticket: True, a lease taken and the call
        counted; False, nothing taken or counted (the caller then asks `begin`)."""
        with self._lock:
            leased = self._take_free(size_class)
        if leased:
            self._counted(size_class)
        return leased

    def _take_free(self, size_class: SizeClass) -> bool:
        """Under the lock: take a lease of ``size_class`` if one is left and no earlier call
        of its device type is undecided."""
        if self._undecided.get(size_class[1]) or self._left.get(size_class, 0) <= 0:
            return False
        self._use(size_class)
        return True

    def none_held(self) -> bool:
        """Whether no class holds a lease now (read without the lock: a hint, exact only when
        no other thread decides leases meanwhile, as for calls issued in issue order)."""
        return not self._left

    def _use(self, size_class: SizeClass) -> None:
        """Under the lock: one call of ``size_class`` takes its lease (a class whose lease is
        used up leaves the table)."""
        left = self._left[size_class] - 1
        if left:
            self._left[size_class] = left
        else:
            del self._left[size_class]

    def held(self) -> int:
        """Leased calls left, over every class."""
        with self._lock:
            return sum(self._left.values())

    def _take(self, size_class: SizeClass) -> bool:
        with self._lock:
            if self._left.get(size_class, 0) <= 0:
                return False
            self._use(size_class)
        self._counted(size_class)
        return True

    def _settle(self, size_class: SizeClass, lease: int) -> None:
        with self._lock:
            if lease:
                self._left[size_class] = lease
            self._undecided[size_class[1]] -= 1

    def _counted(self, size_class: SizeClass) -> None:
        self._model.count(size_class)
        state.STATS.add("exact", model_exact=1)
