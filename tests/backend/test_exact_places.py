"""Every reduction has a place in the call schedule, exact ones included: in steady
state no call exchanges a descriptor, through the worker or inline; a rank whose exact call
deviates makes every rank raise, never hang, and the group goes on; ranks that all deviate
alike go on without an error. Calls outside backward are exact (the policy), so these are
the calls a user who keeps "loco" exact pays for."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.distributed as dist

import lowbitcc
from lowbitcc.backend import native
from lowbitcc.backend.call_agreement import CollectiveMismatchError
from lowbitcc.backend.deviated_output import PROBE
from tests.support.device_runners import cpu_device_runner
from tests.support.exchanges import counting_exchanges, counting_renewals
from tests.support.ranks import run_ranks

ISSUERS = ["auto", "inline"]
F32, SUM = torch.float32, dist.ReduceOp.SUM
STEADY = [(100_000, F32, SUM), (3000, F32, SUM), (1000, F32, dist.ReduceOp.AVG), (10, F32, SUM)]
"""A step's calls: (elements, dtype, op); 10 floats travel in the descriptor frame through the
worker while the place agrees."""


def _steps(rank, world, gloo, issuer, plan, compressed=False, uneven=(), device="cpu",
           async_op=False, on_group=None):
    """Steps of exact calls (``compressed``: forced compression) on a loco group of ``issuer``:
    ``plan(rank, step)`` gives the step's calls (None: stop). Returns per step the exchanges,
    per call its outcome ("ok", "mismatch", "nan": NaN but the first `PROBE` elements, "some
    nan"), and the results of the steps without an error against gloo's (bitwise, or close for
    compressed calls); steps in ``uneven`` (where ranks' calls differ) have no reference.
    ``device`` "cuda": the tensors live on the rank's GPU (tests/gpu/test_multirank.py).
    ``async_op``: each call asynchronous, then waited for; ``on_group(group)`` is called with
    the group once made."""
    if device == "cuda":
        from lowbitcc.tools import spawn

        device = spawn.gpu_device(rank)
    group = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(issuer=issuer))
    if on_group is not None:
        on_group(group)
    seen = counting_exchanges()
    gen = torch.Generator().manual_seed(rank)
    exchanges, outcomes, same = [], [], []
    step = 0
    while (calls := plan(rank, step)) is not None:
        before = len(seen)
        got, want, row = [], [], []
        for numel, dtype, op in calls:
            ref = torch.randn(numel, generator=gen).to(dtype)
            x = ref.to(device, copy=True)
            try:
                with lowbitcc.compressed() if compressed else contextlib.nullcontext():
                    work = dist.all_reduce(x, op=op, group=group, async_op=async_op)
                if async_op:
                    work.wait()
                # a deviation's buffer is NaN but for its first few (probed) elements
                nans = int(torch.isnan(x).sum())
                row.append("ok" if not nans else "nan" if nans >= numel - PROBE else "some nan")
            except CollectiveMismatchError:
                row.append("mismatch")
            if step not in uneven:
                dist.all_reduce(ref, op=op, group=gloo)
            got.append(x.cpu())
            want.append(ref)
        lowbitcc.end_step()
        exchanges.append(len(seen) - before)
        outcomes.append(row)
        close = (lambda a, b: float((a - b).norm() / b.norm()) < 0.2) if compressed else (
            lambda a, b: torch.allclose(a, b, rtol=0, atol=1e-5))
        same.append(all(close(a, b) for a, b in zip(got, want)) if set(row) == {"ok"} else None)
        step += 1
    return exchanges, outcomes, same


def _steady(rank, step):
    return STEADY if step < 6 else None


@pytest.mark.parametrize("issuer", ISSUERS)
@pytest.mark.parametrize("world", [2, 3])
def test_exact_calls_exchange_no_descriptor_in_steady_state(world, issuer):
    for exchanges, outcomes, same in run_ranks(_steps, world, issuer, _steady, timeout=120):
        # step 0 agrees on every call; step 1's first call, agreed equal to step 0's, closes
        # the period; from then on every call runs as its place's exact entry
        assert exchanges == [len(STEADY), 1, 0, 0, 0, 0], exchanges
        assert all(set(row) == {"ok"} for row in outcomes) and all(same), (outcomes, same)


COMPRESSED = [(100_000, F32, SUM), (70_000, F32, SUM)]


def _compressed_steps(rank, step):
    return COMPRESSED if step < 5 else None


@pytest.mark.parametrize("issuer", ISSUERS)
def test_compressed_calls_exchange_no_descriptor_in_steady_state(issuer):
    results = run_ranks(_steps, 3, issuer, _compressed_steps, True, timeout=120)
    for exchanges, _, same in results:
        assert exchanges == [2, 1, 0, 0, 0], exchanges
        assert all(same), same


def _reagree_every_two(rank, world, gloo, issuer):
    from lowbitcc.backend import call_schedule

    call_schedule.REAGREE_EVERY = 2
    renewed = counting_renewals()
    exchanges, outcomes, same = _steps(rank, world, gloo, issuer, _steady)
    return exchanges, renewed, outcomes, same


@pytest.mark.parametrize("issuer", ISSUERS)
def test_exact_places_agree_again_every_reagree_every_runs_in_the_background(issuer):
    for exchanges, renewed, outcomes, same in run_ranks(_reagree_every_two, 2, issuer):
        # no call exchanges after step 1: each place's entry is renewed every other run, in
        # the background (step 1 starts the renewals of the three entries step 0 left, step 2
        # that of the first call's, from step 1's exchange, and those of the three it took,
        # and so on: test_call_schedule), and the renewed entries run exact as before
        first, others = [STEADY[0][0]], [c[0] for c in STEADY[1:]]
        assert exchanges == [4, 1, 0, 0, 0, 0], exchanges
        assert renewed == others + first + others + first + others + first, renewed
        assert all(set(row) == {"ok"} for row in outcomes) and all(same), (outcomes, same)


def _one_group_of_one(rank, world, gloo, issuer):
    groups = [dist.new_group(backend="loco", ranks=[r], pg_options=lowbitcc.LocoConfig(
        issuer=issuer)) for r in range(world)]
    group = groups[rank]
    seen = counting_exchanges()
    x = torch.randn(100_000)
    want = x.clone()
    for _ in range(3):
        dist.all_reduce(x, group=group)
        dist.all_reduce(torch.ones(10), group=group)
        with lowbitcc.compressed():
            dist.all_reduce(torch.randn(100_000), group=group)
        lowbitcc.end_step()
    return len(seen), torch.equal(x, want)


@pytest.mark.parametrize("issuer", ISSUERS)
def test_a_group_of_one_rank_never_exchanges(issuer):
    assert run_ranks(_one_group_of_one, 2, issuer) == [(0, True)] * 2


DEVIATIONS = {  # what rank 1 issues in place of step 3's second call
    "size": (3000 + 64, F32, SUM),
    "dtype": (3000, torch.float64, SUM),
    "op": (3000, F32, dist.ReduceOp.MAX),
}


def _one_rank_deviates(how, rank, step):
    if step >= 9:
        return None
    if step == 3 and rank == 1:
        return [STEADY[0], DEVIATIONS[how], *STEADY[2:]]
    return STEADY


@pytest.mark.parametrize("how", list(DEVIATIONS))
@pytest.mark.parametrize("issuer", ISSUERS)
@pytest.mark.parametrize("world", [2, 3])
def test_an_exact_call_that_deviates_on_one_rank_raises_on_every_rank(world, issuer, how):
    """Rank 1 raises at once; the others' outputs of that call are NaN, which their Works read
    when it completes: they raise at that call too (`deviated_output`). The place's next run
    (step 4) reads the canary of the run before (`Entry.keep`) and runs as agreed; at the run
    after (step 5), the canary NaN, every rank exchanges, sees rank 1's report and raises; then
    the ranks agree anew and their results are gloo's again."""
    results = run_ranks(_steps, world, issuer, functools.partial(_one_rank_deviates, how),
                        False, (3,), timeout=120)
    for exchanges, outcomes, same in results:
        assert outcomes[3][1] == "mismatch", outcomes
        assert outcomes[5][1] == "mismatch", outcomes
        assert exchanges[4] == 0, exchanges
        assert [o for s in (0, 1, 2, 4, 6, 7, 8) for o in outcomes[s]] == ["ok"] * 7 * len(STEADY)
        assert same[4] and same[6] and same[7] and same[8], same
        assert exchanges[7:] == [1, 0], exchanges  # learned again


def _served_steps(rank, world, gloo, issuer, plan, uneven=(), device="cpu", async_op=False,
                  decline=0.0, compressed=False):
    """`_steps` (``async_op``: of asynchronous calls, each waited for; ``compressed``: forced
    compression) with the group's device runner, declining the share ``decline`` of its calls
    at random (the Python path's then),
    (`steady_runner.device_runner`): on "cuda" the group's own, which serves its CUDA
    tensors' exact entries; on "cpu" one made of "cpu" in place of the group's CPU runner (the
    same code, over the group's direct gloo group); and how many calls it served."""
    runners = []

    def swap(group):
        if device == "cpu":
            cpu_device_runner(group)
        if decline:
            group._device_runner.decline_at_random(decline, 1000 * world + rank)
        runners.append(group._device_runner)

    got = _steps(rank, world, gloo, issuer, plan, compressed, uneven, device, async_op, swap)
    return (*got, runners[0].served)


@pytest.mark.skipif(native.load() is None, reason="the C++ module cannot be built here")
@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("world", [2, 3])
def test_a_deviation_at_a_place_a_device_runner_serves_raises_on_every_rank(world, async_op):
    """As a CUDA group's device runner serves an exact all-reduce (on CPU here, the inline
    issuer's, `_served_steps`): rank 1 raises at once; the others' Works are the inner
    group's own, which read nothing, so their outputs are NaN; the place's next run (step 4)
    runs as agreed, and every rank raises at the run after it (step 5: the canary the runner
    kept); then the ranks agree anew, and the runner serves the places again."""
    plan = functools.partial(_one_rank_deviates, "size")
    results = run_ranks(_served_steps, world, "inline", plan, (3,), "cpu", async_op,
                        timeout=120)
    for rank, (exchanges, outcomes, same, served) in enumerate(results):
        assert outcomes[3][1] == ("mismatch" if rank == 1 else "nan"), outcomes
        assert outcomes[4][1] == "ok" and exchanges[4] == 0, (outcomes, exchanges)
        assert outcomes[5][1] == "mismatch", outcomes
        assert same[7] and same[8] and exchanges[8] == 0, (same, exchanges)
        # every steady call of the three SUM places (AVG is not gloo's own op: Python's)
        assert served >= 3 * 4, served


@pytest.mark.skipif(native.load() is None, reason="the C++ module cannot be built here")
def test_compressed_places_a_device_runner_takes_exchange_no_descriptor_in_steady_state():
    """The places of steady compressed calls taken by a device runner (of "cpu" here, the
    inline issuer's; tests/gpu/test_multirank.py's on CUDA), their runs `Reductions.run`'s: no
    descriptor exchanged after the agreement, results close to gloo's."""
    for exchanges, _, same, served in run_ranks(_served_steps, 2, "inline", _compressed_steps,
                                                (), "cpu", False, 0.0, True, timeout=120):
        assert exchanges == [2, 1, 0, 0, 0] and all(same), (exchanges, same)
        assert served >= 2 * 3, served  # two places, their steady runs


def _one_rank_forces_compression(rank, world, gloo, issuer):
    """9 steps of one exact 100,000-element all-reduce; at step 3 rank 1 issues it inside
    `lowbitcc.compressed()`: each step's outcome ("ok", "nan": some element NaN, "mismatch")."""
    group = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(issuer=issuer))
    outcomes = []
    for step in range(9):
        x = torch.full((100_000,), float(rank + 1))
        forced = step == 3 and rank == 1
        try:
            with lowbitcc.compressed() if forced else contextlib.nullcontext():
                dist.all_reduce(x, group=group)
            outcomes.append("nan" if torch.isnan(x).any() else "ok" if torch.equal(
                x, torch.full_like(x, world * (world + 1) / 2)) else "wrong")
        except CollectiveMismatchError:
            outcomes.append("mismatch")
        lowbitcc.end_step()
    return outcomes


@pytest.mark.parametrize("issuer", ISSUERS)
def test_a_compressed_block_on_one_rank_at_an_exact_place_deviates_like_another_call(issuer):
    """A `compressed()` block asks for the other path than the place's exact entry: on one rank
    only it is a deviation (all ranks alike would agree anew, compressed): that rank raises at
    once, the others at that call too (their outputs NaN, `deviated_output`), never returning
    NaN, and every rank raises at the place's run after next (the canary); then the results
    are gloo's again."""
    results = run_ranks(_one_rank_forces_compression, 2, issuer, timeout=120)
    for outcomes in results:
        assert outcomes[3] == "mismatch", outcomes
        assert outcomes[5] == "mismatch", outcomes
        assert [outcomes[s] for s in (0, 1, 2, 4, 6, 7, 8)] == ["ok"] * 7, outcomes


def _renewing_steps(rank, world, gloo, issuer, plan, uneven):
    """`_steps` with every place renewed every 4 runs (renewals pending at any step)."""
    from lowbitcc.backend import call_schedule

    call_schedule.REAGREE_EVERY = 4
    return _steps(rank, world, gloo, issuer, plan, False, uneven)


@pytest.mark.parametrize("issuer", ISSUERS)
def test_an_exact_deviation_at_a_place_with_a_pending_renewal_raises_on_every_rank(issuer):
    """As above with renewals pending when rank 1 deviates (step 3): the place's canary is
    NaN at step 5 (read one run behind), which takes its renewal first, then exchanges; every
    rank raises there, and the ranks go on in step (the call numbers of the calls that raised
    kept alike)."""
    results = run_ranks(_renewing_steps, 2, issuer, functools.partial(_one_rank_deviates, "size"),
                        (3,), timeout=120)
    for _, outcomes, same in results:
        assert outcomes[3][1] == "mismatch", outcomes
        assert outcomes[5][1] == "mismatch", outcomes
        assert [o for s in (0, 1, 2, 4, 6, 7, 8) for o in outcomes[s]] == ["ok"] * 7 * len(STEADY)
        assert same[4] and same[6] and same[7] and same[8], same


def _one_rank_calls_once_more(rank, step):
    if step >= 6:
        return None
    if step == 3 and rank == 0:
        return [STEADY[0], (500, F32, SUM), *STEADY[1:]]
    return STEADY


TIMEOUT_S = 3
"""The group timeout of `_until_an_error`'s calls (a healthy call here takes milliseconds)."""


def _until_an_error(rank, world, gloo, issuer, plan):
    """Issue ``plan``'s steps until a call raises, as a program would; the error's kind
    ("mismatch": `CollectiveMismatchError`; "timeout": a peer stopped calling) and step. Rank
    0, which deviates and raises first, stays alive past the others' timeout without calling
    (its exit would end their calls at once); the others raise last and linger a second."""
    import datetime
    import time

    linger = TIMEOUT_S + 2 if rank == 0 else 1

    group = dist.new_group(backend="loco", timeout=datetime.timedelta(seconds=TIMEOUT_S),
                           pg_options=lowbitcc.LocoConfig(issuer=issuer))
    step = 0
    while (calls := plan(rank, step)) is not None:
        for numel, dtype, op in calls:
            try:
                dist.all_reduce(torch.ones(numel, dtype=dtype), op=op, group=group)
            except CollectiveMismatchError:
                time.sleep(linger)
                return "mismatch", step
            except RuntimeError as exc:
                time.sleep(linger)
                timed_out = any(w in str(exc).lower() for w in ("timed out", "timeout"))
                return ("timeout" if timed_out else str(exc)), step
        lowbitcc.end_step()
        step += 1
    return "nothing", step


@pytest.mark.parametrize("issuer", ISSUERS)
def test_an_exact_call_on_one_rank_only_raises_on_every_rank_never_hangs(issuer):
    """Rank 0 issues one call more at step 3 and raises there (then stops calling, as a
    program would); rank 1's call that met rank 0's extra one has a NaN output, which its Work
    reads: it raises at that call too (`deviated_output`), not later (its next call that needs
    rank 0 would raise within the group's timeout, 3 s here, as over gloo)."""
    results = run_ranks(_until_an_error, 2, issuer, _one_rank_calls_once_more, timeout=60)
    assert results == [("mismatch", 3), ("mismatch", 3)], results


def _every_rank_calls_once_more(rank, step):
    if step >= 7:
        return None
    return [STEADY[0], (500, F32, SUM), *STEADY[1:]] if step == 3 else STEADY


@pytest.mark.parametrize("issuer", ISSUERS)
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_all_deviate_alike_at_an_exact_place_go_on_without_an_error(world, issuer):
    """Every rank adds a call at step 3 (a metric logged now and then): each deviates, finds
    that every rank did (the probed elements came back -0.0), and the ranks agree anew."""
    for exchanges, outcomes, same in run_ranks(_steps, world, issuer,
                                               _every_rank_calls_once_more, timeout=120):
        assert all(set(row) == {"ok"} for row in outcomes), outcomes
        assert all(same), same
        assert exchanges[5:] == [1, 0], exchanges


def _counted_steps(rank, world, gloo, issuer, steps):
    """The exact calls and bytes the statistics count over ``steps`` steps of `STEADY` (an AVG
    among them: gloo has no AVG, so its place's call is the issuer's ``exact_now`` one, not the
    inner group's own)."""
    group = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(issuer=issuer))
    before = lowbitcc.stats()["exact"]
    for _ in range(steps):
        for numel, dtype, op in STEADY:
            dist.all_reduce(torch.ones(numel, dtype=dtype), op=op, group=group)
        lowbitcc.end_step()
    after = lowbitcc.stats()["exact"]
    return after["calls"] - before["calls"], after["tensor_bytes"] - before["tensor_bytes"]


@pytest.mark.parametrize("issuer", ISSUERS)
def test_each_exact_call_is_counted_once_at_its_place(issuer):
    """Learning, agreeing and running at their places, every call of every step counts once in
    the statistics (an AVG at its place counted twice until 2026-11-28)."""
    steps = 40
    calls, nbytes = run_ranks(_counted_steps, 2, issuer, steps)[0]
    assert calls == steps * len(STEADY)
    assert nbytes == steps * sum(numel * dtype.itemsize for numel, dtype, _ in STEADY)


def _reduce_scatter_deviates(rank, world, gloo, issuer):
    """10 steps of an exact reduce-scatter (2 x 3000 floats) and an exact all-reduce, every
    place renewed every 4 runs; rank 1's reduce-scatter of step 4 is of 2 x 3064 floats. Per
    step and call: "ok", "nan" (some NaN in the output), "mismatch" (raised
    `CollectiveMismatchError`) or "deviated" (raised `DeviatedPeerError`); and whether the
    steps after the last error equal gloo's."""
    from lowbitcc.backend import call_schedule
    from lowbitcc.backend.call_agreement import DeviatedPeerError

    call_schedule.REAGREE_EVERY = 4
    group = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(issuer=issuer))
    gen = torch.Generator().manual_seed(rank)
    outcomes, same = [], []
    for step in range(10):
        row, equal = [], True
        per_rank = 3064 if step == 4 and rank == 1 else 3000
        inputs = [torch.randn(world * per_rank, generator=gen), torch.randn(100_000, generator=gen)]
        for i, x in enumerate(inputs):
            out = torch.empty(per_rank) if i == 0 else x
            try:
                if i == 0:
                    dist.reduce_scatter_tensor(out, x, group=group)
                else:
                    dist.all_reduce(x, group=group)
                row.append("nan" if torch.isnan(out).any() else "ok")
            except DeviatedPeerError:
                row.append("deviated")
            except CollectiveMismatchError:
                row.append("mismatch")
            if step != 4:
                ref = torch.empty(per_rank) if i == 0 else inputs[1].clone()
                if i == 0:
                    dist.reduce_scatter_tensor(ref, x, group=gloo)
                equal = equal and (i == 1 or torch.equal(ref, out))
        lowbitcc.end_step()
        outcomes.append(row)
        same.append(equal)
    return outcomes, same


@pytest.mark.parametrize("issuer", ISSUERS)
def test_a_deviation_at_an_exact_reduce_scatter_raises_on_every_rank_at_a_renewal(issuer):
    """A reduce-scatter's outputs differ between ranks, so its place has no canary: rank 1
    raises at once, rank 0 at that call too (its output NaN, `deviated_output`), and rank 1's
    report travels in its next place renewal (`lowbitcc.backend.renewal`), at whose place every rank raises
    `DeviatedPeerError` within a cycle; then the ranks agree anew and go on."""
    (out0, same0), (out1, same1) = run_ranks(_reduce_scatter_deviates, 2, issuer, timeout=120)
    assert out0[4][0] == "mismatch" and out1[4][0] == "mismatch", (out0, out1)
    raised = [s for s, row in enumerate(out0) if "deviated" in row]
    assert raised and raised == [s for s, row in enumerate(out1) if "deviated" in row], (
        out0, out1)
    assert 4 < raised[0] <= 8 and out0[raised[0]] == out1[raised[0]], (out0, out1)
    after = raised[0] + 1
    assert all(row == ["ok", "ok"] for row in out0[after:] + out1[after:]), (out0, out1)
    assert all(same0[after:]) and all(same1[after:]), (same0, same1)
