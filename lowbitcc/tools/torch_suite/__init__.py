"""PyTorch's own distributed test suite run over "loco", beside gloo.

torch ships ``torch/testing/_internal/distributed/distributed_test.py`` (class
``DistributedTest._DistTestBase``: several hundred tests of every collective, async work,
subgroups, DDP, join, hooks, profiler and timeouts) and runs it per backend through a small driver
that sets ``BACKEND``, ``WORLD_SIZE`` and ``TEMP_DIR`` and spawns the ranks. This package is
lowbitcc's driver:

- `cases` is the test module the ranks import: the suite's gating decorators see gloo (the
  backend "loco" stands in for), while every process group the tests create by default is the
  backend under test;
- `runner` runs a selection of the suite in a subprocess per configuration (gloo, loco, loco
  with compression forced at every size) and compares the outcomes test by test.

``lowbitcc torch-suite`` runs the comparison; tests/tools/test_torch_suite.py runs a curated
subset in CI. Results: docs/compatibility.md.
"""
