"""`lowbitcc demo`, the README's first command: it trains over both groups and says what the
cost model decided; behind emulated links (root) it runs a second time."""

import subprocess
import sys

import pytest
import torch

from lowbitcc.tools import demo, netem
from tests.support.ranks import clean_env


def _demo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lowbitcc", "demo", "--steps", "4",
                           "--width", "64", "--depth", "1", *args],
                          capture_output=True, text=True, timeout=300, env=clean_env())


def _runs(out: str) -> int:
    return out.count("quantization relative error")


def test_demo_on_loopback_reports_both_groups_and_the_cost_models_choice():
    done = _demo("--link", "none")
    assert done.returncode == 0, done.stderr[-3000:]
    assert _runs(done.stdout) == 1 and "emulated" not in done.stdout
    for line in ("loss gloo", "cost model:", "wire bytes per rank", "x gloo's speed"):
        assert line in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the demo uses it")
def test_demo_on_gpus_without_one_says_so():
    done = _demo("--link", "none", "--device", "cuda")
    assert done.returncode == 2 and "needs a GPU and torch with NCCL" in done.stderr
    assert not demo.uses_gpu("auto") and not demo.uses_gpu("cpu")


@pytest.mark.slow
@pytest.mark.skipif(bool(netem.missing_requirements()), reason="needs root, ip and tc")
def test_demo_runs_again_behind_an_emulated_link():
    done = _demo("--link", "1gbit")
    assert done.returncode == 0, done.stderr[-3000:]
    assert _runs(done.stdout) == 2 and "emulated 1gbit link" in done.stdout
    assert not netem.leftover_namespaces()
