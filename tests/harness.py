"""Run a function on N real processes joined by a "loco" group (and a gloo reference group).

``run_ranks(fn, world, *args)`` spawns ``world`` processes; each initialises the default group
with backend "loco" (FileStore rendezvous, so no port can clash), builds a gloo group over the
same ranks, calls ``fn(rank, world, gloo_group, *args)`` and sends back its return value. The
parent returns the values in rank order, or raises with the failing rank's traceback; a run that
outlives ``timeout`` is killed and fails, so a hang can never stall the suite.
"""

from __future__ import annotations

import datetime
import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def _entry(fn, rank, world, init_file, results, args, env, pg_timeout_s, pg_options) -> None:
    os.environ.update(env)
    try:
        import torch
        import torch.distributed as dist

        import lowbitcc  # noqa: F401

        torch.set_num_threads(1)
        dist.init_process_group(
            "loco", init_method=f"file://{init_file}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout_s), pg_options=pg_options,
        )
        gloo = dist.new_group(backend="gloo")
        value = fn(rank, world, gloo, *args)
        results.put((rank, True, value))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        results.put((rank, False, traceback.format_exc()))


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
                      "LOCAL_WORLD_SIZE")


def clean_env() -> dict[str, str]:
    """This process's environment without torchrun's variables, for a child that must take
    its ranks from its own launcher (mpiexec, torchrun) or from nothing."""
    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    pg_timeout_s: float = 60.0,
    pg_options: Any = None,
) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_entry,
                args=(fn, r, world, init_file, results, args, env or {}, pg_timeout_s, pg_options),
                daemon=True,
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        values: dict[int, Any] = {}
        errors: list[str] = []
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        try:
            while len(values) + len(errors) < world:
                left = (deadline - datetime.datetime.now()).total_seconds()
                if left <= 0:
                    raise TimeoutError(f"ranks did not finish within {timeout} s (hang?)")
                try:
                    rank, ok, value = results.get(timeout=min(left, 1.0))
                except queue.Empty:
                    dead = [p for p in procs if p.exitcode not in (None, 0)]
                    if dead and results.empty():
                        raise RuntimeError(
                            f"rank process exited with code {dead[0].exitcode} without a result"
                        ) from None
                    continue
                if ok:
                    values[rank] = value
                else:
                    errors.append(f"rank {rank}:\n{value}")
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [values[r] for r in range(world)]
