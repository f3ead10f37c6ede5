"""`tests/probes/exact_issue.py`: run the script on two local ranks and check what it prints."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from lowbitcc.backend import native

SCRIPT = Path(__file__).resolve().parents[2] / "tests" / "probes" / "exact_issue.py"


@pytest.mark.slow
@pytest.mark.skipif(native.load() is None, reason="the C++ module cannot be built here")
def test_exact_issue_times_the_three_ways_and_the_runner_serves_its_calls():
    done = subprocess.run([sys.executable, str(SCRIPT), "--calls", "40", "--rounds", "2"],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        line = re.search(rf"rank {rank}: runner (\S+) \((\S+)x gloo\), python (\S+) \((\S+)x "
                         r"gloo\), gloo (\S+) \(1.00x gloo\); runner served (\d+)", done.stdout)
        assert line is not None, done.stdout
        runner, ratio, python, _, gloo, served = line.groups()
        assert float(runner) > 0 and float(python) > 0 and float(gloo) > 0
        # (the times are printed to 0.05 us, the ratio of the unrounded ones to 0.005)
        runner_us, gloo_us = float(runner), float(gloo)
        slack = 0.005 + runner_us / gloo_us * (0.05 / runner_us + 0.05 / gloo_us) * 1.01
        assert float(ratio) == pytest.approx(runner_us / gloo_us, abs=slack)
        assert int(served) > 40  # of the runner's 80 calls, all but the timed ones (1 in 8)
