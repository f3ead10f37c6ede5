"""The policy blocks (`lowbitcc.policy`): the innermost block wins and each restores what it
found, also on an exception and used as a decorator; a `feedback_key` block names its calls
``name``, ``name#1``, ... afresh each time it is entered. And `exact.input_factor`, which the
call plans read instead of building a `Reduction` per call."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lowbitcc
from lowbitcc import policy, state
from lowbitcc.backend.call_schedule import Entry
from lowbitcc.backend.exact import Reduction, input_factor
from lowbitcc.backend.reductions import Reductions
from lowbitcc.codec import cuda, wire
from lowbitcc.counters import Stats
from lowbitcc.feedback import FeedbackStore
from tests.support.cuda_trace import GpuWork, meta_plan


def test_the_innermost_block_wins_and_each_restores_what_it_found():
    assert policy.mode("backward") == "backward"
    with lowbitcc.compressed():
        assert policy.forced()
        with lowbitcc.exact():
            assert policy.mode("backward") == "never" and not policy.forced()
            with pytest.raises(KeyError), lowbitcc.compressible():
                assert policy.mode("backward") == "auto"
                raise KeyError
            assert policy.mode("backward") == "never"
        assert policy.mode("backward") == "always"
    assert policy.mode("backward") == "backward" and not policy.forced()


def test_leaving_a_block_restores_the_block_around_it_when_an_outer_one_is_the_same():
    with lowbitcc.exact(), lowbitcc.compressed():
        with lowbitcc.exact():
            assert policy.mode("backward") == "never"
        assert policy.mode("backward") == "always"
        with lowbitcc.feedback_key("k"), lowbitcc.feedback_key("k"):
            assert policy.explicit_key() == "k"
        assert policy.explicit_key() is None
    assert policy.mode("backward") == "backward"


def test_a_feedback_key_block_names_its_calls_afresh_each_time_it_is_entered():
    block = lowbitcc.feedback_key("grad")
    for _ in range(2):
        with block:
            assert [policy.explicit_key() for _ in range(3)] == ["grad", "grad#1", "grad#2"]
            with lowbitcc.feedback_key("inner"):
                assert policy.explicit_key() == "inner"
            assert policy.explicit_key() == "grad#3"
    assert policy.explicit_key() is None


def test_blocks_work_as_decorators_and_start_afresh_on_every_call():
    @lowbitcc.feedback_key("step")
    @lowbitcc.exact()
    def keys() -> tuple[str, str | None, str | None]:
        return policy.mode("backward"), policy.explicit_key(), policy.explicit_key()

    assert keys() == keys() == ("never", "step", "step#1")
    assert policy.mode("backward") == "backward" and policy.explicit_key() is None


def test_a_feedback_key_needs_a_name():
    for name in ("", None, 3):
        with pytest.raises(ValueError, match="non-empty string"):
            lowbitcc.feedback_key(name)


@pytest.mark.parametrize("feedback", [False, True])
def test_a_planned_call_counts_in_a_feedback_key_block_with_or_without_feedback(feedback,
                                                                             monkeypatch):
    """The block's count is shared by every group: a call of a group without feedback, which
    needs no key of its own, still takes its turn (as its job would), so that another group's
    next call gets the same key whichever path ran this one."""
    monkeypatch.setattr(cuda, "_launch", lambda *args: None)
    monkeypatch.setattr(state, "FEEDBACK", FeedbackStore())
    monkeypatch.setattr(state, "STATS", Stats())
    plan, x, _ = meta_plan(GpuWork(), 2, 4096, "nvfp4", feedback=feedback)
    plan.group.key = lambda *args: (policy.explicit_key(), False)  # the group's own counts
    reductions = object.__new__(Reductions)  # what a steady call's run takes in issue order
    reductions._compressed = plan.group
    entry = Entry(wire.CallDescriptor("all_reduce", torch.float32, 0, 4096, 1, 4, 16, True), 63)
    entry.plan = plan
    with lowbitcc.feedback_key("g"):
        run = reductions._plan_run(entry, "all_reduce", x, dist.ReduceOp.SUM, None)
        assert policy.explicit_key() == "g#1"
        assert run.key == ("g" if feedback else "")
        run()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_input_factor_equals_the_reductions_own(world):
    R = dist.ReduceOp
    ops = [R.SUM, R.AVG, R.MAX, dist._make_nccl_premul_sum(0.25),
           dist._make_nccl_premul_sum(torch.tensor(2.0))]
    for op in ops + [dist.AllreduceOptions().reduceOp]:
        assert input_factor(op, world) == Reduction.of(op, world).input_factor(), op
    assert input_factor(R.AVG, world) == 1.0 / world
    assert input_factor(dist._make_nccl_premul_sum(0.25), world) == 0.25
