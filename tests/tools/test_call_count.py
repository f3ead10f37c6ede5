"""Python calls per steady DDP bucket call beyond gloo's (`lowbitcc.tools.call_count`): a budget
that only goes down. Counted over 64 steps, one cycle of a place's agreement (its renewal's
calls included), on 2 real ranks."""

from __future__ import annotations

import pytest

from lowbitcc.tools.call_count import count_calls

BUDGET = {"compressed": 110, "exact": 50}
"""Python calls per bucket call beyond gloo's, on the default issuer (2026-11-28: 104 and 45;
244 and 71 before the steady call ran by its place's entry on every issuer)."""


@pytest.mark.parametrize("mode", sorted(BUDGET))
def test_a_steady_bucket_call_stays_within_its_python_call_budget(mode):
    counted = count_calls(mode, warmup=70, steps=64, by_function=True)
    assert 5 <= counted["gloo"] <= 40, counted  # DDP's own Python, the same on both groups
    assert counted["extra"] <= BUDGET[mode], counted
    # `lowbitcc calls --by-function`: every call counted is listed under its function
    functions = counted["functions"]
    assert abs(sum(functions.values()) - counted["loco"]) < 1e-6, functions
    assert functions["call_schedule.py:take [MainThread]"] == 1.0, functions
