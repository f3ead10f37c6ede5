"""`lowbitcc.tools.spawn.run_ranks`: ranks forked from a forkserver behave as fresh processes
started by the caller (its environment as of the call, its own process, the threads asked)."""

from __future__ import annotations

import os

import pytest

from lowbitcc.tools import spawn

VARIABLE = "LOWBITCC_TEST_SPAWN_PROBE"


def _environment(rank: int, world: int) -> dict:
    import torch

    return {"pid": os.getpid(), "probe": os.environ.get(VARIABLE),
            "override": os.environ.get("LOWBITCC_TEST_SPAWN_OVERRIDE"),
            "threads": torch.get_num_threads()}


def test_ranks_see_the_callers_environment_as_of_the_call(monkeypatch):
    """The forkserver starts with the caller's first call, so a variable set or removed after
    it must still reach (or leave) the ranks of later calls, as with a spawned process; ``env``
    and ``rank_env`` come on top."""
    monkeypatch.setenv(VARIABLE, "before")
    first = spawn.run_ranks(_environment, 2, backend="gloo")
    assert [r["probe"] for r in first] == ["before", "before"]

    monkeypatch.setenv(VARIABLE, "after")
    second = spawn.run_ranks(_environment, 2, backend="gloo", threads=1,
                             env={"LOWBITCC_TEST_SPAWN_OVERRIDE": "all"},
                             rank_env=[{}, {"LOWBITCC_TEST_SPAWN_OVERRIDE": "one"}])
    assert [r["probe"] for r in second] == ["after", "after"]
    assert [r["override"] for r in second] == ["all", "one"]
    assert [r["threads"] for r in second] == [1, 1]

    monkeypatch.delenv(VARIABLE)
    third = spawn.run_ranks(_environment, 2, backend="gloo")
    assert [r["probe"] for r in third] == [None, None]
    pids = {r["pid"] for r in first + second + third}
    assert len(pids) == 6 and os.getpid() not in pids


def test_gpu_ranks_that_share_a_gpu_get_their_own_nccl_host_id():
    shared = spawn.gpu_rank_env(4, 1)
    assert len({env["NCCL_HOSTID"] for env in shared}) == 4
    assert all(env["NCCL_SOCKET_IFNAME"] == "lo" for env in shared)
    assert all(env == {} for env in spawn.gpu_rank_env(2, 2))  # a GPU each: nothing to change
    assert len(spawn.gpu_rank_env(3, 2)) == 3 and "NCCL_HOSTID" in spawn.gpu_rank_env(3, 2)[0]
    with pytest.raises(ValueError, match="need a GPU"):
        spawn.gpu_rank_env(2, 0)


def _stalled(rank: int, world: int, path: str) -> bool:
    import time

    log = f"{path}.{rank}"
    with open(log, "w") as f:  # the dump goes to fd 2: this file from here on
        os.dup2(f.fileno(), 2)
    time.sleep(1.5)
    with open(log) as f:
        return "_stalled" in f.read()


def test_a_rank_still_running_after_the_dump_time_writes_its_stacks(monkeypatch, tmp_path):
    """``LOWBITCC_DUMP_STACKS_AFTER``: each loco rank (whose config refuses unknown ``LOCO_*``
    names) writes its threads' stacks once, and runs on."""
    monkeypatch.setenv("LOWBITCC_DUMP_STACKS_AFTER", "0.5")
    assert spawn.run_ranks(_stalled, 2, str(tmp_path / "stacks")) == [True, True]
