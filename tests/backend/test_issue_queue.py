"""`IssueQueue` with fake jobs: a sequence whose job left inner work in flight (a compressed
call's exact fallback) hands it to the waiter, so the worker runs the next call meanwhile. It
used to wait for it on the worker, serialising DDP's buckets behind each other."""

from __future__ import annotations

import threading

import torch

from lowbitcc.backend.issue_queue import IssueQueue
from lowbitcc.backend.works import InnerWork


class _Gate:
    """A fake inner Work that completes when the test opens it."""

    def __init__(self) -> None:
        self.opened = threading.Event()

    def wait(self) -> None:
        assert self.opened.wait(30), "the gate was never opened"


def test_sequence_leaves_inner_work_to_the_waiter():
    queue = IssueQueue("test", retire=lambda work: None)
    gate = _Gate()
    first_out, second_out = [torch.zeros(1)], [torch.ones(1)]
    second_ran = threading.Event()

    def fallback() -> InnerWork:
        return InnerWork(gate, lambda: first_out)

    def second() -> list[torch.Tensor]:
        second_ran.set()
        return second_out

    try:
        first = queue.submit(queue.sequence([fallback], first_out))
        queue.submit(second)
        # the worker reaches the next call while the first one's inner work is in flight
        assert second_ran.wait(10), "the worker waited for the fallback's inner work"
        assert not first.is_completed()
        gate.opened.set()
        first.wait()
        assert first.result() == first_out
    finally:
        gate.opened.set()
        queue.shutdown(10)
