"""The one way the tools (and the tests) start local ranks.

`run_ranks(fn, nprocs, *args)` runs ``fn(rank, world, *args)`` in ``nprocs`` new processes, each
after ``init_process_group(backend)`` with a FileStore rendezvous in a temporary folder (no port
is opened for the rendezvous; gloo itself listens on loopback), and returns the ranks' return
values in rank order. A rank's exception is re-raised in the parent with its traceback; a run
that outlives ``timeout_s`` is killed and raises, so a hang never stalls the caller. Ranks log
at the caller's level, in `LOG_FORMAT`. Values travel pickled by value (tensors included).
`threads_per_rank` is the rule every tool uses for torch's intra-op threads. Where
``LOWBITCC_DUMP_STACKS_AFTER`` (seconds) is set, a rank still running that long after its group
was made, or in its group's teardown, writes every thread's stack to its stderr
(`faulthandler`): what a hang's ranks were waiting on, before the caller's timeout kills them.

The processes are forked by multiprocessing's "forkserver", a server started once per calling
process that imports torch (and so, through torch's backend autoload, lowbitcc) before it forks
anything: a rank starts in milliseconds instead of importing torch for seconds, which is most of
a short multi-process test. The server has run no torch operation, created no thread and not
initialised CUDA, so each rank starts as a fresh process would, with one difference handled
here: a forked rank would inherit the server's environment, so it gets the caller's
environment as of the call instead, then ``env``.
"""

from __future__ import annotations

import datetime
import faulthandler
import logging
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch.multiprocessing as mp

if TYPE_CHECKING:
    from lowbitcc.tools.link_spec import Link

LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
"""The tools' log format (the `lowbitcc` command's, and its ranks')."""


def gpu_rank_env(nprocs: int, devices: int) -> list[dict[str, str]]:
    """Per-rank environment that lets ``nprocs`` local ranks share ``devices`` GPUs under NCCL
    (rank ``r`` uses device ``r % devices``, `gpu_device`).

    NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected", its
    ``init.cc``) only when their host hashes match, and the host hash honours
    ``NCCL_HOSTID``: where ranks share a GPU, each gets its own ``NCCL_HOSTID`` (NCCL then
    takes them for separate nodes and connects them over its socket transport) and
    ``NCCL_SOCKET_IFNAME=lo``. Timings mean nothing there (the ranks share the GPU, the wire
    is a socket); correctness does. With a GPU per rank, nothing is set."""
    if devices < 1:
        raise ValueError(f"lowbitcc: {nprocs} GPU ranks need a GPU, found {devices}")
    if nprocs <= devices:
        return [{} for _ in range(nprocs)]
    return [{"NCCL_HOSTID": f"lowbitcc-rank{r}", "NCCL_SOCKET_IFNAME": "lo"}
            for r in range(nprocs)]


def gpu_device(rank: int) -> Any:
    """Make ``rank``'s GPU (``rank % device_count``, as `gpu_rank_env` places it) current."""
    import torch

    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def local_gpu(rank: int) -> Any:
    """`gpu_device` of this process's local rank: ``LOCAL_RANK`` under a launcher (torchrun,
    and the others `rendezvous` knows set it), else ``rank`` (local ranks of `run_ranks`)."""
    return gpu_device(int(os.environ.get("LOCAL_RANK", rank)))


def threads_per_rank(local_ranks: int) -> int:
    """torch threads for each of ``local_ranks`` ranks sharing this machine's cores."""
    return max(1, (os.cpu_count() or 1) // max(1, local_ranks))


def _entry(rank: int, world: int, fn: Callable[..., Any], args: tuple, init_file: str,
           backend: str, pg_timeout_s: float, env: Mapping[str, str], threads: int,
           pg_options: Any, results: Any, log_level: int) -> None:
    os.environ.clear()
    os.environ.update(env)
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    try:
        import torch
        import torch.distributed as dist

        import lowbitcc  # noqa: F401 (registers "loco" where autoload is off)

        torch.set_num_threads(threads)
        dist.init_process_group(
            backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout_s), pg_options=pg_options,
        )
        _wait_for_every_rank(f"{init_file}.ready", rank, world, pg_timeout_s)
        if dump_after := os.environ.get("LOWBITCC_DUMP_STACKS_AFTER"):
            faulthandler.dump_traceback_later(float(dump_after))
        try:
            value = fn(rank, world, *args)
        finally:
            if dump_after:  # the teardown's own time: a hang there is dumped too
                faulthandler.dump_traceback_later(float(dump_after))
            try:
                dist.destroy_process_group()
            finally:
                faulthandler.cancel_dump_traceback_later()
        # by value: torch's queue would send tensors as shared-memory handles, which die with
        # this process before the parent has read them
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 (sent to the parent, which raises)
        results.put((rank, False, traceback.format_exc()))


def _wait_for_every_rank(path: str, rank: int, world: int, timeout_s: float) -> None:
    """Return once every rank has created its group. A rank leaves ``init_process_group`` when
    its own side is connected; one whose function then returned at once could exit while a
    peer was still connecting to it (gloo: "connectFullMesh failed ... Connection closed by
    peer"). A store, not a barrier, so that the group sees no call the function did not make."""
    import torch.distributed as dist

    store = dist.FileStore(path, world)
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    store.set(f"ready/{rank}", "1")
    store.wait([f"ready/{r}" for r in range(world)])


def run_ranks(fn: Callable[..., Any], nprocs: int, *args: Any, backend: str = "loco",
              timeout_s: float = 300.0, pg_timeout_s: float | None = None,
              env: Mapping[str, str] | None = None, threads: int | None = None,
              pg_options: Any = None,
              rank_env: Sequence[Mapping[str, str]] | None = None) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``nprocs`` local ranks; the values in rank order.

    ``env`` is added to each rank's environment before the group is created (``LOCO_*``
    settings), then ``rank_env[rank]`` (settings that differ per rank); ``threads`` defaults
    to `threads_per_rank`; ``pg_timeout_s`` (the process group's timeout) to ``timeout_s``.
    ``fn``, ``args`` and the values must pickle.
    """
    if nprocs < 1:
        raise ValueError(f"lowbitcc: need at least one rank, got {nprocs}")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])  # read when the server starts
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="lowbitcc-") as tmp:
        init_file = os.path.join(tmp, "store")
        if rank_env is not None and len(rank_env) != nprocs:
            raise ValueError(f"lowbitcc: rank_env has {len(rank_env)} entries for {nprocs} ranks")
        envs = [{**os.environ, **(env or {}), **(rank_env[r] if rank_env else {})}
                for r in range(nprocs)]
        procs = [ctx.Process(target=_entry, daemon=True, args=(
            r, nprocs, fn, args, init_file, backend, pg_timeout_s or timeout_s, envs[r],
            threads or threads_per_rank(nprocs), pg_options, results,
            logging.getLogger().getEffectiveLevel())) for r in range(nprocs)]
        for p in procs:
            p.start()
        values: dict[int, Any] = {}
        errors: list[str] = []
        deadline = time.monotonic() + timeout_s
        try:
            while len(values) + len(errors) < nprocs:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"lowbitcc: ranks did not finish within {timeout_s} s")
                try:
                    rank, ok, value = results.get(timeout=min(left, 1.0))
                except queue.Empty:
                    dead = [p for p in procs if p.exitcode not in (None, 0)]
                    if dead and results.empty():
                        raise RuntimeError(f"lowbitcc: a rank process exited with code "
                                           f"{dead[0].exitcode} without a result") from None
                    continue
                if ok:
                    values[rank] = pickle.loads(value)
                else:
                    errors.append(f"rank {rank}:\n{value}")
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    if errors:
        raise RuntimeError("lowbitcc: rank failed\n" + "\n".join(errors))
    return [values[r] for r in range(nprocs)]


def launch(rank_main: Callable[..., Any], nprocs: int | None, link: Link | str | None,
           argv: Sequence[str], *args: Any, timeout_s: float = 1800.0,
           ranks_per_node: int = 1, gpu: bool = False) -> int:
    """Run a tool's ``rank_main(rank, world, *args)`` on the ranks of whatever started us:
    under a launcher (torchrun, mpiexec, srun: this process is one rank, on a gloo default
    group), on ``nprocs`` ranks behind emulated links ``link`` (a `Link` or a rate; ``argv``, the
    command line, is run again in each node's network namespace, ``ranks_per_node`` ranks a
    node; root), or on ``nprocs`` local processes (default 2; ``gpu``: placed on this machine's
    GPUs by `gpu_rank_env`, sharing them where there are fewer). Returns the exit status."""
    import logging

    import torch
    import torch.distributed as dist

    from lowbitcc.backend import rendezvous
    from lowbitcc.tools import netem

    launched = rendezvous.detect()
    if launched is not None:
        if link or (nprocs and nprocs != launched.world_size):
            logging.getLogger("lowbitcc").warning(
                "started by %s with %d ranks: --np/--link are ignored", launched.launcher,
                launched.world_size)
        torch.set_num_threads(threads_per_rank(launched.local_world_size))
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
        try:
            rank_main(dist.get_rank(), dist.get_world_size(), *args)
        finally:
            dist.destroy_process_group()
        return 0
    if link:
        import sys

        command = [sys.executable, "-m", "lowbitcc", *argv]
        return netem.run_ranks(command, nprocs or 2, None if link == "none" else link,
                               timeout_s=timeout_s, ranks_per_node=ranks_per_node)
    nprocs = nprocs or 2
    rank_env = gpu_rank_env(nprocs, torch.cuda.device_count()) if gpu else None
    run_ranks(rank_main, nprocs, *args, timeout_s=timeout_s, backend="gloo", rank_env=rank_env)
    return 0
