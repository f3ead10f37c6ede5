"""`tests/probes/movement_calls.py`: run the script on two local ranks and check what it prints:
the runner serves every all-gather, broadcast, all-to-all, send and receive, whose Python calls
on every thread are then gloo's own, where the Python path's run on the group's worker and
waiter too."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from lowbitcc.backend import native

SCRIPT = Path(__file__).resolve().parents[2] / "tests" / "probes" / "movement_calls.py"


@pytest.mark.slow
@pytest.mark.skipif(native.load() is None, reason="the C++ module cannot be built here")
def test_served_data_movements_run_gloos_python_calls_on_every_thread():
    done = subprocess.run([sys.executable, str(SCRIPT), "--calls", "30", "--elements", "4096"],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        for collective in ("all_gather_into_tensor", "all_gather", "broadcast",
                           "all_to_all_single", "send_recv"):
            line = re.search(rf"rank {rank} {collective}: gloo (\S+), loco (\S+), python (\S+) "
                             r"\(served (\d+)\)", done.stdout)
            assert line is not None, done.stdout
            gloo, loco, python = (float(v) for v in line.groups()[:3])
            assert int(line.group(4)) == 30 * (2 if collective == "send_recv" else 1), (
                line.group(0))
            assert loco <= gloo < python - 20, line.group(0)
