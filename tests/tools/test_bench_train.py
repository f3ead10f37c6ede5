"""`lowbitcc bench-train`: every scheme trains side by side and lands in the table and JSON;
bad options are refused by name. (Speed is measured by running it, never asserted.)"""

import json
import math
import subprocess
import sys

import pytest
import torch

from lowbitcc.tools import cli
from lowbitcc.tools.bench_train import CONFIGS, PHASES, default_schemes
from lowbitcc.tools.study.model import TinyGPT
from tests.support.ranks import clean_env


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lowbitcc", "bench-train", *args],
                          capture_output=True, text=True, timeout=300, env=clean_env())


@pytest.mark.slow  # about 13 s; with `-m slow`
def test_every_scheme_trains_and_is_reported(tmp_path):
    done = _bench("--config", "quick", "--steps", "3", "--warmup", "1",
                  "--json", str(tmp_path / "b.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "b.json").read_text())
    rows = {r["scheme"]: r for r in report["rows"]}
    assert list(rows) == list(default_schemes("cpu")) and report["world"] == 2
    for scheme, r in rows.items():
        assert scheme in done.stdout
        assert r["step_ms"] > 0 and math.isfinite(r["final_loss"]), r
        assert r["bytes"] == "estimate"  # no GLOO_SOCKET_IFNAME here: nothing to count on
        phases = r["phases_ms"]
        assert list(phases) == list(PHASES) and phases["forward"] > 0 < phases["backward"], r
        # the mean rank's phases fit in the step, which is the slowest rank's
        step = phases["forward"] + phases["backward"] + phases["optimizer"]
        assert step <= r["step_ms"] * 1.001, r
        if scheme not in ("loco", "fsdp2-loco"):
            assert phases["codec"] == phases["wire"] == 0, r
    assert "phases, ms per step" in done.stdout
    assert rows["local"]["bytes_per_step"] == 0
    assert all(r["bytes_per_step"] > 0 for s, r in rows.items() if s != "local")
    # the same initial model and batches: three small steps leave every scheme near the rest
    losses = [r["final_loss"] for r in rows.values()]
    assert max(losses) - min(losses) < 0.1, losses


@pytest.mark.slow  # a benchmark's second configuration (about 9 s)
def test_bf16_models_train_and_their_exact_bytes_are_halved(tmp_path):
    done = _bench("--config", "quick", "--steps", "3", "--warmup", "1", "--dtype", "bf16",
                  "--schemes", "gloo", "loco", "--json", str(tmp_path / "b.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["options"]["dtype"] == "bf16" and "bf16" in done.stdout
    rows = {r["scheme"]: r for r in report["rows"]}
    assert all(math.isfinite(r["final_loss"]) for r in rows.values()), rows
    params = sum(p.numel() for p in TinyGPT(CONFIGS["quick"]).parameters())
    assert rows["gloo"]["bytes_per_step"] == 2 * (2 - 1) / 2 * 2 * params  # a bf16 ring's


def _refused(capsys, caplog, *args: str) -> str:
    """`lowbitcc bench-train` in this process (refusals come before any rank starts): its exit
    code must be 2; what it said."""
    caplog.clear()
    try:
        code = cli.main(["bench-train", *args])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    assert code == 2, args
    return capsys.readouterr().err + caplog.text


def test_unknown_schemes_and_configs_are_refused_by_name(capsys, caplog):
    assert "nccl-magic" in _refused(capsys, caplog, "--schemes", "gloo", "nccl-magic",
                                    "--steps", "2", "--warmup", "0")
    assert "warmup < steps" in _refused(capsys, caplog, "--steps", "2", "--warmup", "2")
    assert "fp8" in _refused(capsys, caplog, "--dtype", "fp8", "--steps", "2", "--warmup", "0")
    assert "nccl does not run on cpu tensors" in _refused(
        capsys, caplog, "--schemes", "nccl", "loco", "--steps", "2", "--warmup", "0")
    if not torch.cuda.is_available():
        assert "needs a GPU" in _refused(capsys, caplog, "--device", "cuda", "--steps", "2",
                                         "--warmup", "0")


def test_each_device_has_its_exact_baseline():
    assert "gloo" in default_schemes("cpu") and "nccl" not in default_schemes("cpu")
    assert "nccl" in default_schemes("cuda") and "gloo" not in default_schemes("cuda")
    assert default_schemes("cpu")[2:] == default_schemes("cuda")[2:]
