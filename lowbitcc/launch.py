"""Start N local ranks of a function over a "loco" default group (for the CLI tools).

`spawn_local(fn, nprocs, *args)` runs ``fn(rank, world, *args)`` in ``nprocs`` fresh processes
after ``init_process_group("loco")`` (or ``backend``) with a FileStore rendezvous in a temporary
folder (no network port is opened for the rendezvous; gloo itself listens on loopback).
"""

from __future__ import annotations

import datetime
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn: Callable[..., Any], world: int, init_file: str, timeout_s: float,
           threads: int, backend: str, args: tuple) -> None:
    import lowbitcc  # noqa: F401  (registers "loco")

    torch.set_num_threads(threads)
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def spawn_local(fn: Callable[..., Any], nprocs: int, *args: Any, timeout_s: float = 300.0,
                backend: str = "loco") -> None:
    """Run ``fn(rank, world, *args)`` on ``nprocs`` local ranks; raises if any rank fails."""
    if nprocs < 1:
        raise ValueError(f"lowbitcc: need at least one rank, got {nprocs}")
    threads = max(1, (os.cpu_count() or 1) // nprocs)
    with tempfile.TemporaryDirectory(prefix="lowbitcc-") as tmp:
        mp.spawn(_entry, args=(fn, nprocs, os.path.join(tmp, "store"), timeout_s, threads, backend, args),
                 nprocs=nprocs, join=True)
