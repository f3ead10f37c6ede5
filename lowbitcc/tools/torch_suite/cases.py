"""The test class of torch's distributed suite, bound to the backend under test.

Import contract: the environment names the backend under test in ``LOWBITCC_SUITE_BACKEND``
("gloo" or "loco", default "loco") and ``WORLD_SIZE`` as torch's driver does (torch's harness
sets ``TEMP_DIR`` for each test).
On import, the suite module is loaded with ``BACKEND=gloo``, so every gating decorator (which
reads ``BACKEND`` once, when the suite's classes are defined) selects the tests gloo runs; then
the suite's ``BACKEND`` becomes the backend under test's name as a `StandIn` (equal to "gloo"
too, for the branches the tests take at run time), so ``init_process_group`` and every default
``new_group`` create that backend's groups and the tests' checks of the name
(``dist.get_backend() == BACKEND.lower()``) compare against it. Tests that ask for gloo by name
(``new_group(backend="gloo")``) still get gloo.

The ranks are spawned processes that import this module by name, so it must stay importable as
``lowbitcc.tools.torch_suite.cases`` with the same environment (``LOWBITCC_SUITE_START``:
see `START_METHOD`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

SUITE_BACKEND = os.environ.setdefault("LOWBITCC_SUITE_BACKEND", "loco")
os.environ["BACKEND"] = "gloo"
os.environ.setdefault("WORLD_SIZE", "2")

import torch  # noqa: E402
from torch.testing._internal.distributed import distributed_test  # noqa: E402


class StandIn(str):
    """The name of the backend under test that equals "gloo" in comparisons: the suite's tests
    also branch on ``BACKEND == "gloo"`` when they run (e.g. to build a CPU model for DDP), and
    must take gloo's branch, while ``init_process_group(backend=BACKEND)``, ``BACKEND.lower()``
    and printing give the real name."""

    __hash__ = str.__hash__

    def __eq__(self, other: object) -> bool:
        return str.__eq__(self, other) is True or other == "gloo"

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)


distributed_test.BACKEND = StandIn(SUITE_BACKEND) if SUITE_BACKEND != "gloo" else "gloo"
os.environ["BACKEND"] = SUITE_BACKEND


START_METHOD = os.environ.get("LOWBITCC_SUITE_START", "forkserver")
"""How ranks start: "spawn" as torch's driver does, or "forkserver" (default): forked from a
server process that imported torch and the suite once, several times faster per test."""

ENVIRONMENT_SUFFIX = ".environ.json"


class TestDistBackendWithSpawn(distributed_test.TestDistBackend,
                               distributed_test.DistributedTest._DistTestBase):
    """torch's ``_DistTestBase`` tests, each run in ``WORLD_SIZE`` fresh rank processes."""

    def setUp(self) -> None:
        super().setUp()
        if START_METHOD == "spawn":
            self._spawn_processes()
            return
        # A forked rank inherits the server's environment, not this test's (TEMP_DIR and
        # INIT_METHOD are new per test): it reads this process's from beside the init file.
        Path(self.file_name + ENVIRONMENT_SUFFIX).write_text(json.dumps(dict(os.environ)))
        context = torch.multiprocessing.get_context(START_METHOD)
        context.set_forkserver_preload([__name__])
        self._start_processes(context.Process)

    def tearDown(self) -> None:
        Path(self.file_name + ENVIRONMENT_SUFFIX).unlink(missing_ok=True)
        super().tearDown()

    @classmethod
    def _run(cls, rank: int, test_name: str, file_name: str, pipe: Any, **kwargs: Any) -> None:
        saved = Path(file_name + ENVIRONMENT_SUFFIX)
        if saved.exists():
            os.environ.clear()
            os.environ.update(json.loads(saved.read_text()))
        super()._run(rank, test_name, file_name, pipe, **kwargs)
