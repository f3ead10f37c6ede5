"""A place's renewals (`lowbitcc.backend.renewal`) as the call schedule takes them, in one
process with scripted renewals: what the place's run after its entry's last does with each
outcome, an error or a reported deviation; the multi-rank behaviour is in
test_call_schedule.py, test_exact_places.py and test_cost_model.py."""

from __future__ import annotations

import pytest
import torch

import lowbitcc
from lowbitcc.backend import call_schedule
from lowbitcc.backend.call_agreement import DeviatedPeerError
from lowbitcc.backend.call_schedule import EXCHANGE, CallSchedule, Entry
from lowbitcc.backend.exact import ReduceOp
from lowbitcc.backend.renewal import Outcome
from lowbitcc.codec import wire

DESC = wire.CallDescriptor("all_reduce", torch.float32, int(ReduceOp.SUM), 100_000, 1, 4, 32, True)
KEY = call_schedule.call_key(DESC)


class ScriptedRenewal:
    """A renewal whose `outcome` returns (or raises) ``result``; counts its takes."""

    def __init__(self, result: object, deviated: bool) -> None:
        self.result, self.deviated, self.taken = result, deviated, 0

    def outcome(self) -> Outcome | None:
        self.taken += 1
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result  # type: ignore[return-value]


@pytest.fixture
def renewals(monkeypatch):
    """Every place renewed every 4 runs (started where 2 are left)."""
    monkeypatch.setattr(call_schedule, "REAGREE_EVERY", 4)
    return []


def _learned(renewals: list, result: object, exact: bool = False) -> CallSchedule:
    """A schedule of one place (period 1) agreed on `DESC` (``exact`` or compressed), whose
    renewals give ``result``; ``renewals`` gains each renewal started."""

    def renew(entry, deviated):
        renewal = ScriptedRenewal(result, deviated)
        renewals.append(renewal)
        return renewal

    schedule = CallSchedule(renew=renew)
    for _ in range(2):  # the second epoch's first call closes the period
        place = schedule.take(KEY)
        assert place.kind == EXCHANGE
        schedule.agreed(place.index, DESC, call_schedule.REAGREE_EVERY - 1, exact=exact)
        place.settle()
        lowbitcc.end_step()
    return schedule


def _steady(schedule: CallSchedule, exact: bool = False) -> Entry | None:
    """The next place's entry, where the call of `KEY` runs as it and it is ``exact`` (else
    compressed), else None (the place is taken either way)."""
    taken = schedule.take(KEY)
    return taken if type(taken) is Entry and taken.exact == exact else None


def _run_out(schedule: CallSchedule, exact: bool = False) -> None:
    """The entry's three runs (the second starts its renewal)."""
    for _ in range(3):
        assert _steady(schedule, exact) is not None


def test_a_confirmed_renewal_runs_the_place_on_without_an_exchange(renewals):
    schedule = _learned(renewals, Outcome(False, False, 4))
    _run_out(schedule)
    assert len(renewals) == 1  # started where two runs were left, not again
    for _ in range(4):  # the run that takes it, and three more
        assert _steady(schedule) is not None
    assert renewals[0].taken == 1 and len(renewals) == 2


def test_a_renewal_choosing_the_other_path_makes_a_new_entry(renewals):
    schedule = _learned(renewals, Outcome(True, True, 4))
    _run_out(schedule)
    entry = _steady(schedule, True)  # taken: the entry is exact now
    assert entry is not None and entry.exact and entry.by_model and entry.timed


def test_a_renewal_without_an_entry_leaves_the_place_to_exchange(renewals):
    schedule = _learned(renewals, None)
    _run_out(schedule)
    assert schedule.take(KEY).kind == EXCHANGE


def test_a_renewal_that_raised_drops_the_entry_and_keeps_the_period(renewals):
    schedule = _learned(renewals, RuntimeError("a peer is gone"))
    _run_out(schedule)
    with pytest.raises(RuntimeError, match="a peer is gone"):
        schedule.take(KEY)
    place = schedule.take(KEY)
    assert place.kind == EXCHANGE and place.index > 0


def test_a_reported_deviation_raises_and_starts_the_schedule_again(renewals):
    schedule = _learned(renewals, DeviatedPeerError("rank 1 deviated"))
    _run_out(schedule)
    with pytest.raises(DeviatedPeerError):
        schedule.take(KEY)
    assert schedule.take(KEY).index == 0


def test_a_deviation_in_a_dropped_renewal_is_reported_again(renewals):
    schedule = _learned(renewals, Outcome(False, False, 4))
    schedule.deviated = True
    assert _steady(schedule) is not None
    assert _steady(schedule) is not None  # starts the renewal: it takes the report
    assert renewals[0].deviated and not schedule.deviated
    schedule.forget()  # every rank raised elsewhere: the renewal is dropped
    assert schedule.take_deviated()


def test_a_nan_canary_takes_the_pending_renewal_before_the_place_exchanges(renewals):
    schedule = _learned(renewals, DeviatedPeerError("rank 1 deviated"), exact=True)
    entry = _steady(schedule, True)
    assert _steady(schedule, True) is entry and len(renewals) == 1
    entry.keep(call_schedule.Poisoned())  # a run's output ended in NaN
    entry.keep(None)  # and the place ran once more (the canary is read one run behind)
    with pytest.raises(DeviatedPeerError):  # the renewal's report, before any exchange
        schedule.take(KEY)
    assert renewals[0].taken == 1


def test_one_tensor_of_several_is_not_renewed(renewals):
    part = wire.CallDescriptor("all_reduce", torch.float32, int(ReduceOp.SUM), 100_000, 1, 4, 32,
                               True, part=True)
    schedule = CallSchedule(renew=lambda entry, deviated: renewals.append(entry))
    entry = call_schedule.Entry(part, 3)
    assert not entry.renews
    schedule.ran(entry)
    schedule.ran(entry)
    assert renewals == [] and entry.left == 1


def test_a_run_of_a_renewed_entry_is_its_own(renewals):
    schedule = _learned(renewals, Outcome(False, False, 4))
    _run_out(schedule)
    entry = schedule.take(KEY)
    assert type(entry) is Entry and entry.left == 3


def test_a_call_that_is_not_the_entry_or_wishes_the_other_path_deviates(renewals):
    schedule = _learned(renewals, Outcome(False, False, 4))
    other = (*KEY[:3], KEY[3] + 1, *KEY[4:])
    for key, wish in ((other, None), (KEY, "exact")):  # another size; `lowbitcc.exact`
        place = schedule.take(key, wish)
        assert place.kind == call_schedule.DEVIATE and place.opened  # until its job settles it
        place.settle()
    assert type(schedule.take(KEY, "compressed")) is Entry


class RecordingCanary:
    """A canary whose reads are logged in ``reads``; ``nan`` its answer."""

    def __init__(self, name: int, reads: list, nan: bool = False) -> None:
        self.name, self.reads, self.is_nan = name, reads, nan

    def nan(self) -> bool:
        self.reads.append(self.name)
        return self.is_nan


def test_a_run_reads_the_canary_of_the_run_before_the_last_never_the_last():
    """The canary of the run just issued (on CUDA possibly still on the GPU: its read would wait
    for it) is never read by the place's next run, only by the run after; a NaN there makes the
    place exchange."""
    schedule = _learned([], Outcome(False, False, 4), exact=True)
    reads: list = []
    entry = None
    for run in range(5):
        taken = schedule.take(KEY)
        assert type(taken) is Entry and taken.exact, run
        entry = taken
        assert reads == list(range(run - 1)), (run, reads)  # run k read run k-2's canary
        entry.keep(RecordingCanary(run, reads, nan=(run == 4)))
    assert entry is not None
    assert type(schedule.take(KEY)) is Entry  # reads run 4's predecessor: no NaN yet
    entry.keep(RecordingCanary(5, reads))
    place = schedule.take(KEY)  # reads run 4's: NaN, the place exchanges
    assert type(place) is not Entry and place.kind == EXCHANGE
    assert reads[-1] == 4
