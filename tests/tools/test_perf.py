"""`lowbitcc perf`: run the console tool on local ranks and check what it prints and writes."""

import json
import math
import subprocess
import sys

import pytest
import torch

from lowbitcc.tools.perf.collectives import COLLECTIVES
from lowbitcc.tools.perf.harness import _finite_calls
from lowbitcc.tools.perf.table import parse_table

BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
              "all_gather": lambda n: (n - 1) / n}
# one 4-bit call of an all-reduce: each of two quantizations errs by <= amax/(2*7) per element;
# data uniform in [-8, 8] (rms 4.62 per rank), amax <= 8 per rank and group
Q4_BOUND = {"all_reduce": lambda n: (8 * n / 7) / (4.62 * math.sqrt(n)),
            "reduce_scatter": lambda n: (8 * n / 14) / (4.62 * math.sqrt(n))}


def _perf(*args: str, timeout: int = 240) -> str:
    done = subprocess.run([sys.executable, "-m", "lowbitcc", "perf", *args], capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("collective,world", [
    ("all_reduce", 2),  # the others (about 15 s) under -m slow: the same table code
    pytest.param("reduce_scatter", 3, marks=pytest.mark.slow),
    pytest.param("all_gather", 3, marks=pytest.mark.slow)])
def test_table_columns_factors_and_errors(collective, world, tmp_path):
    out = _perf(collective, "--np", str(world), "-b", "384K", "-e", "1536K", "-f", "4",
                "-n", "2", "-w", "1", "--backend", "loco", "gloo", "gloo-bf16", "--bits", "4", "8",
                "--json", str(tmp_path / "r.json"))
    assert "#       size" in out and "busbw" in out and "# Avg bus bandwidth    :" in out
    rows = parse_table(out)
    assert {r["backend"] for r in rows} == {"loco4", "loco8", "gloo", "gloo-bf16"}
    assert len(rows) == 2 * 4  # 384K and 1536K, four backends
    factor = BUS_FACTOR[collective](world)
    for r in rows:
        for p in ("oop", "ip"):
            algbw, busbw, time_us = r[f"{p}_algbw"], r[f"{p}_busbw"], r[f"{p}_time"]
            assert busbw == pytest.approx(algbw * factor, abs=2e-3), r
            assert algbw == pytest.approx(r["size"] / (time_us * 1e-6) / 1e9, rel=0.01, abs=2e-3)
        assert r["count"] * 4 == r["size"] and r["type"] == "float"
    by = {(r["backend"], r["size"]): r for r in rows}
    for size in {r["size"] for r in rows}:
        assert by["gloo", size]["oop_error"] == 0 and by["gloo", size]["ip_error"] == 0
        if collective == "all_gather":  # exact on loco: nothing is compressed
            assert by["loco4", size]["oop_error"] == 0 and by["loco4", size]["ratio"] == 1.0
            continue
        loco4, loco8 = by["loco4", size], by["loco8", size]
        assert 0 < loco8["oop_error"] < loco4["oop_error"] < Q4_BOUND[collective](world)
        assert loco4["ip_error"] == pytest.approx(loco4["oop_error"], rel=0.05)
        # 4.25 bits per element: codes plus one fp32 scale per 128, plus headers
        assert 4.25 / 32 <= loco4["ratio"] < 4.6 / 32
        assert 0 < by["gloo-bf16", size]["oop_error"] < 2 ** -8
        assert by["gloo-bf16", size]["ratio"] == 0.5
    for r in rows:  # the calling thread's time besides codec and wire: loco's counted only
        if r["backend"].startswith("loco"):
            assert 0 < r["host"] < r["ip_time"], r
        else:
            assert math.isnan(r["host"]), r
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["nranks"] == world and result["collective"] == collective
    assert len(result["rows"]) == len(rows)
    for row in result["rows"]:
        assert (row["host_us"] is None) == (not row["backend"].startswith("loco")), row
        if row["backend"].startswith("loco") and row["ratio"] < 1:  # compressed: split by link
            # no node layout (LOCO_NODE_SIZE, LOCAL_WORLD_SIZE): every rank is on one node
            assert row["intra_node_bytes"] == row["wire_bytes"] > 0, row
            assert row["inter_node_bytes"] == 0, row
        elif not row["backend"].startswith("loco"):  # gloo's own calls are not split
            assert row["intra_node_bytes"] is None and row["inter_node_bytes"] is None, row
    for r in rows:
        assert math.isnan(r["across"]) or r["across"] == 0, r
    assert set(result["avg_busbw"]) == {"loco4", "loco8", "gloo", "gloo-bf16"}


@pytest.mark.slow
def test_a_three_bit_format_runs_at_three_bits(monkeypatch):
    # the format from the environment, the bits from --bits (at the default 4 the format is
    # invalid): 3-bit codes under NVFP4's scales, 0.78x the default's bytes on the wire
    monkeypatch.setenv("LOCO_FORMAT", "nvfp3")
    (row,) = parse_table(_perf("all_reduce", "--np", "2", "-b", "1M", "-e", "1M", "-n", "2",
                               "-w", "1", "--backend", "loco", "--bits", "3"))
    assert row["backend"] == "loco3" and 0.1 < row["ip_error"] < 0.3, row
    assert row["ratio"] == pytest.approx(0.110, abs=0.002), row


@pytest.mark.slow
def test_bad_arguments_are_reported():
    for args, message in ((["all_reduce", "--backend", "nope"], "unknown backend 'nope'"),
                          (["all_reduce", "-b", "1M", "-e", "1K"], "-b"),
                          (["all_reduce", "-d", "int7"], "unknown -d"),
                          (["all_reduce", "--backend", "mpi", "--np", "2", "-b", "1K", "-e", "1K"],
                           "mpiexec")):
        done = subprocess.run([sys.executable, "-m", "lowbitcc", "perf", *args],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode != 0
        assert message in done.stderr, done.stderr[-2000:]


def test_every_collective_has_a_bus_factor():
    assert set(COLLECTIVES) == set(BUS_FACTOR)
    for name, coll in COLLECTIVES.items():
        assert coll.bus_factor(4) == pytest.approx(BUS_FACTOR[name](4))


def test_several_schedules_run_side_by_side_and_bf16_averages():
    """One run (3 ranks): bf16 averaged, gloo's exact, and each schedule's compressed."""
    from lowbitcc.tools.perf.targets import expand

    assert expand(["loco", "gloo"], [4], ["direct", "ring"]) == ["loco4-direct", "loco4-ring", "gloo"]
    assert expand(["loco"], [4, 8], ["tree"]) == ["loco4", "loco8"]
    with pytest.raises(ValueError, match="unknown schedule 'star'"):
        expand(["loco"], [4], ["star"])
    out = _perf("all_reduce", "--np", "3", "-b", "256K", "-e", "256K", "-n", "1", "-w", "0",
                "-d", "bfloat16", "-o", "avg", "--backend", "gloo", "loco",
                "--schedule", "ring", "tree")
    rows = {r["backend"]: r for r in parse_table(out)}
    assert set(rows) == {"gloo", "loco4-ring", "loco4-tree"}
    assert all(r["type"] == "bfloat16" and r["redop"] == "avg" for r in rows.values())
    assert rows["gloo"]["oop_error"] == 0
    assert all(0 < rows[b]["oop_error"] < 0.3 for b in ("loco4-ring", "loco4-tree"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("world", [2, 3, 8])
def test_in_place_sums_are_restored_before_they_overflow(dtype, world):
    """The timed loop's in-place sums: the input (|x| <= 8) summed over ``world`` ranks that
    many calls in a row stays finite (a few more would not); calls that do not grow their
    buffer are never restored."""
    calls = _finite_calls(COLLECTIVES["all_reduce"], dtype, world, "sum")
    x = torch.full((1,), 8.0, dtype=dtype)
    for _ in range(calls):
        x = x * world
    assert calls >= 1 and bool(torch.isfinite(x).all())
    assert bool(torch.isinf(x * world ** 5).all())  # and not needlessly often
    assert _finite_calls(COLLECTIVES["all_reduce"], dtype, world, "avg") == 0
    assert _finite_calls(COLLECTIVES["all_gather"], dtype, world, "sum") == 0


class _Block:
    """A `harness._Timed` stand-in: records the blocks it is timed in."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def block(self, iters: int, warmup: int) -> None:
        self.log.append((self.name, iters, warmup))


def test_backends_are_timed_in_turn_in_rounds_whose_order_reverses():
    """`--rounds`: each run's -n calls split into blocks taken in turn with the others' (the
    order reversed every other round), its -w warm-up in the first round only; more rounds
    than calls give each call a round."""
    from lowbitcc.tools.perf import harness

    log: list = []
    runs = [_Block(name, log) for name in ("loco-out", "loco-in", "gloo-out", "gloo-in")]
    harness._interleaved(runs, harness.PerfOptions(iters=10, warmup=3, rounds=3))
    assert [name for name, _, _ in log] == (
        ["loco-out", "loco-in", "gloo-out", "gloo-in", "gloo-in", "gloo-out", "loco-in",
         "loco-out", "loco-out", "loco-in", "gloo-out", "gloo-in"])
    for run in runs:
        blocks = [(iters, warmup) for name, iters, warmup in log if name == run.name]
        assert blocks == [(4, 3), (3, 0), (3, 0)]
    log.clear()
    harness._interleaved(runs[:1], harness.PerfOptions(iters=2, warmup=1, rounds=4))
    assert log == [("loco-out", 1, 1), ("loco-out", 1, 0)]
