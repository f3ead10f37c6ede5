"""The cost model: its per-class schedule of suggestions, and on real ranks that every rank
follows rank 0's suggestion (a divergent choice would be a collective mismatch), that forcing
compression skips it, and that turning it off compresses every call."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

import lowbitcc
from lowbitcc.codec import wire
from lowbitcc.cost_model import CostModel
from tests.support.ranks import run_ranks

N = 70_000
NBYTES = 4 * N


def test_warmup_then_the_faster_path_then_exploration():
    model = CostModel(warmup=2, explore_every=4)
    first = [model.suggest("all_reduce", NBYTES) for _ in range(4)]
    assert [s.exact for s in first] == [False, False, True, True]
    assert not any(s.settled for s in first)  # warm-up: no choice to keep yet
    cls = CostModel.size_class("all_reduce", NBYTES)
    model.record(cls, True, 5.0, NBYTES)  # the first timing of a path is not kept
    assert model.table()[0]["exact_s_per_GB"] is None
    model.record(cls, True, 0.001, NBYTES)
    model.record(cls, False, 1.0, NBYTES)
    model.record(cls, False, 1.0, NBYTES)
    steady = [model.suggest("all_reduce", NBYTES) for _ in range(8)]
    assert [s.exact for s in steady] == [True, True, True, False] * 2  # 1 in 4 explores
    assert [s.settled for s in steady] == [True, True, True, False] * 2
    # an agreed exact choice holds until the next exploration call
    assert model.until_explore(cls) == 3
    model.count(cls)
    assert model.until_explore(cls) == 2
    # another size class starts its own warm-up
    assert model.suggest("all_reduce", 64 * NBYTES).exact is False


def test_descriptors_that_differ_only_in_the_suggestion_describe_the_same_call():
    a = wire.CallDescriptor("all_reduce", torch.float32, 0, N, 3, 4, 128, True, False)
    b = wire.CallDescriptor.unpack(
        wire.CallDescriptor("all_reduce", torch.float32, 0, N, 3, 4, 128, True, True).pack())
    assert b.prefer_exact and a != b and a.call() == b.call()


def _in_backward(issue: Callable[[], None], times: int) -> None:
    """Call ``issue`` ``times`` times from a hook during a backward pass (where the "backward"
    policy makes all-reduces compressible)."""
    w = torch.zeros(1, requires_grad=True)

    def hook(grad: torch.Tensor) -> None:
        for _ in range(times):
            issue()

    w.register_hook(hook)
    w.sum().backward()


def _seeded_run(rank: int, gloo, exact_fast: bool) -> tuple[int, int, bool]:
    """8 all-reduces from a backward hook on a group whose model has seen, on rank 0, exact
    calls fast if ``exact_fast`` else compressed ones fast (rank 1 the opposite)."""
    group = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(cost_model=True))
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
    exact_after_warmup = all(torch.equal(t, expected) for t in results[2:])
    return stats["compressed"]["calls"], stats["exact"]["model_exact"], exact_after_warmup


def _rank_zero_prefers_compressed(rank, world, gloo):
    return _seeded_run(rank, gloo, exact_fast=False)


def test_warm_up_exact_calls_do_not_hold_the_exact_choice():
    # 2 compressed, 2 exact (warm-up), then rank 0's choice, compressed, for the other 4
    assert [r[:2] for r in run_ranks(_rank_zero_prefers_compressed, 2)] == [(6, 2), (6, 2)]


def _ranks_follow_rank_zero(rank, world, gloo):
    return _seeded_run(rank, gloo, exact_fast=True)


def test_every_rank_follows_rank_zeros_suggestion():
    # warm-up: 2 compressed, 2 exact; then rank 0 suggests exact and rank 1 compressed, and
    # both run the 4 remaining calls exact (bit for bit gloo's sum)
    assert run_ranks(_ranks_follow_rank_zero, 2) == [(2, 6, True), (2, 6, True)]


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
