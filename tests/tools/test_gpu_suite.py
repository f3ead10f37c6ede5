"""`benchmarks/gpu_suite.sh` in its dry mode (no GPU: every phase's commands printed, a stand-in
writing what the phase would): one result line per phase with its planned seconds, the refusal
of a plan over the deadline, SKIP for a phase that no longer fits, and the usage; and
`benchmarks/gpu_suite_report.py`'s verdicts where a phase wrote nothing. A lent GPU machine runs
this script in calls of 10 minutes: a break found there costs a call."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_suite.sh"
RESULT = re.compile(r"^(PASS|FAIL|SKIP) (\S+)", re.M)


def _table() -> dict[str, int]:
    """The phases and their planned seconds, from the script's own table."""
    rows = re.findall(r"^#\| (\S+)\s+(\d+)\s", SCRIPT.read_text(), re.M)
    return {name: int(secs) for name, secs in rows}


PLANNED = _table()


def _suite(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items()
               if not k.endswith("_S") and not k.startswith("GPU_SUITE")}
    environ.update(OUT=str(tmp_path / "out"), PYTHON=sys.executable, **env)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=120, env=environ, cwd=tmp_path)


def _logs(tmp_path: Path) -> dict[str, str]:
    with tarfile.open(tmp_path / "out" / "logs.tar.gz") as tar:
        return {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}


def test_the_table_holds_every_phase_and_the_first_command_fits_the_deadline():
    assert list(PLANNED)[:3] == ["env", "frame", "plans"] and len(PLANNED) == 17
    assert PLANNED["env"] + PLANNED["plans"] + PLANNED["goals"] <= 540


def test_help_prints_the_usage_with_the_phases_and_their_planned_seconds(tmp_path):
    done = _suite(tmp_path, "--help")
    assert done.returncode == 0, done.stderr
    assert "Usage: bash benchmarks/gpu_suite.sh" in done.stdout
    for name, secs in PLANNED.items():
        assert re.search(rf"^{name}\s+{secs}\s", done.stdout, re.M), name
    assert not (tmp_path / "out").exists()  # nothing ran


def test_a_dry_run_of_the_default_phases_prints_one_result_line_each(tmp_path):
    done = _suite(tmp_path, GPU_SUITE_DRY="1")
    assert done.returncode == 0, done.stdout + done.stderr
    results = RESULT.findall(done.stdout)
    assert results == [("PASS", "env"), ("PASS", "plans"), ("PASS", "goals")], done.stdout
    for name in ("env", "plans", "goals"):
        line = re.search(rf"^PASS {name} .*$", done.stdout, re.M)[0]
        assert line.endswith(f"planned {PLANNED[name]}s)") and "(dry, took " in line, line
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert RESULT.findall(summary) == results
    logs = _logs(tmp_path)
    assert set(logs) == {"env.log", "plans.log", "goals.log", "goals.json"}
    assert re.search(r"would run: \S+ benchmarks/planned_call_goals.py .*--json \S+/goals.json",
                     logs["goals.log"])
    assert "env LOWBITCC_REQUIRE_GPU=1" in logs["plans.log"]


def test_a_dry_run_of_every_phase_passes_each_through_its_stand_in(tmp_path):
    done = _suite(tmp_path, "--dry", "all", GPU_SUITE_DEADLINE_S="100000")
    assert done.returncode == 0, done.stdout + done.stderr
    assert RESULT.findall(done.stdout) == [("PASS", name) for name in PLANNED], done.stdout
    logs = _logs(tmp_path)
    assert {f"{name}.log" for name in PLANNED} <= set(logs)
    for name in ("frame", "plans", "graphs", "hier", "places", "pytest", "schedule", "unfixed"):
        assert "LOWBITCC_REQUIRE_GPU=1" in logs[f"{name}.log"], name  # a GPU skip fails there
    assert " -n " not in logs["pytest.log"]  # no pytest-xdist in the test extra


def test_a_plan_over_the_deadline_is_refused_before_anything_runs(tmp_path):
    need = PLANNED["env"] + PLANNED["plans"] + PLANNED["goals"]
    done = _suite(tmp_path, "--dry", GPU_SUITE_DEADLINE_S=str(need - 1))
    assert done.returncode == 2
    assert f"refused: the plan needs {need}s" in done.stderr, done.stderr
    assert not RESULT.findall(done.stdout) and not (tmp_path / "out").exists()
    assert _suite(tmp_path, "--dry", "all").returncode == 2  # every phase: more than a call


def test_a_phase_that_no_longer_fits_what_is_left_is_skipped(tmp_path):
    # env's stand-in hangs (ignoring TERM): it is cut at its 1 s share and killed after the
    # grace, which leaves less than frame's planned second
    done = _suite(tmp_path, "--dry", "frame", GPU_SUITE_DEADLINE_S="2", ENV_S="1", FRAME_S="1",
                  GPU_SUITE_DRY_SLEEP="60")
    assert done.returncode == 1, done.stdout + done.stderr
    assert RESULT.findall(done.stdout) == [("FAIL", "env"), ("SKIP", "frame")], done.stdout
    assert re.search(r"^FAIL env .*cut at its 1s limit", done.stdout, re.M), done.stdout
    assert re.search(r"^SKIP frame \(needs 1s, 0s left\)$", done.stdout, re.M), done.stdout


def test_an_unknown_phase_or_planned_seconds_are_refused(tmp_path):
    assert _suite(tmp_path, "--dry", "plans", "nonesuch").returncode == 2
    assert _suite(tmp_path, "--dry", PLANS_S="2m").returncode == 2


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location(
        "gpu_suite_report", ROOT / "benchmarks" / "gpu_suite_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("phase", list(PLANNED))
def test_a_phase_that_wrote_nothing_fails_in_one_line(report, tmp_path, phase):
    line = report.verdict(phase, tmp_path, 124, 99)
    assert line.startswith(f"FAIL {phase} ") and "\n" not in line, line
    assert "cut at its 99s limit" in line, line


def test_a_missing_or_broken_json_is_named(report, tmp_path):
    (tmp_path / "exactperf.log").write_text("ERROR lowbitcc: 2 GPU ranks need a GPU, found 0\n")
    assert report.verdict("exactperf", tmp_path, 2, 120) == (
        "FAIL exactperf no exactperf.json: the phase wrote none (exited 2: ERROR lowbitcc: 2 GPU "
        "ranks need a GPU, found 0)")
    (tmp_path / "exactperf.json").write_text('{"rows": [{"backend": "nccl"}]}')
    line = report.verdict("exactperf", tmp_path, 0, 120)
    assert line.startswith("FAIL exactperf unreadable results (KeyError"), line
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite_report.py"),
                           "verdict", "codec", str(tmp_path), "0", "150"],
                          capture_output=True, text=True, timeout=60)
    assert done.stdout == "FAIL codec no codec.json: the phase wrote none (exited 0)\n"
    assert done.stderr == ""


def test_pytest_outcomes_are_counted_also_where_the_run_was_cut(report, tmp_path):
    ids = "tests/gpu/test_multirank.py::test_x[2 ranks on 1 GPU(s) sharing GPUs (NCCL_HOSTID per rank)]"
    cut = f"{ids} PASSED [ 33%]\n{ids}\nsome output\nFAILED [ 66%]\n{ids} "
    (tmp_path / "plans.log").write_text(cut)
    assert report.verdict("plans", tmp_path, 124, 210) == (
        "FAIL plans cut at its 210s limit after 1 passed, 1 failed, 0 skipped")
    (tmp_path / "plans.log").write_text(
        cut + "PASSED [100%]\nSKIPPED [1] tests/x.py:3: reason\n"
        "============ 2 passed, 1 failed, 1 skipped, 40 deselected in 66.14s (0:01:06) ======\n")
    assert report.verdict("plans", tmp_path, 1, 210) == (
        "FAIL plans 2 passed, 1 failed, 1 skipped")
    (tmp_path / "plans.log").write_text("=== 8 passed, 2 warnings in 27.67s ===\n")
    assert report.verdict("plans", tmp_path, 0, 210) == "PASS plans 8 passed, 0 failed, 0 skipped"
