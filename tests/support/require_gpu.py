"""A pytest plugin, registered by ``tests/conftest.py``: with ``LOWBITCC_REQUIRE_GPU=1`` in the
environment a GPU test that skips fails instead, its report naming the reason it would have
skipped (``LOWBITCC_REQUIRE_GPU=1: <test id> skipped: <reason>``), so that a run on a GPU
machine lacking CUDA, NCCL or CuPy cannot pass with nothing run. Not a `LocoConfig` field, hence
not ``LOCO_``-prefixed (as ``LOWBITCC_BUILD_VERBOSE``).

A GPU test is one marked ``gpu`` (the mark on the test, its class or module, or on one of its
parameters) or one under ``<rootdir>/tests/gpu``. Every way of skipping is caught where it lands,
in the test's report: a ``skip``/``skipif`` mark, ``pytest.skip`` or ``pytest.importorskip`` in a
fixture or in the test (a failed setup is reported as an error, a failed call as a failure), and
a module under ``tests/gpu`` skipped as a whole (``allow_module_level``, a module-level
``importorskip``: an error collecting it). An expected failure (``xfail``) is left as it is; so is
every skip of a test that is not a GPU test, and everything without the switch."""

from __future__ import annotations

import os
from collections.abc import Generator
from pathlib import Path

import pytest

SWITCH = "LOWBITCC_REQUIRE_GPU"
GPU_DIR = Path("tests", "gpu")  # relative to the rootdir


def required() -> bool:
    """Whether the switch is on: ``LOWBITCC_REQUIRE_GPU`` is ``1`` (anything else is off)."""
    return os.environ.get(SWITCH) == "1"


def _under_gpu_dir(path: Path, config: pytest.Config) -> bool:
    return path.is_relative_to(config.rootpath / GPU_DIR)


def is_gpu_test(item: pytest.Item) -> bool:
    """Whether ``item`` is a GPU test: marked ``gpu`` (itself, a parent, or its parameter) or
    defined under ``<rootdir>/tests/gpu``."""
    return item.get_closest_marker("gpu") is not None or _under_gpu_dir(item.path, item.config)


def _reason(longrepr: object) -> str:
    """The reason of a skip's report: its longrepr is ``(path, line, "Skipped: <reason>")``."""
    message = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else longrepr
    return str(message).removeprefix("Skipped: ")


def _refused(nodeid: str, longrepr: object) -> str:
    return f"{SWITCH}=1: {nodeid} skipped: {_reason(longrepr)}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport,
                                                                         pytest.TestReport]:
    """A GPU test's skipped report (setup, call or teardown) becomes a failed one under the
    switch; every other report is left as it is."""
    report = yield
    if report.skipped and not hasattr(report, "wasxfail") and required() and is_gpu_test(item):
        report.outcome = "failed"
        report.longrepr = _refused(item.nodeid, report.longrepr)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, pytest.CollectReport,
                                                                          pytest.CollectReport]:
    """A module (or directory) under ``tests/gpu`` skipped as a whole at collection becomes an
    error collecting it under the switch (its tests' marks are unknown then: a module skipped
    elsewhere is left as it is)."""
    report = yield
    if report.skipped and required() and _under_gpu_dir(collector.path, collector.config):
        report.outcome = "failed"
        report.longrepr = _refused(collector.nodeid, report.longrepr)
    return report
