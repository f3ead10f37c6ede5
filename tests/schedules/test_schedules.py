"""Every schedule x transport (gloo, MPI) x world size 2..5: identical, bounded, with feedback;
a stalled or dead peer raises within the timeout; auto's choices."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lowbitcc
from lowbitcc.backend.routes import choose_schedule
from lowbitcc.transports import topology
from tests.support.ranks import clean_env, run_ranks, run_script_ranks
from tests.support.schedule_checks import check_schedules, failures

ROOT = Path(__file__).parents[2]
MPIEXEC = shutil.which("mpiexec")


def _mpi_ready() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return MPIEXEC is not None


needs_mpi = pytest.mark.skipif(not _mpi_ready(), reason="needs mpi4py and mpiexec "
                               "(pip install 'lowbitcc[mpi]')")


@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow),
                                   pytest.param(5, marks=pytest.mark.slow)])
def test_schedules_over_gloo(world):
    for rank, cases in enumerate(run_ranks(check_schedules, world, "gloo", timeout=300)):
        assert len(cases) == 4 * 12, len(cases)
        assert failures(cases) == [], (rank, failures(cases))


@needs_mpi
@pytest.mark.parametrize("world", [2, pytest.param(5, marks=pytest.mark.slow)])  # 5: gloo above
def test_schedules_over_mpi(world):
    done = subprocess.run(
        [MPIEXEC, "-n", str(world), sys.executable, "-m", "tests.support.schedule_checks", "mpi"],
        capture_output=True, text=True, timeout=400, env=clean_env(), cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["cases"] == 4 * 12 and report["failures"] == [], report


def _stall(rank, world, gloo, schedule, dead):
    group = dist.new_group(backend="loco", timeout=datetime.timedelta(seconds=4),
                           pg_options=lowbitcc.LocoConfig(schedule=schedule, check=False,
                                                          policy="always", cost_model=False, min_size=1))
    if rank == world - 1:
        if dead:
            os._exit(0)
        time.sleep(8)  # past the others' 4 s timeout
        return None
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(100_000), group=group)
    except Exception as exc:  # noqa: BLE001
        return time.monotonic() - start, f"{type(exc).__name__}: {exc}"
    return time.monotonic() - start, "no error"


@pytest.mark.parametrize("schedule", ["direct", pytest.param("ring", marks=pytest.mark.slow),
                                      pytest.param("tree", marks=pytest.mark.slow)])
def test_stalled_peer_raises_within_the_timeout(schedule):
    results = run_ranks(_stall, 3, schedule, False, timeout=90)
    for elapsed, message in results[:-1]:
        assert message != "no error"
        assert elapsed < 4 + 6, (elapsed, message)


DEAD_PEER = r"""
import os, sys, time, datetime, torch, torch.distributed as dist, lowbitcc
dist.init_process_group("loco", timeout=datetime.timedelta(seconds=4), pg_options=lowbitcc.LocoConfig(
    schedule=sys.argv[1], check=False, policy="always", cost_model=False, min_size=1))
dist.barrier()
if dist.get_rank() == 2:
    os._exit(3)
start = time.monotonic()
try:
    dist.all_reduce(torch.ones(100_000))
    print("no error", flush=True)
except Exception as exc:
    print(f"raised after {time.monotonic() - start:.1f} s: {type(exc).__name__}", flush=True)
os._exit(0)
"""


@pytest.mark.parametrize("schedule", ["direct", "ring"])
def test_dead_peer_raises_on_the_others(schedule):
    ranks = run_script_ranks(DEAD_PEER, schedule, world=3, port=20000 + os.getpid() % 20000)
    assert ranks[2][0] == 3
    for code, out, err in ranks[:2]:
        assert code == 0 and out.startswith("raised after"), out + err[-2000:]
        assert float(out.split()[2]) < 4 + 6, out


STALL_MPI = r"""
import sys, time, datetime, torch, torch.distributed as dist, lowbitcc
dist.init_process_group("loco")
group = dist.new_group(backend="loco", timeout=datetime.timedelta(seconds=4),
                       pg_options=lowbitcc.LocoConfig(schedule="ring", transport="mpi",
                                                      check=False, policy="always", min_size=1))
if dist.get_rank() == 1:
    time.sleep(10)  # past rank 0's 4 s timeout, to the test's bound
else:
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(100_000), group=group)
        print("no error", flush=True)
    except Exception as exc:
        print(f"raised after {time.monotonic() - start:.1f} s: {exc}", flush=True)
import os; os._exit(0)
"""


@needs_mpi
def test_stalled_peer_over_mpi_raises_within_the_timeout():
    done = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-c", STALL_MPI],
                          capture_output=True, text=True, timeout=120, env=clean_env())
    line = [x for x in done.stdout.splitlines() if x.startswith(("raised", "no error"))]
    assert line and line[0].startswith("raised"), done.stdout + done.stderr[-2000:]
    assert "did not complete within 4 s" in line[0]
    assert float(line[0].split()[2]) < 4 + 6


def test_auto_picks_by_size_ranks_and_layout():
    cfg = lowbitcc.LocoConfig(schedule="auto", auto_tree_bytes=1 << 20, auto_tree_ranks=4,
                              auto_ring_ranks=16)
    one = topology.layout(range(8), 0, 0)
    two = topology.layout(range(8), 0, 4)
    assert choose_schedule(cfg, 1 << 10, 8, one) == "tree"
    assert choose_schedule(cfg, 1 << 10, 2, topology.layout(range(2), 0, 0)) == "direct"
    assert choose_schedule(cfg, 1 << 24, 8, one) == "direct"
    assert choose_schedule(cfg, 1 << 24, 16, topology.layout(range(16), 0, 0)) == "ring"
    assert choose_schedule(cfg, 1 << 10, 8, two) == "hierarchical"
    assert choose_schedule(cfg.replace(schedule="ring"), 1, 8, two) == "ring"


def test_node_layout():
    assert topology.layout(range(6), 4, 2) == topology.NodeLayout(3, 2, 2, 0)
    assert topology.layout([2, 3, 6, 7], 3, 2) == topology.NodeLayout(2, 2, 1, 1)
    assert not topology.layout([0, 1, 2], 0, 2).regular  # nodes of 2 and 1
    assert not topology.layout([0, 2, 1, 3], 0, 2).regular  # nodes interleaved
    assert topology.layout(range(4), 1, 0) == topology.NodeLayout(1, 4, 0, 1)
    assert topology.node_size_from(0, {"LOCAL_WORLD_SIZE": "8"}) == 8
    assert topology.node_size_from(2, {"LOCAL_WORLD_SIZE": "8"}) == 2
    assert topology.node_size_from(0, {}) == 0
    assert topology.same_node([2, 3, 6, 7], 1, 2) == [True, True, False, False]
    assert topology.same_node([2, 3, 6, 7], 2, 4) == [False, False, True, True]
    assert topology.same_node(range(3), 0, 0) == [True] * 3


def _irregular(rank, world, gloo):
    group = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(
        schedule="hierarchical", node_size=2, policy="always", cost_model=False, min_size=1))
    try:
        dist.all_reduce(torch.ones(1000), group=group)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_hierarchical_on_uneven_nodes_explains():
    for message in run_ranks(_irregular, 3):
        assert "hierarchical schedule needs the group's 3 ranks on equal nodes" in message


def _nothing(rank, world, gloo):
    return None


def test_mpi_transport_outside_mpiexec_explains():
    pytest.importorskip("mpi4py")
    with pytest.raises(RuntimeError, match="start the ranks with mpiexec"):
        run_ranks(_nothing, 2, pg_options=lowbitcc.LocoConfig(transport="mpi"), timeout=120)
