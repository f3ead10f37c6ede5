"""The call schedule (`lowbitcc.backend.call_schedule`) at compressed places, inline (the CUDA
path's logic) and through the worker: calls agreed once run without a descriptor exchange,
the same as with one; a rank whose call deviates makes every
rank raise, never hang; ranks that all deviate alike agree again and go on."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import lowbitcc
from lowbitcc.backend import call_schedule
from lowbitcc.backend.call_agreement import CollectiveMismatchError
from tests.support.exchanges import counting_exchanges, counting_renewals
from tests.support.ranks import run_ranks

SIZES = [65536, 3 * 65536 + 5, 100_000]


def _backward_pass(issue) -> None:
    """Run ``issue()`` from a hook inside a backward pass (one epoch of positions)."""
    w = torch.zeros(1, requires_grad=True)
    w.register_hook(lambda grad: issue())
    w.sum().backward()


def _passes(rank, world, gloo, issuer, plan, reagree_every=None, device="cpu", per_call=False):
    """Backward passes on a loco group of ``issuer``, each all-reducing the tensors
    ``plan(rank, p)`` gives for pass ``p`` (sizes, or (size, dtype, op); None: stop); returns
    every result (as CPU tensors), the agreements per pass (the exchanges calls made, apart
    from the places' renewals, `lowbitcc.backend.renewal`), the errors raised (by pass: a
    call that raises ends its pass, or with ``per_call`` only itself, the pass's later calls
    still issued: where ranks raise at different calls, as on CUDA, the others' later calls
    need theirs) and the renewals started per pass. ``device`` "cuda": the tensors live on
    the rank's GPU (tests/gpu/test_multirank.py)."""
    if device == "cuda":
        from lowbitcc.tools import spawn

        device = spawn.gpu_device(rank)
    if reagree_every:
        call_schedule.REAGREE_EVERY = reagree_every
    group = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(
        cost_model=False, issuer=issuer))
    seen, renewed = counting_exchanges(), counting_renewals()
    gen = torch.Generator().manual_seed(rank)
    results, agreements, errors, renewals = [], [], {}, []
    p = 0
    while (sizes := plan(rank, p)) is not None:
        before, renewed_before = len(seen), len(renewed)
        calls = [c if isinstance(c, tuple) else (c, torch.float32, dist.ReduceOp.SUM)
                 for c in sizes]
        inputs = [torch.randn(n, generator=gen).to(dtype).to(device) for n, dtype, _ in calls]

        def issue(inputs=inputs, calls=calls, p=p):
            for x, (_, _, op) in zip(inputs, calls):
                try:
                    dist.all_reduce(x, op=op, group=group)
                except CollectiveMismatchError as exc:
                    if not per_call:
                        raise
                    errors.setdefault(p, str(exc))

        try:
            _backward_pass(issue)
        except CollectiveMismatchError as exc:
            errors[p] = str(exc)
        results.append([x.to("cpu", copy=True) for x in inputs])
        agreements.append(len(seen) - before)
        renewals.append(len(renewed) - renewed_before)
        p += 1
    return results, agreements, errors, renewals


def _same_passes(got, want) -> bool:
    """Whether two runs' results (per pass, per call) are the same bits."""
    return all(torch.equal(a, b) for pa, pb in zip(got, want) for a, b in zip(pa, pb))


def _inline_beside_worker(world, plan):
    """``_passes`` of ``plan`` on the inline path (schedule on) and on the worker (the
    reference): each rank's ``((results, agreements, errors, renewals), (reference results,
    ...))``."""
    inline = run_ranks(_passes, world, "inline", plan)
    return list(zip(inline, run_ranks(_passes, world, "auto", plan), strict=True))


def _steady(rank, p):
    return SIZES if p < 6 else None


@pytest.mark.parametrize("world", [2, 3])
def test_agreed_calls_run_without_an_exchange_and_equal_the_workers(world):
    ranks = _inline_beside_worker(world, _steady)
    for (results, agreements, errors, _), (ref, *_) in ranks:
        assert not errors
        # pass 0 agrees on every call; pass 1's first call, agreed equal to pass 0's, closes
        # the period; every later call runs as agreed
        assert agreements == [len(SIZES), 1, 0, 0, 0, 0], agreements
        assert _same_passes(results, ref)
    first = ranks[0][0][0]
    for (results, *_), _ in ranks[1:]:  # bitwise the same on every rank
        assert _same_passes(results, first)


@pytest.mark.parametrize("issuer", ["inline", "auto"])
def test_positions_agree_again_every_reagree_every_runs_in_the_background(issuer):
    ranks = run_ranks(_passes, 2, issuer, _steady, 2)
    for _, agreements, errors, renewals in ranks:
        assert not errors
        # pass 1 closes the period on its first call; from then on no call exchanges: each
        # place agrees again every other run, in a renewal that starts where its entry has
        # one run left or none (`renew_ahead`) and that the place's run after the entry's
        # last takes: pass 1's second and third calls start theirs (their entries, left by
        # pass 0, have one run), pass 2's first (from pass 1's exchange) and its second and
        # third, which took theirs, and so on
        assert agreements == [3, 1, 0, 0, 0, 0], agreements
        assert renewals == [0, 2, 3, 1, 2, 1], renewals
    assert _same_passes(ranks[0][0], ranks[1][0])  # bitwise the same on every rank


DEVIATIONS = {  # what rank 1 issues as the second call of pass 2
    "size": SIZES[1] + 64,
    "dtype": (SIZES[1], torch.bfloat16, dist.ReduceOp.SUM),
    "op": (SIZES[1], torch.float32, dist.ReduceOp.AVG),
}


def _one_rank_deviates(how, rank, p):
    if p >= 6:
        return None
    if p == 2 and rank == 1:
        return [SIZES[0], DEVIATIONS[how], SIZES[2]]
    return SIZES


@pytest.mark.parametrize("issuer", ["inline", "auto"])
@pytest.mark.parametrize("how", list(DEVIATIONS))
@pytest.mark.parametrize("world", [2, 3])
def test_a_call_that_deviates_on_one_rank_raises_on_every_rank_and_the_group_goes_on(world, how,
                                                                                    issuer):
    plan = functools.partial(_one_rank_deviates, how)
    results = run_ranks(_passes, world, issuer, plan, timeout=120)
    for _, agreements, errors, _ in results:
        assert list(errors) == [2], errors
        # pass 2 ended at its second call on every rank, so pass 3 starts a place late on
        # every rank alike: the ranks start their schedule again and learn it anew
        assert agreements[3:] == [len(SIZES), 1, 0], agreements
    later = [r[0][4] for r in results]  # pass 4 is the same call everywhere again
    for other in later[1:]:
        assert all(torch.equal(a, b) for a, b in zip(later[0], other))


def _every_rank_deviates(rank, p):
    if p >= 5:
        return None
    return SIZES if p < 2 else [SIZES[1], SIZES[0], SIZES[2]]  # a new bucket order from pass 2


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_that_all_deviate_alike_agree_again_without_an_error(world):
    for (got, agreements, errors, _), (want, *_) in _inline_beside_worker(world,
                                                                          _every_rank_deviates):
        assert not errors
        # pass 2: the first call deviates alike (probe, then agreed), the schedule starts
        # again, so its other two calls agree too; pass 3 closes the period on its first call
        assert agreements[2] == 3 and agreements[3:] == [1, 0], agreements
        assert _same_passes(got, want)


def _one_rank_calls_once_more(rank, p):
    if p >= 4:
        return None
    if p == 2 and rank == 0:
        return [SIZES[0], SIZES[0], SIZES[1], SIZES[2]]  # an extra call on rank 0 only
    return SIZES


@pytest.mark.parametrize("issuer", ["inline", "auto"])
def test_a_call_on_one_rank_only_raises_on_every_rank_never_hangs(issuer):
    results = run_ranks(_passes, 2, issuer, _one_rank_calls_once_more, timeout=120)
    for _, _, errors, _ in results:
        # the extra call deviates from the agreed second call: both ranks raise there, which
        # ends the pass on both; the next pass agrees again and is in step
        assert 2 in errors and 3 not in errors, errors


def test_ddp_join_with_uneven_inputs_completes_under_the_schedule():
    """The joined rank's shadow all-reduces run outside backward, in another epoch than the
    active rank's bucket all-reduces: places counted over the cycle of calls keep them paired
    (places counted per epoch left the joined rank exchanging while the other ran as agreed:
    stuck until the timeout)."""
    from tests.backend.test_faults import _join_uneven_inputs

    env = {"LOCO_ISSUER": "inline"}
    assert run_ranks(_join_uneven_inputs, 2, env=env, timeout=120) == [(True, True, True)] * 2


def _ddp_with_the_cost_model(rank, world, gloo, steps):
    """DDP over a loco group at its defaults (cost model on, call schedule on), two buckets,
    every place renewed every 8 runs: the exchanges and renewals per step, and the
    parameters after ``steps`` steps."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    call_schedule.REAGREE_EVERY = 8
    seen, renewed = counting_exchanges(), counting_renewals()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 256))
    ddp = DDP(model, bucket_cap_mb=0.25)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    exchanges, renewals = [], []
    for _ in range(steps):
        before, renewed_before = len(seen), len(renewed)
        loss = ddp(torch.randn(32, 256, generator=gen)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        exchanges.append(len(seen) - before)
        renewals.append(len(renewed) - renewed_before)
    return exchanges, renewals, torch.cat([p.detach().flatten() for p in model.parameters()])


def test_ddp_with_the_cost_model_exchanges_only_while_it_learns():
    """The cost model's warm-up exchanges at every call (3 compressed, 3 exact runs per size
    class); from then on rank 0's choices and explorations reach every rank through renewals,
    with no call exchanging, and the replicas stay equal."""
    (ex0, rn0, p0), (ex1, rn1, p1) = run_ranks(_ddp_with_the_cost_model, 2, 40, timeout=120)
    assert ex0 == ex1 and rn0 == rn1, (ex0, rn0, ex1, rn1)
    assert sum(ex0[:10]) > 0 and sum(ex0[10:]) == 0, ex0
    assert sum(rn0[10:]) >= 6, rn0
    assert torch.equal(p0, p1)


def _plain_loop(rank, world, gloo, issuer, pattern, compressed, steps):
    """``steps`` rounds of ``pattern`` (element counts) all-reduced in a plain loop: no backward
    pass, no optimizer step (nothing marks an epoch), ``compressed``: in a
    `lowbitcc.compressed` block. Returns the exchanges per round, whether every call's result
    equals gloo's (exact calls: bitwise; compressed: within the codec's error) and the errors."""
    group = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(
        cost_model=False, issuer=issuer))
    seen = counting_exchanges()
    gen = torch.Generator().manual_seed(rank)
    exchanges, close, errors = [], True, []
    block = lowbitcc.compressed if compressed else lowbitcc.exact
    for _ in range(steps):
        before = len(seen)
        for numel in pattern:
            x = torch.randn(numel, generator=gen)
            want = x.clone()
            try:
                with block():
                    dist.all_reduce(x, group=group)
            except CollectiveMismatchError as exc:
                errors.append(str(exc))
                continue
            dist.all_reduce(want, group=gloo)
            close &= (float((x - want).norm() / want.norm()) < 0.2 if compressed
                      else torch.equal(x, want))
        exchanges.append(len(seen) - before)
    return exchanges, close, errors


@pytest.mark.parametrize("issuer", ["auto", "inline"])
@pytest.mark.parametrize("pattern,compressed", [
    ((262_144,), True), ((100_000, 3000), False), ((70_000, 70_000, 70_000, 80_000), True)],
    ids=["one compressed call", "two exact calls", "a pattern that starts with repeats"])
def test_a_plain_loop_learns_its_period_from_the_calls_themselves(issuer, pattern, compressed):
    """A loop of all-reduces with no backward and no optimizer step (a benchmark, a user's own
    sync loop) reaches the steady state: no descriptor exchange once its calls have repeated
    their cycle a few times. Where the cycle begins with repeats (A A A B), the first guess
    (A, period 1) is wrong: every rank deviates alike at B, starts again without an error, and
    learns the cycle with more repeats."""
    steps = 40
    for exchanges, close, errors in run_ranks(_plain_loop, 2, issuer, pattern, compressed, steps):
        assert close and errors == [], (close, errors)
        assert sum(exchanges[-20:]) == 0, exchanges  # the steady state: renewals only
        assert sum(exchanges) <= 16 * len(pattern), exchanges


def _scheduled(rank, world, gloo, schedule, node_size, deviate_at=None, passes=8):
    """``passes`` backward passes of two compressed all-reduces and a compressed
    reduce-scatter on ``schedule`` (``node_size`` ranks per node; the worker issuer): the
    exchanges per pass, the passes that raised (`CollectiveMismatchError` or a wire error
    naming a foreign message), whether every pass without an error is close to gloo's sums, and
    the passes whose outputs were all finite. ``deviate_at``: the pass where the last rank's
    first all-reduce is 64 elements longer."""
    group = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(
        cost_model=False, schedule=schedule, node_size=node_size))
    seen = counting_exchanges()
    gen = torch.Generator().manual_seed(rank)
    exchanges, raised, close, finite = [], [], True, []
    for p in range(passes):
        longer = 64 * (p == deviate_at and rank == world - 1)
        xs = [torch.randn(n + longer * (i == 0), generator=gen)
              for i, n in enumerate((4 * 70_000, 3 * 65_536 + 8))]
        rs_in = torch.randn(world * 70_000, generator=gen)
        rs_out = torch.empty(70_000)
        wants = [x.clone() for x in xs] + [rs_in.clone()]
        before = len(seen)

        def issue(xs=xs, rs_in=rs_in, rs_out=rs_out, p=p):
            # a call that raises ends only itself: where ranks raise at different calls, the
            # others' later calls need theirs
            calls = [functools.partial(dist.all_reduce, x, group=group) for x in xs]
            calls.append(functools.partial(dist.reduce_scatter_tensor, rs_out, rs_in,
                                           group=group))
            for call in calls:
                try:
                    with lowbitcc.compressed():
                        call()
                except (CollectiveMismatchError, lowbitcc.codec.wire.WireFormatError):
                    if p not in raised:
                        raised.append(p)

        _backward_pass(issue)
        exchanges.append(len(seen) - before)
        if all(bool(t.isfinite().all()) for t in (*xs, rs_out)):
            finite.append(p)
        lowbitcc.end_step()
        if p not in raised and p != deviate_at:
            for want in wants:
                dist.all_reduce(want, group=gloo)
            got = [*xs, rs_out]
            wants[-1] = wants[-1].view(world, -1)[rank]
            close &= all(float((a - b).norm() / b.norm()) < 0.2 for a, b in zip(got, wants))
    return exchanges, raised, close, finite


@pytest.mark.parametrize("schedule,world,node_size", [
    ("hierarchical", 4, 2), ("ring", 3, 0), ("tree", 4, 0)], ids=["hierarchical 2x2", "ring",
                                                                  "tree"])
def test_every_schedule_runs_its_places_without_an_exchange(schedule, world, node_size):
    """Compressed entries of the ring, tree and hierarchical schedules keep their runs, as the
    direct schedule's: no descriptor exchange once the period is known (renewals aside)."""
    for exchanges, raised, close, _ in run_ranks(_scheduled, world, schedule, node_size,
                                                 timeout=240):
        assert raised == [] and close, (raised, close)
        assert exchanges[:2] == [3, 1] and exchanges[2:] == [0] * 6, exchanges


@pytest.mark.parametrize("schedule,world,node_size", [
    ("hierarchical", 4, 2), ("ring", 3, 0)], ids=["hierarchical 2x2", "ring"])
def test_a_deviation_off_the_direct_schedule_raises_on_every_rank(schedule, world, node_size):
    """A rank whose call is not its place's ring or hierarchical entry runs the entry on NaN in
    flagged messages and raises; the others raise at that call (a flagged message reached
    them) or, their outputs NaN, at the place's run after next (its canary, read one run
    behind); never a hang, never a silent result. Pass 5 runs as agreed on every rank."""
    for rank, (exchanges, raised, close, finite) in enumerate(
            run_ranks(_scheduled, world, schedule, node_size, 4, 10, timeout=240)):
        assert raised and raised[0] in (4, 6) and set(raised) <= {4, 6}, (rank, raised)
        assert 5 in finite, (rank, finite)
        assert 4 in raised or 4 not in finite, (rank, raised, finite)  # no silent result
        assert close, rank
        assert exchanges[-1] == 0, exchanges  # agreed anew, steady again
