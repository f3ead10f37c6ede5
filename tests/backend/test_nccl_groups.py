"""The inner NCCL groups of a "loco" group, without a GPU (a recording stand-in for
``ProcessGroupNCCL``): who owns the timeout (lowbitcc's watchdog, at the group's; the inner
groups, torch's watchdog's, get a longer one), and the hierarchical schedule's node and rail
groups shut down, or aborted, with the group, graphs first and the world's communicator last."""

from __future__ import annotations

import datetime
import types

import pytest
import torch.distributed as dist

from lowbitcc.backend import routes
from lowbitcc.backend.process_group import LocoProcessGroup
from lowbitcc.config import LocoConfig

TIMEOUT = datetime.timedelta(seconds=30)


class FakeNccl:
    """``ProcessGroupNCCL`` as lowbitcc makes and ends it: its options and calls recorded in
    ``log``."""

    log: list = []

    class Options:
        def __init__(self) -> None:
            self._timeout = None

    def __init__(self, store, rank: int, size: int, options) -> None:
        self._rank, self._size, self.options = rank, size, options
        self.name = getattr(options, "group_name", "") or f"sub{len(FakeNccl.log)}"
        FakeNccl.log.append(("made", self.name, options._timeout))

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def _set_sequence_number_for_group(self) -> None:
        pass

    def shutdown(self) -> None:
        FakeNccl.log.append(("shutdown", self.name))

    def abort(self) -> None:
        FakeNccl.log.append(("abort", self.name))


@pytest.fixture
def fake_nccl(monkeypatch):
    FakeNccl.log = []
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNccl, raising=False)
    return FakeNccl.log


def test_the_inner_nccl_groups_time_out_after_lowbitccs_watchdog(fake_nccl):
    """torch's NCCL watchdog (which ends the process at its timeout by default) gets a longer
    timeout than the group's, which lowbitcc's watchdog keeps: it names the call and aborts the
    inner groups first."""
    store = dist.HashStore()
    world = routes.inner_nccl(store, 0, 4, TIMEOUT, None, "g")
    route = routes.cuda_route(LocoConfig(node_size=2), world, store, [0, 1, 2, 3], 0, TIMEOUT)
    route.links.node()
    route.links.rail()
    longer = routes.inner_timeout(TIMEOUT)
    assert longer >= 2 * TIMEOUT
    assert [entry[2] for entry in fake_nccl] == [longer] * 3, fake_nccl


class FakeGraphs:
    def __init__(self, log: list) -> None:
        self.log = log

    def release(self, timeout_s: float) -> None:
        self.log.append(("graphs released", timeout_s))


def _group_with_sub_groups(log: list) -> LocoProcessGroup:
    """The CUDA half of a `LocoProcessGroup` whose hierarchical links made their node and rail
    groups, on the stand-ins (no GPU: the CPU half replaced by stubs)."""
    store = dist.HashStore()
    group = LocoProcessGroup.__new__(LocoProcessGroup)
    group.timeout = TIMEOUT
    group._nccl = routes.inner_nccl(store, 0, 4, TIMEOUT, None, "g")
    group._cuda_links = routes.cuda_route(LocoConfig(node_size=2), group._nccl, store,
                                          [0, 1, 2, 3], 0, TIMEOUT).links
    group._cuda_links.node()
    group._cuda_links.rail()
    group._compressed = types.SimpleNamespace(graphs=FakeGraphs(log))
    group._cuda = types.SimpleNamespace(watchdog=types.SimpleNamespace(dead=None))
    stub = types.SimpleNamespace(shutdown=lambda: None)
    group._queue = types.SimpleNamespace(shutdown=lambda timeout_s: True)
    group._inner = group._direct = stub
    group._cpu_links = types.SimpleNamespace(close=lambda: None)
    return group


def test_shutdown_ends_the_node_and_rail_groups_after_the_graphs_and_before_the_world(fake_nccl):
    group = _group_with_sub_groups(fake_nccl)
    del fake_nccl[:]
    group.shutdown()
    assert fake_nccl == [("graphs released", TIMEOUT.total_seconds()), ("shutdown", "sub1"),
                         ("shutdown", "sub2"), ("shutdown", "g/lowbitcc")], fake_nccl


def test_the_watchdogs_abort_ends_the_node_and_rail_groups_too(fake_nccl):
    group = _group_with_sub_groups(fake_nccl)
    del fake_nccl[:]
    group._abort_nccl()
    assert fake_nccl == [("graphs released", 0.0), ("abort", "sub1"), ("abort", "sub2"),
                         ("abort", "g/lowbitcc")], fake_nccl
