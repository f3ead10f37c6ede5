"""Rank, world size and rendezvous from the launcher's environment: torchrun, mpiexec, srun.

``init_process_group("loco")`` with no init method uses torch's ``env://`` rendezvous, which
reads torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Under ``mpiexec`` or
``srun`` those are not set; `export_torchrun_environment` sets them from what the launcher did
set, so an unmodified script starts the same way under every launcher:

==============  ==========================================  ============================
launcher        rank / size                                 local rank / local size
==============  ==========================================  ============================
torchrun        RANK / WORLD_SIZE                           LOCAL_RANK / LOCAL_WORLD_SIZE
Open MPI        OMPI_COMM_WORLD_RANK / _SIZE                OMPI_COMM_WORLD_LOCAL_RANK / _SIZE
MPICH, Intel    PMI_RANK / PMI_SIZE                         MPI_LOCALRANKID / MPI_LOCALNRANKS
Slurm srun      SLURM_PROCID / SLURM_NTASKS                 SLURM_LOCALID / SLURM_TASKS_PER_NODE
==============  ==========================================  ============================

The rendezvous address, unless MASTER_ADDR/MASTER_PORT are set: under Slurm the first host of
SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST) and a port derived from the job and step ids; under
MPI on one node 127.0.0.1 and a port derived from the launcher's per-node process id (the
parent of every local rank); under MPI across nodes, rank 0's host name and a free port,
broadcast with mpi4py. When none of this is possible the error says which variables to set.

`install_env_hook` (run when the backend registers) wraps torch's ``env://`` handler with
`export_for_url`, so that the variables are filled at ``init_process_group`` time, not at
import. The handler table ``torch.distributed.rendezvous._rendezvous_handlers`` is private:
tests/backend/test_launchers.py pins the behaviour.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from collections.abc import MutableMapping

PORT_BASE = 20000
PORT_SPAN = 20000

_LAUNCHERS = (
    # name, rank, size, local rank, local size
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_TASKS_PER_NODE"),
)


class LauncherError(ValueError):
    """The environment does not say how to start this rank (a ValueError, as torch's own
    ``env://`` errors are)."""


@dataclasses.dataclass(frozen=True)
class Launch:
    """What the launcher told this process."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def single_node(self) -> bool:
        return self.local_world_size == self.world_size


def _int(environ: MutableMapping[str, str], name: str) -> int:
    raw = environ.get(name, "")
    match = re.match(r"\s*(\d+)", raw)  # SLURM_TASKS_PER_NODE looks like "4(x2),3"
    if not match:
        raise LauncherError(f"lowbitcc: launcher variable {name}={raw!r} is not an integer")
    return int(match.group(1))


def detect(environ: MutableMapping[str, str] | None = None) -> Launch | None:
    """The launcher this process runs under (torchrun first), or None if none is recognised."""
    environ = os.environ if environ is None else environ
    for name, rank, size, local_rank, local_size in _LAUNCHERS:
        if rank in environ and size in environ:
            world = _int(environ, size)
            r = _int(environ, rank)
            if not 0 <= r < world:
                raise LauncherError(f"lowbitcc: {rank}={r} is not below {size}={world}")
            lr = _int(environ, local_rank) if local_rank in environ else r
            lw = _int(environ, local_size) if local_size in environ else world
            return Launch(name, r, world, lr, lw)
    return None


def first_host(nodelist: str) -> str:
    """First host of a Slurm node list: ``"gpu[003-005,9],cpu1"`` -> ``"gpu003"``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match or not match.group(1):
        raise LauncherError(f"lowbitcc: cannot read a host from Slurm node list {nodelist!r}")
    prefix, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + re.split(r"[-,]", ranges)[0]


def _port(seed: int) -> int:
    return PORT_BASE + seed % PORT_SPAN


def rendezvous_address(launch: Launch, environ: MutableMapping[str, str]) -> tuple[str, int] | None:
    """Where rank 0's store listens, found without communicating, or None."""
    if launch.launcher == "slurm":
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
        job = environ.get("SLURM_JOB_ID", "")
        if nodelist and job.isdigit():
            step = environ.get("SLURM_STEP_ID", "0")
            return first_host(nodelist), _port(int(job) * 31 + (int(step) if step.isdigit() else 0))
    if launch.single_node:
        return "127.0.0.1", _port(os.getppid())
    return None


def _address_from_mpi() -> tuple[str, int] | None:
    """Rank 0's host and a free port, broadcast over MPI_COMM_WORLD; None without mpi4py."""
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    comm = MPI.COMM_WORLD
    address = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        address = (socket.gethostname(), port)
    return comm.bcast(address, root=0)


def export_torchrun_environment(environ: MutableMapping[str, str] | None = None) -> Launch:
    """Set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT in
    ``environ`` (default ``os.environ``) from the launcher's variables; existing values win.

    Raises `LauncherError` naming what is missing when no launcher is recognised or no
    rendezvous address can be found.
    """
    environ = os.environ if environ is None else environ
    launch = detect(environ)
    if launch is None:
        raise LauncherError(
            "lowbitcc: no launcher found: set RANK and WORLD_SIZE (torchrun does), or start under "
            "mpiexec (Open MPI: OMPI_COMM_WORLD_RANK/SIZE; MPICH: PMI_RANK/PMI_SIZE) or srun "
            "(SLURM_PROCID/SLURM_NTASKS), or pass rank, world_size and init_method")
    for name, value in (("RANK", launch.rank), ("WORLD_SIZE", launch.world_size),
                        ("LOCAL_RANK", launch.local_rank),
                        ("LOCAL_WORLD_SIZE", launch.local_world_size)):
        environ.setdefault(name, str(value))
    if "MASTER_ADDR" not in environ or "MASTER_PORT" not in environ:
        address = rendezvous_address(launch, environ)
        if address is None and launch.launcher in ("openmpi", "mpich"):
            address = _address_from_mpi()
        if address is None:
            raise LauncherError(
                f"lowbitcc: {launch.launcher} started {launch.world_size} ranks on several nodes "
                "but no rendezvous address is known: set MASTER_ADDR and MASTER_PORT (rank 0's "
                "host and a free port), or install mpi4py (pip install 'lowbitcc[mpi]')")
        environ.setdefault("MASTER_ADDR", address[0])
        environ.setdefault("MASTER_PORT", str(address[1]))
    return launch


def export_for_url(url: str) -> None:
    """What the ``env://`` hook runs before torch's handler: fill the torchrun variables unless
    the url already carries rank and world size (``init_process_group(rank=..., world_size=...)``)."""
    if "rank=" not in url or "world_size=" not in url:
        export_torchrun_environment()


def install_env_hook() -> None:
    """Wrap torch's ``env://`` rendezvous handler so that it runs `export_for_url` first
    (idempotent)."""
    import sys

    handlers = getattr(sys.modules.get("torch.distributed.rendezvous"), "_rendezvous_handlers", None)
    if not isinstance(handlers, dict) or getattr(handlers.get("env"), "_lowbitcc", False):
        return
    original = handlers["env"]

    def env_rendezvous(url, *args, **kwargs):
        export_for_url(url)
        return original(url, *args, **kwargs)

    env_rendezvous._lowbitcc = True  # type: ignore[attr-defined]
    handlers["env"] = env_rendezvous
