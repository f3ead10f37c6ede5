"""The CPU test bed of a CUDA group's device runner (`lowbitcc.backend.steady_runner.
device_runner`): the same C++ code built "of cpu" over a "loco" group's direct gloo group and
its CPU issuer, so that its CUDA logic runs on CPU tensors (under the inline issuer, which issues
on the calling thread as `CudaIssuer` does). Its data movements go to the group's inner gloo
group once the group's worker is idle, as the CPU runner's, since the Python path's go there by
the worker (a CUDA group's both go to its inner NCCL group from the calling thread)."""

from __future__ import annotations

from typing import Any

from lowbitcc.backend import steady_runner


def cpu_device_runner(group: Any) -> Any:
    """Set ``group``'s CPU runner aside and put a device runner of "cpu" in its place (the
    group's ``_device_runner``, which its C++ methods ask after the CPU runner); the runner."""
    group._runner = steady_runner.NoRunner()
    group._device_runner = steady_runner.device_runner(
        group._direct, group._compressed, group._issuers["cpu"], group._reductions, "cpu",
        group.size(), moves_to=group._inner, queue=group._queue)
    return group._device_runner
