"""The cost model: its per-class schedule of suggestions, the GPU timings it is fed for CUDA
calls, and on real ranks that every rank follows rank 0's suggestion (a divergent choice would
be a collective mismatch), that forcing compression skips it, and that turning it off
compresses every call. (Its choice on CUDA calls: tests/gpu.)"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

import lowbitcc
from lowbitcc.backend.cuda_issue import StreamTimings
from lowbitcc.codec import wire
from lowbitcc.cost_model import MAX_GAP, CostModel
from tests.support.ranks import run_ranks

N = 70_000
NBYTES = 4 * N


def test_warmup_then_the_faster_path_then_exploration():
    model = CostModel(warmup=2, explore_every=4)
    first = [model.suggest("all_reduce", NBYTES) for _ in range(4)]
    assert [s.exact for s in first] == [False, False, True, True]
    assert all(s.explore for s in first)  # warm-up: no choice to keep yet
    cls = CostModel.size_class("all_reduce", NBYTES)
    assert cls == ("all_reduce", "cpu", NBYTES.bit_length() - 1)
    model.record(cls, True, 5.0, NBYTES)  # the first timing of a path is not kept
    assert model.table()[0]["exact_s_per_GB"] is None
    model.record(cls, True, 1.0, NBYTES)
    model.record(cls, False, 1.15, NBYTES)
    model.record(cls, False, 1.15, NBYTES)
    # compressed is 15% slower: exploring it costs 0.15 of a call, under 5% of 4 calls, so
    # it is retried every 4 calls
    steady = [model.suggest("all_reduce", NBYTES) for _ in range(8)]
    assert [s.exact for s in steady] == [True, True, True, False] * 2
    assert [s.explore for s in steady] == [False, False, False, True] * 2
    model.count(cls)  # a call that ran as its place's entry counts as a call of its class
    assert [model.suggest("all_reduce", NBYTES).exact for _ in range(3)] == [True, True, False]
    # another size class starts its own warm-up
    assert model.suggest("all_reduce", 64 * NBYTES).exact is False


def _timed_model(exact_s: float, compressed_s: float) -> CostModel:
    """A model (warm-up 1) whose "cuda" class has seen these timings, past its warm-up."""
    model = CostModel(warmup=1, explore_every=64)
    cls = CostModel.size_class("all_reduce", NBYTES, "cuda")
    for _ in range(2):  # the first timing of each path is not kept
        model.record(cls, True, exact_s, NBYTES)
        model.record(cls, False, compressed_s, NBYTES)
    assert [model.suggest("all_reduce", NBYTES, "cuda").exact for _ in range(2)] == [False, True]
    return model


def test_explorations_cost_at_most_a_twentieth_of_the_time():
    # compressed takes 31x: an exploration costs 30 exact calls, so one call in 600 explores
    # (30 / 600 = 5%), not one in explore_every
    model = _timed_model(1.0, 31.0)
    cls = CostModel.size_class("all_reduce", NBYTES, "cuda")
    first = model.suggest("all_reduce", NBYTES, "cuda")
    assert first.exact and not first.explore
    for _ in range(597):
        model.count(cls)
    assert model.suggest("all_reduce", NBYTES, "cuda").exact  # the 599th: not yet
    assert model.suggest("all_reduce", NBYTES, "cuda").exact is False  # the 600th: explores
    # and the gap is capped
    capped = _timed_model(1.0, 1e6)
    for _ in range(MAX_GAP - 1):
        assert capped.suggest("all_reduce", NBYTES, "cuda").exact
    assert capped.suggest("all_reduce", NBYTES, "cuda").exact is False


def test_device_types_are_separate_size_classes():
    model = CostModel(warmup=1)
    assert model.suggest("all_reduce", NBYTES, "cuda").exact is False  # cuda warm-up
    assert model.suggest("all_reduce", NBYTES).exact is False  # cpu's own warm-up
    assert {row["device"] for row in model.table()} == {"cpu", "cuda"}


class _FakeEvent:
    """A CUDA event as `StreamTimings` uses it: recorded at a host-set GPU clock, done once
    the GPU clock has passed it."""

    gpu_ms = 0.0  # what the fake GPU has executed up to
    host_ms = 0.0  # where the next recorded event falls

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None

    def record(self) -> None:
        self.at = _FakeEvent.host_ms

    def query(self) -> bool:
        assert self.at is not None
        return self.at <= _FakeEvent.gpu_ms

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert self.query() and end.query(), "elapsed_time on an unfinished event"
        return end.at - self.at


class _Recorder:
    def __init__(self) -> None:
        self.rows: list[tuple] = []

    def record(self, size_class, exact, seconds, nbytes) -> None:
        self.rows.append((size_class, exact, round(seconds, 6), nbytes))


def test_stream_timings_report_finished_calls_in_order_and_never_wait():
    timings, model = StreamTimings(event=_FakeEvent), _Recorder()
    _FakeEvent.gpu_ms = _FakeEvent.host_ms = 0.0
    for i, (begin, end) in enumerate([(0.0, 2.0), (2.0, 5.0), (5.0, 5.5)]):
        _FakeEvent.host_ms = begin
        start = timings.start()
        _FakeEvent.host_ms = end
        timings.stop(start, ("all_reduce", "cuda", 20), i % 2 == 0, 1 << 20)
    timings.harvest(model)  # nothing has run yet: nothing reported, nothing waited for
    assert model.rows == [] and len(timings) == 3
    _FakeEvent.gpu_ms = 5.2  # the GPU has passed the first two calls, not the third
    timings.harvest(model)
    assert model.rows == [(("all_reduce", "cuda", 20), True, 0.002, 1 << 20),
                          (("all_reduce", "cuda", 20), False, 0.003, 1 << 20)]
    _FakeEvent.gpu_ms = 9.0
    timings.harvest(model)
    assert model.rows[2:] == [(("all_reduce", "cuda", 20), True, 0.0005, 1 << 20)]
    assert len(timings) == 0


def test_stream_timings_with_a_model_hand_it_finished_calls_at_each_start():
    """The next timed call's start hands over what the GPU has passed, so nothing piles up."""
    model = _Recorder()
    timings = StreamTimings(event=_FakeEvent, model=model)
    _FakeEvent.gpu_ms = _FakeEvent.host_ms = 0.0
    for i in range(100):
        _FakeEvent.host_ms = float(i)
        start = timings.start()
        _FakeEvent.host_ms = i + 0.5
        timings.stop(start, ("all_reduce", "cuda", 20), False, 1 << 20)
        _FakeEvent.gpu_ms = i + 1.0  # the GPU keeps up
    assert len(timings) == 1 and len(model.rows) == 99


def test_a_call_costs_at_least_its_host_time():
    """A call queued behind busy work shows only its kernels' GPU time; the issuing thread
    still spent the host time enqueueing it."""
    timings, model = StreamTimings(event=_FakeEvent), _Recorder()
    _FakeEvent.gpu_ms = _FakeEvent.host_ms = 0.0
    start = timings.start()
    time.sleep(0.02)  # the host enqueues for 20 ms ...
    _FakeEvent.host_ms = 1.0  # ... work that takes the GPU 1 ms
    timings.stop(start, ("all_reduce", "cuda", 20), False, 1 << 20)
    _FakeEvent.gpu_ms = 2.0
    timings.harvest(model)
    ((_, _, seconds, _),) = model.rows
    assert 0.02 <= seconds < 1.0


def test_descriptors_that_differ_only_in_the_suggestion_describe_the_same_call():
    a = wire.CallDescriptor("all_reduce", torch.float32, 0, N, 3, 4, 128, True, False)
    b = wire.CallDescriptor.unpack(wire.CallDescriptor(
        "all_reduce", torch.float32, 0, N, 3, 4, 128, True, True, explore=True).pack())
    assert b.prefer_exact and b.explore and a != b and a.call() == b.call()


def _in_backward(issue: Callable[[], None], times: int) -> None:
    """Call ``issue`` ``times`` times from a hook during a backward pass (where the "backward"
    policy makes all-reduces compressible)."""
    w = torch.zeros(1, requires_grad=True)

    def hook(grad: torch.Tensor) -> None:
        for _ in range(times):
            issue()

    w.register_hook(hook)
    w.sum().backward()


def _seeded_run(rank: int, gloo, exact_fast: bool, issuer: str) -> tuple[int, int, bool]:
    """8 all-reduces from a backward hook on a group (of ``issuer``) whose model has seen, on
    rank 0, exact calls fast if ``exact_fast`` else compressed ones fast (rank 1 the
    opposite)."""
    group = dist.new_group(backend="loco",
                           pg_options=lowbitcc.LocoConfig(cost_model=True, issuer=issuer))
    cls = CostModel.size_class("all_reduce", NBYTES)
    fast_exact = exact_fast == (rank == 0)
    for _ in range(3):
        group.cost_model.record(cls, True, 1e-9 if fast_exact else 10.0, NBYTES)
        group.cost_model.record(cls, False, 10.0 if fast_exact else 1e-9, NBYTES)
    lowbitcc.reset_stats()
    values = torch.randn(N, generator=torch.Generator().manual_seed(rank))
    results = []

    def issue() -> None:
        t = values.clone()
        dist.all_reduce(t, group=group)
        results.append(t)

    _in_backward(issue, 8)
    expected = values.clone()
    dist.all_reduce(expected, group=gloo)
    stats = lowbitcc.stats()
    exact_after_warmup = all(torch.equal(t, expected) for t in results[group.cost_model.warmup:])
    return stats["compressed"]["calls"], stats["exact"]["model_exact"], exact_after_warmup


def _rank_zero_prefers_compressed(rank, world, gloo, issuer):
    return _seeded_run(rank, gloo, False, issuer)


@pytest.mark.parametrize("issuer", ["auto", "inline"])  # LOCO_ISSUER: worker, calling thread
def test_warm_up_exact_calls_do_not_hold_the_exact_choice(issuer):
    # w compressed, w exact (warm-up), then rank 0's choice, compressed, for the other 8 - 2w
    w = CostModel().warmup
    results = run_ranks(_rank_zero_prefers_compressed, 2, issuer)
    assert [r[:2] for r in results] == [(8 - w, w)] * 2


def _ranks_follow_rank_zero(rank, world, gloo, issuer):
    return _seeded_run(rank, gloo, True, issuer)


@pytest.mark.parametrize("issuer", ["auto", "inline"])
def test_every_rank_follows_rank_zeros_suggestion(issuer):
    # warm-up: w compressed, w exact; then rank 0 suggests exact and rank 1 compressed, and
    # both run the 8 - 2w remaining calls exact (bit for bit gloo's sum)
    w = CostModel().warmup
    assert run_ranks(_ranks_follow_rank_zero, 2, issuer) == [(w, 8 - w, True)] * 2


def _forced_and_off(rank, world, gloo):
    on = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(cost_model=True))
    off = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(cost_model=False))
    x = torch.randn(N)
    lowbitcc.reset_stats()
    with lowbitcc.compressed():
        for _ in range(6):
            dist.all_reduce(x.clone(), group=on)
    forced = lowbitcc.stats()
    lowbitcc.reset_stats()
    _in_backward(lambda: dist.all_reduce(x.clone(), group=off), 6)
    disabled = lowbitcc.stats()
    return (forced["compressed"]["calls"], forced["exact"]["model_exact"], len(on.cost_model.table()),
            disabled["compressed"]["calls"], disabled["exact"]["model_exact"])


def test_forcing_skips_the_model_and_turning_it_off_compresses_every_call():
    for row in run_ranks(_forced_and_off, 2):
        assert row == (6, 0, 0, 6, 0)


RENEWED_SUGGESTIONS = {3: (True, False), 5: (False, False), 7: (True, True)}
"""Rank 0's scripted suggestion (exact, explore) by the pass it is asked in (else compressed):
exact in the renewal of pass 3, compressed again in pass 5's, an exploration of the exact
path in pass 7's."""


def _renewed_choices(rank, world, gloo, issuer):
    """12 backward passes of one all-reduce under the call schedule (each place renewed every
    other run) on a group whose model suggests as `RENEWED_SUGGESTIONS` scripts on rank 0 and
    always exact on rank 1: per pass whether the call ran compressed, the exchanges calls made,
    and the results (rank 0 runs exact where rank 1's suggestion would say otherwise)."""
    from lowbitcc.backend import call_schedule
    from lowbitcc.cost_model import Suggestion
    from tests.support.exchanges import counting_exchanges

    call_schedule.REAGREE_EVERY = 2
    now = [0]

    def scripted(self, collective, nbytes, device="cpu", counts=True):
        exact, explore = RENEWED_SUGGESTIONS.get(now[0], (False, False)) if rank == 0 else (
            True, False)
        return Suggestion(exact, CostModel.size_class(collective, nbytes, device),
                          explore=explore)

    CostModel.suggest = scripted
    record, exact_timings = CostModel.record, []

    def counted(self, size_class, exact, seconds, nbytes):
        if exact:
            exact_timings.append(seconds)
        record(self, size_class, exact, seconds, nbytes)

    CostModel.record = counted
    group = dist.new_group(backend="loco",
                           pg_options=lowbitcc.LocoConfig(cost_model=True, issuer=issuer))
    seen = counting_exchanges()
    values = torch.randn(N, generator=torch.Generator().manual_seed(rank))
    compressed, exchanges, results = [], [], []
    for now[0] in range(12):
        before, exchanged = lowbitcc.stats()["compressed"]["calls"], len(seen)
        t = values.clone()
        _in_backward(lambda t=t: dist.all_reduce(t, group=group), 1)
        lowbitcc.end_step()
        compressed.append(lowbitcc.stats()["compressed"]["calls"] - before)
        exchanges.append(len(seen) - exchanged)
        results.append(t)
    dist.barrier(group=gloo)  # a timed CPU call's timing ends on gloo's thread
    return compressed, exchanges, results, len(exact_timings)


@pytest.mark.parametrize("issuer", ["auto", "inline"])
def test_a_renewal_switches_every_rank_to_rank_zeros_choice_at_the_same_run(issuer):
    # passes 0 and 1 exchange (the second closes the period); then the place's renewals
    # start at passes 2, 3, 5, 7 (where its entry has at most one run left) and passes 3, 5,
    # 7, 9 take them: exact at 5 and 6 (pass 3's suggestion), compressed at 7 and 8 (pass
    # 5's), one exact exploration at 9 (pass 7's), whose run starts the next renewal at once:
    # compressed again from 10
    ranks = run_ranks(_renewed_choices, 2, issuer)
    for compressed, exchanges, _, exact_timings in ranks:
        assert compressed == [1, 1, 1, 1, 1, 0, 0, 1, 1, 0, 1, 1], compressed
        assert exchanges == [1, 1] + [0] * 10, exchanges
        # the runs that took the model's exact choices (5, and the exploration at 9) are
        # timed for it, as the exchanges that chose them were (the worker also times one
        # exact run in 8 of its own)
        assert exact_timings >= 2, exact_timings
    for a, b in zip(ranks[0][2], ranks[1][2], strict=True):
        assert torch.equal(a, b)
