"""The watchdog of a group's in-flight CUDA Works (`lowbitcc.backend.watchdog`), without a GPU:
Works whose device work has passed are read and let go (failing where their verdict word is
set), a Work past the group's timeout fails with every Work in flight, the communicator is
aborted and every later call raises; `StreamWork.wait(timeout)` honours its timeout."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from lowbitcc.backend import cuda_issue
from lowbitcc.backend.call_agreement import CollectiveMismatchError
from lowbitcc.backend.watchdog import Watchdog


class FakeWork:
    def __init__(self, name: str, verdict: BaseException | None = None) -> None:
        self.name, self._verdict = name, verdict
        self.finished = False
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self.finished

    def verdict(self) -> BaseException | None:
        return self._verdict

    def fail(self, error: BaseException) -> None:
        self.error = self.error or error


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _watchdog(clock: Clock, aborted: list) -> Watchdog:
    dog = Watchdog(10.0, lambda: aborted.append(True), "g", clock=clock)
    dog._thread = object()  # driven by poll() here, not by its thread
    return dog


def test_finished_works_leave_the_watch_and_a_set_verdict_fails_its_work():
    clock, aborted = Clock(), []
    dog = _watchdog(clock, aborted)
    mismatch = CollectiveMismatchError("foreign message")
    ok, bad, running = FakeWork("ok"), FakeWork("bad", mismatch), FakeWork("running")
    for work in (ok, bad, running):
        dog.watch(work)
    ok.finished = bad.finished = True
    dog.poll()
    assert ok.error is None and bad.error is mismatch and running.error is None
    assert dog.in_flight() == 1 and not aborted
    dog.check()  # a verdict fails its Work; the group lives on


def test_a_work_past_the_timeout_fails_every_work_in_flight_aborts_and_ends_the_group():
    clock, aborted = Clock(), []
    dog = _watchdog(clock, aborted)
    stuck, behind = FakeWork("all_reduce of 8 elements (call #7)"), FakeWork("later")
    dog.watch(stuck)
    clock.now = 5.0
    dog.watch(behind)
    dog.poll()
    assert stuck.error is None and not aborted  # within the timeout: nothing yet
    clock.now = 10.5
    dog.poll()
    assert isinstance(stuck.error, dist.DistBackendError) and behind.error is stuck.error
    assert "call #7" in str(stuck.error) and "10 s" in str(stuck.error)
    assert aborted == [True] and dog.in_flight() == 0
    with pytest.raises(dist.DistBackendError, match="call #7"):
        dog.check()


def test_the_watchdog_thread_polls_on_its_own():
    aborted = []
    dog = Watchdog(0.2, lambda: aborted.append(True), "g")
    work = FakeWork("never")
    dog.watch(work)
    deadline = time.monotonic() + 5
    while not aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert aborted and isinstance(work.error, dist.DistBackendError)


class NeverEvent:
    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return False


class FakeStream:
    device = torch.device("cpu")


def test_stream_work_wait_honours_its_timeout_and_raises_a_watchdog_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", NeverEvent)
    waited = []
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: type("S", (), {"wait_event": waited.append})())
    work = cuda_issue.StreamWork([], FakeStream(), "all_reduce (call #3)")
    started = time.monotonic()
    with pytest.raises(dist.DistBackendError, match=r"timed out after 0.2 s: all_reduce"):
        work.wait(datetime.timedelta(seconds=0.2))
    assert 0.2 <= time.monotonic() - started < 2 and not waited
    assert work.exception() is None and not work.is_completed()
    error = CollectiveMismatchError("foreign")
    work.fail(error)
    assert work.exception() is error and work.is_completed() and not work.is_success()
    with pytest.raises(CollectiveMismatchError):
        work.wait()


def test_a_stream_works_verdict_word_names_a_foreign_message(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", NeverEvent)
    clean = cuda_issue.StreamWork([], FakeStream(), "x", torch.zeros((), dtype=torch.uint8))
    flagged = cuda_issue.StreamWork([], FakeStream(), "reduce_scatter (call #9)",
                                    torch.ones((), dtype=torch.uint8))
    assert clean.verdict() is None
    error = flagged.verdict()
    assert isinstance(error, CollectiveMismatchError) and "call #9" in str(error)
    assert "NaN" in str(error)


def test_a_dead_groups_cuda_calls_raise_at_issue():
    dog = Watchdog(1.0, lambda: None, "g")
    dog.dead = dist.DistBackendError("lowbitcc: dead")
    issuer = cuda_issue.CudaIssuer(nccl=None, watchdog=dog)
    with pytest.raises(dist.DistBackendError, match="dead"):
        issuer.native("allreduce", [], [], None)
    with pytest.raises(dist.DistBackendError, match="dead"):
        issuer.compressed(lambda: None, lambda: None, [], [torch.ones(1)], False)


def test_the_watchdog_thread_works_on_the_device_of_its_works_in_the_relaxed_capture_mode(
        monkeypatch):
    """Its event queries and frees run on the group's GPU (not device 0), and a graph another
    thread captures in the global mode is not invalidated by them."""
    from lowbitcc.backend import watchdog

    entered: list = []
    monkeypatch.setattr(watchdog.torch.cuda, "set_device", lambda d: entered.append(d))
    monkeypatch.setattr(watchdog, "relax_capture_mode", lambda: entered.append("relaxed"))
    dog = Watchdog(10.0, lambda: None, "g")
    work = FakeWork("w")
    work.device = torch.device("cuda", 3)
    work.finished = True
    dog.watch(work)
    deadline = time.monotonic() + 10
    while len(entered) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert entered == [torch.device("cuda", 3), "relaxed"]


class FakeRuntime:
    """The CUDA runtime's ``cudaThreadExchangeStreamCaptureMode``: records the mode asked."""

    def __init__(self) -> None:
        self.modes: list[int] = []

    def cudaThreadExchangeStreamCaptureMode(self, mode) -> int:  # noqa: N802 (CUDA's name)
        self.modes.append(mode._obj.value)
        mode._obj.value = 0  # the thread's previous mode, global
        return 0


def test_relaxing_the_capture_mode_asks_the_cuda_runtime_and_survives_its_absence(
        monkeypatch, caplog):
    from lowbitcc.backend import watchdog

    runtime = FakeRuntime()
    names: list = []
    monkeypatch.setattr(watchdog.torch.version, "cuda", "12.8")
    monkeypatch.setattr(watchdog.ctypes, "CDLL", lambda name: names.append(name) or runtime)
    assert watchdog.relax_capture_mode()
    assert names == ["libcudart.so.12"] and runtime.modes == [watchdog.CAPTURE_MODE_RELAXED]

    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(watchdog.ctypes, "CDLL", missing)
    assert not watchdog.relax_capture_mode()
    assert "stream-capture mode" in caplog.text
