"""`tests/probes/host_phases.py`: run the script on two local ranks and check what it prints."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tests" / "probes" / "host_phases.py"
PHASES = re.search(r"PHASES = \((.*?)\)\n", SCRIPT.read_text(), re.S).group(1)


@pytest.mark.slow
def test_host_phases_prints_every_phase_of_each_rank_and_they_add_up():
    done = subprocess.run([sys.executable, str(SCRIPT), "--calls", "200"],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        block = done.stdout.split(f"rank {rank}:")[1].split("rank ")[0]
        planned = int(re.match(r" (\d+) planned calls", block).group(1))
        assert 0 < planned <= 200, block
        phases = {p: float(re.search(rf"{re.escape(p)}\s+(-?\d+\.\d+) us", block).group(1))
                  for p in re.findall(r'"([^"]+)"', PHASES)}
        assert all(phases[p] > 0 for p in phases if p != "launch, no codec/wire")
        if planned < 200:  # the place's re-agreements
            assert f"{200 - planned} calls exchanged a descriptor" in block, block
