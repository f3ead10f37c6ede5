"""`benchmarks/planned_call_goals.py` on CPU tensors (its ``--device cpu`` check): every path it
times, the graph replay's included, runs on two local ranks and gets a row; the GPU's goal
lines say SKIP. A lent GPU machine runs this script in the suite's ``goals`` and ``graphs``
phases: a break here would cost a call there."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "planned_call_goals.py"


def test_planned_call_goals_times_every_path_on_cpu_tensors(tmp_path):
    out = tmp_path / "goals.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--sizes", "4096",
                           "--iters", "3", "--profiled", "1", "--graphs", "--host-profile", "2",
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = json.loads(out.read_text())
    assert len(ranks) == 2
    for rank in ranks:
        assert set(rank["rows"]) == {f"4096 {p}" for p in ("plan", "python", "eager",
                                                           "exact", "nccl", "graph")}
        for row in rank["rows"].values():
            assert row["host_us"] > 0 and row["time_us"] > 0 and row["allocations"] == 0
    assert done.stdout.count("SKIP goal-") == 4, done.stdout
    assert "SKIP graphs-host " in done.stdout, done.stdout  # no graphs on CPU tensors
    assert "SKIP records-host " in done.stdout, done.stdout  # nor host records
    assert "SKIP cpp-replay-host " in done.stdout, done.stdout
    assert "SKIP nccl-host " in done.stdout, done.stdout
    for path in ("plan", "exact", "nccl"):  # the host profiles, rank 0's
        assert f"host profile, rank 0, 4096 {path}:" in done.stdout, done.stdout
