"""The wheel installs and works outside the checkout (`lowbitcc.tools.wheel_smoke`): slow
(about 2.5 minutes: a fresh venv, torch from its local wheel, the C++ codec built anew, the
demo); `pytest -m slow tests/tools/test_wheel.py`."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_wheel_installs_in_a_fresh_venv_and_runs_a_compressed_all_reduce_and_the_demo():
    if importlib.util.find_spec("build") is None:
        pytest.skip("needs the build package (pip install build)")
    done = subprocess.run([sys.executable, "-m", "lowbitcc.tools.wheel_smoke", "--demo"],
                          capture_output=True, text=True, timeout=1700)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    for check in ("install: ok", "import without autoload: ok", "autoload: ok",
                  "2-rank compressed all-reduce: ok", "demo: ok"):
        assert check in done.stdout, done.stdout
