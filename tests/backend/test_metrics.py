"""`lowbitcc.StepMetrics`: per-step scalars of a DDP run over "loco" on real ranks."""

from __future__ import annotations

import threading
import time

import torch
from torch import nn

import lowbitcc
from tests.support.ranks import run_ranks


def _steps(rank, world, gloo):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 512)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    metrics = lowbitcc.StepMetrics()
    rows = []
    for step in range(3):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank * 10 + step))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        rows.append(metrics.collect())
    rows.append(metrics.collect())  # nothing happened since
    lowbitcc.reset_stats()
    rows.append(metrics.collect())  # counted from the reset: nothing, not negative
    return rows


def test_step_metrics_count_each_step_once():
    for rows in run_ranks(_steps, 2, env={"LOCO_COST_MODEL": "0", "LOCO_MIN_SIZE": "4096"}):
        assert all(set(r) == set(rows[0]) and all(k.startswith("loco/") for k in r)
                   for r in rows)
        for r in rows[:3]:
            assert r["loco/compressed_calls"] >= 1
            assert 0 < r["loco/wire_mib"] < r["loco/logical_mib"]
            assert 0.05 < r["loco/compression"] < 0.3  # 4-bit codes and their scales
            assert 0 < r["loco/relative_error"] < 0.5
            assert r["loco/codec_ms"] > 0
        for r in rows[3:]:
            assert r["loco/compressed_calls"] == 0 and r["loco/wire_mib"] == 0
            assert r["loco/compression"] == 1.0 and r["loco/relative_error"] == 0.0


def test_an_accumulator_is_read_as_what_was_added_since_the_last_read():
    """`Stats.accumulator`: kernels add into one tensor per device for the process (on the CPU
    one per thread); each snapshot adds what arrived since the previous one, and a reset zeroes
    it (no new tensor per reset: users reset every step)."""
    from lowbitcc.counters import Stats

    stats = Stats()
    acc = stats.accumulator("compressed", torch.device("cpu"))
    assert stats.accumulator("compressed", torch.device("cpu")) is acc
    acc += torch.tensor([4.0, 16.0], dtype=torch.float64)
    comp = stats.snapshot()["compressed"]
    assert (comp["residual_sq"], comp["input_sq"], comp["relative_error"]) == (4.0, 16.0, 0.5)
    acc += torch.tensor([5.0, 9.0], dtype=torch.float64)
    comp = stats.snapshot()["compressed"]
    assert (comp["residual_sq"], comp["input_sq"]) == (9.0, 25.0)
    assert stats.snapshot()["compressed"]["residual_sq"] == 9.0
    stats.reset()
    assert stats.accumulator("compressed", torch.device("cpu")) is acc
    assert stats.snapshot()["compressed"]["residual_sq"] == 0.0
    acc += torch.tensor([1.0, 4.0], dtype=torch.float64)
    assert stats.snapshot()["compressed"]["relative_error"] == 0.5
    other: list[torch.Tensor] = []
    thread = threading.Thread(target=lambda: other.append(
        stats.accumulator("compressed", torch.device("cpu"))))
    thread.start()
    thread.join()
    assert other[0] is not acc
    other[0] += torch.tensor([2.0, 2.0], dtype=torch.float64)
    assert stats.snapshot()["compressed"]["residual_sq"] == 3.0


def test_a_run_tally_adds_a_call_once_at_its_flush():
    """`RunTally`: what a plan's run counts reaches the statistics only at `flush`, all of it,
    and the tally starts again."""
    from lowbitcc.counters import RunTally, Stats

    stats = Stats()
    tally = RunTally(stats)
    tally.add_call("compressed", 400, 200)
    tally.add_codec("compressed", 0.25)
    tally.add_sent("compressed", 0.5, 30, 70)
    tally.add_wire("compressed", 0.25)
    tally.accumulator("compressed", torch.device("cpu")).add_(
        torch.tensor([4.0, 16.0], dtype=torch.float64))  # as an encode adds its sums
    assert stats.snapshot()["compressed"]["calls"] == 0
    tally.flush()
    comp = stats.snapshot()["compressed"]
    assert {k: comp[k] for k in ("calls", "tensor_bytes", "logical_bytes", "codec_s", "wire_s",
                                 "wire_bytes", "intra_node_bytes", "inter_node_bytes",
                                 "residual_sq", "input_sq")} == {
        "calls": 1, "tensor_bytes": 400, "logical_bytes": 200, "codec_s": 0.25, "wire_s": 0.75,
        "wire_bytes": 100, "intra_node_bytes": 30, "inter_node_bytes": 70, "residual_sq": 4.0,
        "input_sq": 16.0}
    tally.flush()  # nothing more
    assert stats.snapshot()["compressed"]["calls"] == 1


def test_snapshots_from_several_threads_count_each_sum_once():
    """Readers of `Stats.snapshot` on several threads while an accumulator grows: every delta
    is added once (`snapshot` reads the accumulators one reader at a time). Each read of the
    last value seen is made slow, so that unlocked readers would overlap there."""
    from lowbitcc.counters import Stats

    class SlowReads(dict):
        def get(self, *args):
            seen = super().get(*args)
            time.sleep(0.002)  # another reader may read the same value meanwhile
            return seen

    stats = Stats()
    stats._read = SlowReads()
    acc = stats.accumulator("compressed", torch.device("cpu"))
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            stats.snapshot()

    readers = [threading.Thread(target=reader) for _ in range(3)]
    for thread in readers:
        thread.start()
    for _ in range(100):
        acc += 1.0
        time.sleep(0.001)
    stop.set()
    for thread in readers:
        thread.join()
    assert stats.snapshot()["compressed"]["residual_sq"] == 100.0
