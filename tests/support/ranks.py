"""Run a test function on N real processes joined by a "loco" group and a gloo reference group.

``run_ranks(fn, world, *args)`` runs ``fn(rank, world, gloo_group, *args)`` on ``world`` ranks
through `lowbitcc.tools.spawn.run_ranks` (the project's one spawner: FileStore rendezvous, a hard
timeout so a hang fails the test, a failing rank's traceback in the error) and returns the
values in rank order.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from lowbitcc.tools import spawn

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
                      "LOCAL_WORLD_SIZE")


def clean_env() -> dict[str, str]:
    """This process's environment without torchrun's variables, for a child that must take
    its ranks from its own launcher (mpiexec, torchrun) or from nothing."""
    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}


_REFERENCE_GROUPS: list[Any] = []
"""The gloo groups made for the tests, kept to the process's end: a gloo future callback that
captured its group (as a test's may) can otherwise drop the group's last reference on one of
gloo's own worker threads, whose destructor then joins that thread: "Resource deadlock
avoided", SIGABRT (seen over plain gloo, with loco's group not involved)."""


def _with_gloo(fn: Callable[..., Any], rank: int, world: int, *args: Any) -> Any:
    import torch.distributed as dist

    gloo = dist.new_group(backend="gloo")
    _REFERENCE_GROUPS.append(gloo)
    # A rank that leaves new_group has connected its side only; without this barrier a test
    # that returns at once can exit while a peer is still connecting to it ("connectFullMesh
    # failed ... Connection closed by peer", seen in CI).
    dist.barrier(group=gloo)
    return fn(rank, world, gloo, *args)


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0,
              env: dict[str, str] | None = None, pg_timeout_s: float = 60.0,
              pg_options: Any = None, rank_env: list[dict[str, str]] | None = None) -> list[Any]:
    return spawn.run_ranks(functools.partial(_with_gloo, fn), world, *args, backend="loco",
                           timeout_s=timeout, pg_timeout_s=pg_timeout_s, env=env, threads=1,
                           pg_options=pg_options, rank_env=rank_env)


def run_script_ranks(script: str, *args: str, world: int, port: int,
                     timeout: float = 120.0) -> list[tuple[int, str, str]]:
    """Run ``python -c script *args`` as ``world`` rank processes of their own (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR`` 127.0.0.1 and ``MASTER_PORT`` ``port`` set, the launcher's
    other variables cleared: `clean_env`), for scripts that end their own process (a rank that
    exits mid-run, ``os._exit``), which `run_ranks`' spawner would report as failed. Returns
    each rank's (exit code, stdout, stderr), in rank order; a rank still running after
    ``timeout`` seconds raises ``subprocess.TimeoutExpired`` (a hang fails the test)."""
    import subprocess
    import sys

    env = {**clean_env(), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    procs = [subprocess.Popen([sys.executable, "-c", script, *args], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**env, "RANK": str(r)}) for r in range(world)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs, strict=True)]
