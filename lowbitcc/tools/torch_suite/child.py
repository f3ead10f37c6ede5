"""One configuration's run of the suite, in its own process (started by `runner`).

``python -m lowbitcc.tools.torch_suite.child OUT.json NAME...`` (or ``OUT.json --list``: write
the names of all the suite's tests) imports `cases` with the
environment it was given (``LOWBITCC_SUITE_BACKEND``, ``WORLD_SIZE``, ``LOCO_*``),
runs the named tests of ``TestDistBackendWithSpawn`` one after the other, prints one line per
test (``name outcome seconds``, for the runner's progress bar) and writes
``{name: {"outcome", "detail", "seconds"}}`` to OUT.json. Outcomes: passed, failed, skipped.
"""

from __future__ import annotations

import json
import sys
import time
import unittest
from typing import Any


class _Recorder(unittest.TestResult):
    """Records each test's outcome and the last line of its error or skip reason."""

    def __init__(self) -> None:
        super().__init__()
        self.outcomes: dict[str, dict[str, Any]] = {}
        self._started = 0.0

    def startTest(self, test: unittest.TestCase) -> None:  # noqa: N802 (unittest's name)
        super().startTest(test)
        self._started = time.perf_counter()

    def _record(self, test: unittest.TestCase, outcome: str, detail: str = "") -> None:
        name = test.id().rsplit(".", 1)[-1]
        seconds = time.perf_counter() - self._started
        lines = [line for line in detail.strip().splitlines() if line.strip()]
        self.outcomes[name] = {"outcome": outcome, "detail": _summary(lines),
                               "seconds": round(seconds, 2)}
        print(f"{name} {outcome} {seconds:.1f}", flush=True)

    def addSuccess(self, test: unittest.TestCase) -> None:  # noqa: N802
        self._record(test, "passed")

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:  # noqa: N802
        self._record(test, "failed", self._exc_info_to_string(err, test))

    def addError(self, test: unittest.TestCase, err: Any) -> None:  # noqa: N802
        self._record(test, "failed", self._exc_info_to_string(err, test))

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:  # noqa: N802
        self._record(test, "skipped", reason)

    def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:  # noqa: N802
        self._record(test, "passed", "expected failure")

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:  # noqa: N802
        self._record(test, "failed", "unexpected success")


def _summary(lines: list[str]) -> str:
    """The most telling line of a traceback: the last exception line raised in a rank."""
    for line in reversed(lines):
        text = line.split("]", 1)[-1].strip() if line.startswith("[rank") else line.strip()
        if text and ("Error" in text or "Exception" in text or "exit code" in text):
            return text[:300]
    return lines[-1].strip()[:300] if lines else ""


def main(argv: list[str]) -> int:
    out, names = argv[0], argv[1:]
    from lowbitcc.tools.torch_suite import cases

    loader = unittest.TestLoader()
    if names == ["--list"]:
        with open(out, "w") as f:
            json.dump(list(loader.getTestCaseNames(cases.TestDistBackendWithSpawn)), f)
        return 0
    suite = unittest.TestSuite(loader.loadTestsFromName(name, cases.TestDistBackendWithSpawn)
                               for name in names)
    result = _Recorder()
    suite.run(result)
    with open(out, "w") as f:
        json.dump(result.outcomes, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
