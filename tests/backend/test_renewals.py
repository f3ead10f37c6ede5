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
from lowbitcc.backend.call_schedule import EXCHANGE, PLANNED, CallSchedule
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
        plan = schedule.plan(KEY)
        assert plan.kind == EXCHANGE
        schedule.agreed(plan.index, DESC, call_schedule.REAGREE_EVERY - 1, exact=exact)
        plan.settle()
        lowbitcc.end_step()
    return schedule


def _run_out(schedule: CallSchedule, exact: bool = False) -> None:
    """The entry's three runs (the second starts its renewal)."""
    for _ in range(3):
        assert schedule.planned(KEY, exact) is not None


def test_a_confirmed_renewal_runs_the_place_on_without_an_exchange(renewals):
    schedule = _learned(renewals, Outcome(False, False, 4))
    _run_out(schedule)
    assert len(renewals) == 1  # started where two runs were left, not again
    for _ in range(4):  # the run that takes it, and three more
        assert schedule.planned(KEY, False) is not None
    assert renewals[0].taken == 1 and len(renewals) == 2


def test_a_renewal_choosing_the_other_path_makes_a_new_entry(renewals):
    schedule = _learned(renewals, Outcome(True, True, 4))
    _run_out(schedule)
    assert schedule.planned(KEY, False) is None  # taken: the entry is exact now
    entry = schedule.planned(KEY, True)
    assert entry is not None and entry.exact and entry.by_model and entry.timed


def test_a_renewal_without_an_entry_leaves_the_place_to_exchange(renewals):
    schedule = _learned(renewals, None)
    _run_out(schedule)
    assert schedule.plan(KEY).kind == EXCHANGE


def test_a_renewal_that_raised_drops_the_entry_and_keeps_the_period(renewals):
    schedule = _learned(renewals, RuntimeError("a peer is gone"))
    _run_out(schedule)
    with pytest.raises(RuntimeError, match="a peer is gone"):
        schedule.planned(KEY, False)
    plan = schedule.plan(KEY)
    assert plan.kind == EXCHANGE and plan.index > 0


def test_a_reported_deviation_raises_and_starts_the_schedule_again(renewals):
    schedule = _learned(renewals, DeviatedPeerError("rank 1 deviated"))
    _run_out(schedule)
    with pytest.raises(DeviatedPeerError):
        schedule.planned(KEY, False)
    assert schedule.plan(KEY).index == 0


def test_a_deviation_in_a_dropped_renewal_is_reported_again(renewals):
    schedule = _learned(renewals, Outcome(False, False, 4))
    schedule.deviated = True
    assert schedule.planned(KEY, False) is not None
    assert schedule.planned(KEY, False) is not None  # starts the renewal: it takes the report
    assert renewals[0].deviated and not schedule.deviated
    schedule.forget()  # every rank raised elsewhere: the renewal is dropped
    assert schedule.take_deviated()


def test_a_nan_canary_takes_the_pending_renewal_before_the_place_exchanges(renewals):
    schedule = _learned(renewals, DeviatedPeerError("rank 1 deviated"), exact=True)
    entry = schedule.planned(KEY, True)
    assert schedule.planned(KEY, True) is entry and len(renewals) == 1
    entry.canary = call_schedule.Poisoned()  # the last run's output ended in NaN
    with pytest.raises(DeviatedPeerError):  # the renewal's report, before any exchange
        schedule.plan(KEY)
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


def test_a_planned_run_of_a_renewed_entry_is_its_own(renewals):
    schedule = _learned(renewals, Outcome(False, False, 4))
    _run_out(schedule)
    plan = schedule.plan(KEY)
    assert plan.kind == PLANNED and plan.entry.left == 3
