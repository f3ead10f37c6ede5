"""`tests/probes/device_runner_calls.py`: run the script on two local ranks and check what it
prints: a device runner serves every steady call, and leaves fewer Python calls than the Python
path (an exact call, the canary's; a compressed one, its run's, the place taken in C++)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from lowbitcc.backend import native

SCRIPT = Path(__file__).resolve().parents[2] / "tests" / "probes" / "device_runner_calls.py"


@pytest.mark.slow
@pytest.mark.skipif(native.load() is None, reason="the C++ module cannot be built here")
def test_a_device_runner_serves_every_steady_call_with_fewer_python_calls():
    done = subprocess.run([sys.executable, str(SCRIPT), "--calls", "20", "--elements", "4096"],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        found = {}
        for kind in ("exact", "compressed"):
            line = re.search(rf"rank {rank} {kind}: python (\S+) \(served 0\), device (\S+) "
                             r"\(served (\d+)\), cpu (\S+) \(served (\d+)\)", done.stdout)
            assert line is not None, done.stdout
            python, device, device_served, cpu, cpu_served = line.groups()
            assert int(device_served) == int(cpu_served) == 20, line.group(0)
            found[kind] = float(python), float(device), float(cpu)
        python, device, cpu = found["exact"]
        # torch's `dist.all_reduce` wrapper on every way; the device runner's canary beside it
        assert cpu <= device <= cpu + 4 < python, found
        python, device, cpu = found["compressed"]
        assert cpu < device <= python - 8, found  # the place taken in C++, the run Python's
