"""``LOWBITCC_REQUIRE_GPU=1`` (`tests.support.require_gpu`): a GPU test that skips, in any way,
fails with its reason; without the switch it skips, and a test that is not a GPU test skips
either way. Checked on a small suite run by pytest in a subprocess, without a GPU."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support import require_gpu

pytest_plugins = ["pytester"]

ROOT = Path(__file__).parents[1]

MARKED = """
import pytest

@pytest.fixture
def cupy():
    pytest.skip("CuPy is missing (fixture)")

@pytest.mark.gpu
@pytest.mark.skipif(True, reason="CuPy is missing (skipif)")
def test_skipif():
    pass

@pytest.mark.gpu
def test_fixture(cupy):
    pass

@pytest.mark.gpu
def test_body():
    pytest.skip("CuPy is missing (body)")

@pytest.mark.gpu
def test_importorskip():
    pytest.importorskip("lowbitcc_no_such_module", reason="CuPy is missing (importorskip)")

@pytest.mark.gpu
class TestOnTheClass:
    def test_method(self):
        pytest.skip("CuPy is missing (class)")

@pytest.mark.parametrize("where", ["host", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_param(where):
    pytest.skip(f"CuPy is missing ({where})")

@pytest.mark.gpu
def test_runs():
    pass

@pytest.mark.gpu
@pytest.mark.xfail(reason="known")
def test_xfail():
    assert False

def test_not_about_the_gpu():
    pytest.skip("not about the GPU")
"""

IN_GPU_DIR = """
import pytest

def test_unmarked_in_gpu_dir():
    pytest.skip("CuPy is missing (tests/gpu)")
"""

MODULE_SKIPPED = """
import pytest

pytest.importorskip("lowbitcc_no_such_module", reason="CuPy is missing (module)")

def test_never_collected():
    pass
"""

# the tests that skip without the switch and fail with it, and the reason each names
REFUSED = {
    "tests/test_marked.py::test_skipif": "CuPy is missing (skipif)",
    "tests/test_marked.py::test_fixture": "CuPy is missing (fixture)",
    "tests/test_marked.py::test_body": "CuPy is missing (body)",
    "tests/test_marked.py::test_importorskip": "CuPy is missing (importorskip)",
    "tests/test_marked.py::TestOnTheClass::test_method": "CuPy is missing (class)",
    "tests/test_marked.py::test_param[cuda]": "CuPy is missing (cuda)",
    "tests/gpu/test_in_gpu_dir.py::test_unmarked_in_gpu_dir": "CuPy is missing (tests/gpu)",
    "tests/gpu/test_module_skipped.py": "CuPy is missing (module)",
}
KEPT = {"tests/test_marked.py::test_param[host]", "tests/test_marked.py::test_not_about_the_gpu"}


def _run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
         switch: str | None) -> pytest.RunResult:
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs a CUDA GPU\n")
    pytester.makepyfile(**{"tests/test_marked": MARKED, "tests/gpu/test_in_gpu_dir": IN_GPU_DIR,
                           "tests/gpu/test_module_skipped": MODULE_SKIPPED})
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # tests.support.require_gpu (pytester adds its dir)
    if switch is None:
        monkeypatch.delenv(require_gpu.SWITCH, raising=False)
    else:
        monkeypatch.setenv(require_gpu.SWITCH, switch)
    return pytester.runpytest_subprocess("-p", "tests.support.require_gpu", "-p", "no:cacheprovider",
                                         "-rA", "-vv", "--continue-on-collection-errors", "tests")


def _ids(result: pytest.RunResult, word: str) -> set[str]:
    """The ids the short summary reports as ``word`` (PASSED, SKIPPED, FAILED, ERROR, XFAIL)."""
    found = set()
    for line in result.outlines:
        if m := re.match(rf"{word} (\S+)", line):
            found.add(m.group(1))
    return found


def test_the_suite_registers_the_plugin(request: pytest.FixtureRequest):
    assert request.config.pluginmanager.has_plugin("tests.support.require_gpu")


@pytest.mark.parametrize("switch", [None, pytest.param("0", marks=pytest.mark.slow),
                                    pytest.param("", marks=pytest.mark.slow)])
def test_without_the_switch_gpu_tests_skip(pytester, monkeypatch, switch):
    result = _run(pytester, monkeypatch, switch)
    result.assert_outcomes(passed=1, skipped=10, xfailed=1)  # the module skipped: one
    assert require_gpu.SWITCH not in result.stdout.str()


def test_with_the_switch_a_skipped_gpu_test_fails_naming_its_reason(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, "1")
    out = result.stdout.str()
    # a skip in the call fails it; one in its setup (a mark, a fixture) is an error of the setup,
    # and so is a module of tests/gpu skipped as a whole, at its collection
    result.assert_outcomes(passed=1, skipped=2, xfailed=1, failed=5, errors=3)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert _ids(result, "FAILED") | _ids(result, "ERROR") == set(REFUSED)
    assert _ids(result, "ERROR") == {"tests/test_marked.py::test_skipif",
                                     "tests/test_marked.py::test_fixture",
                                     "tests/gpu/test_module_skipped.py"}
    for test_id, reason in REFUSED.items():
        assert f"LOWBITCC_REQUIRE_GPU=1: {test_id} skipped: {reason}" in out, test_id
    assert _ids(result, "PASSED") == {"tests/test_marked.py::test_runs"}
    assert _ids(result, "XFAIL") == {"tests/test_marked.py::test_xfail"}
    assert sum(line.startswith("SKIPPED") for line in result.outlines) == len(KEPT)
    assert "not about the GPU" in out and "CuPy is missing (host)" in out
