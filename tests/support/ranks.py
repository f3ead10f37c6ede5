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


def _with_gloo(fn: Callable[..., Any], rank: int, world: int, *args: Any) -> Any:
    import torch.distributed as dist

    return fn(rank, world, dist.new_group(backend="gloo"), *args)


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0,
              env: dict[str, str] | None = None, pg_timeout_s: float = 60.0,
              pg_options: Any = None) -> list[Any]:
    return spawn.run_ranks(functools.partial(_with_gloo, fn), world, *args, backend="loco",
                           timeout_s=timeout, pg_timeout_s=pg_timeout_s, env=env, threads=1,
                           pg_options=pg_options)
