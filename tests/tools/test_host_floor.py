"""`tests/probes/host_floor.py`: run the script on two local ranks and check what it prints."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tests" / "probes" / "host_floor.py"


@pytest.mark.slow
def test_host_floor_replays_the_plans_calls_and_prints_both_ways_for_each_rank():
    done = subprocess.run([sys.executable, str(SCRIPT), "--calls", "100", "--rounds", "2"],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        line = re.search(rf"rank {rank}: host per call, 2 rounds of 100 \(us\): loco median "
                         r"(\S+) mean (\S+), floor median (\S+) mean (\S+); floor/loco medians "
                         r"(\S+)", done.stdout)
        assert line is not None, done.stdout
        loco, _, floor, _, share = (float(v) for v in line.groups())
        assert floor > 0 and loco > 0 and share == pytest.approx(floor / loco, abs=0.006)
