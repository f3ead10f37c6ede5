"""Recording a thread's CUDA launches instead of launching them (`recording`), for
`backend.launch_record`: the CUDA kernels (`cuda.CudaKernels`) append each launch to the
record as a step, and what cannot be replayed from a record refuses (`refuse`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

_STATE = threading.local()


class NotRecordableError(RuntimeError):
    """A launch path whose work a record cannot repeat (state of its own that changes between
    calls)."""


def steps() -> list[Callable[[], Any]] | None:
    """The calling thread's record, where it records (`recording`), else None."""
    return getattr(_STATE, "steps", None)


@contextlib.contextmanager
def recording(record: list[Callable[[], Any]]) -> Iterator[None]:
    """Within the block, the calling thread's launches are appended to ``record`` (callables
    without arguments, in launch order) instead of launched."""
    _STATE.steps = record
    try:
        yield
    finally:
        _STATE.steps = None


def refuse(what: str) -> None:
    """Raise `NotRecordableError` where the calling thread records: ``what`` cannot be replayed."""
    if steps() is not None:
        raise NotRecordableError(f"lowbitcc: {what} cannot be recorded")
