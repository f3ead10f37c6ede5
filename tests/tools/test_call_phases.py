"""`benchmarks/call_phases.py`: run the script on two local ranks and check what it prints."""

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "call_phases.py"


def test_call_phases_prints_every_phase_and_a_consistent_frontier():
    done = subprocess.run([sys.executable, str(SCRIPT), "--mib", "1", "--calls", "1"],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {}
    for line in done.stdout.splitlines():
        match = re.match(r"^\s*(\S.*?)\s{2,}(\d+\.\d+)(?:\s+(\d+\.\d+))?", line)
        if match:
            rows[match.group(1)] = float(match.group(2))
    assert "nvfp4 4-bit codes / 16" in done.stdout, done.stdout  # the default format
    for name in ("gloo all-reduce", "loco all-reduce", "codec (wall)", "waiting on the wire",
                 "other", "codec alone", "codes at gloo throughput", "codes in one all-gather",
                 "frontier max(alone, codes)"):
        assert name in rows, (name, done.stdout)
    assert rows["loco all-reduce"] > 0 and rows["codec (wall)"] > 0
    # each phase is part of the call (rows are each the slower rank's, so they need not add up)
    for name in ("codec (wall)", "waiting on the wire", "other"):
        assert rows[name] <= rows["loco all-reduce"] + 0.1, done.stdout
    assert rows["frontier max(alone, codes)"] == max(rows["codec alone"],
                                                     rows["codes at gloo throughput"])
    # 1 MiB of fp32 travels as ~0.133 of its bytes: 4.25 bits per element, plus headers
    sent = float(re.search(r"\((\d+\.\d+) MB sent per rank\)", done.stdout).group(1))
    assert 0.12 < sent / 1.048576 < 0.15, sent
