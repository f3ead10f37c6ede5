"""Starting under torchrun, mpiexec and srun: environment detection, and real mpiexec runs."""

import os
import shutil
import subprocess
import sys

import pytest

from lowbitcc.backend import rendezvous as launcher
from tests.support.ranks import clean_env


def test_each_launcher_is_detected():
    cases = {
        "torchrun": {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
        "openmpi": {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8",
                    "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
        "mpich": {"PMI_RANK": "3", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
        "slurm": {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                  "SLURM_TASKS_PER_NODE": "2(x4)"},
    }
    for name, env in cases.items():
        assert launcher.detect(env) == launcher.Launch(name, 3, 8, 1, 2), name
    assert launcher.detect({}) is None
    # torchrun's variables win over an MPI launcher's (torchrun inside an allocation)
    both = {**cases["mpich"], "RANK": "0", "WORLD_SIZE": "1"}
    assert launcher.detect(both).launcher == "torchrun"
    with pytest.raises(launcher.LauncherError, match="PMI_RANK=9 is not below PMI_SIZE=8"):
        launcher.detect({"PMI_RANK": "9", "PMI_SIZE": "8"})
    with pytest.raises(launcher.LauncherError, match="not an integer"):
        launcher.detect({"PMI_RANK": "x", "PMI_SIZE": "8"})


def test_rendezvous_address_from_the_environment():
    single = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    env = dict(single)
    launch = launcher.export_torchrun_environment(env)
    assert launch.single_node
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "2" and env["LOCAL_WORLD_SIZE"] == "2"
    assert env["MASTER_ADDR"] == "127.0.0.1"
    assert int(env["MASTER_PORT"]) == launcher.PORT_BASE + os.getppid() % launcher.PORT_SPAN
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
             "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[017-018]",
             "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "3"}
    launcher.export_torchrun_environment(slurm)
    assert slurm["MASTER_ADDR"] == "gpu017" and slurm["RANK"] == "5"
    assert launcher.first_host("a1,b2") == "a1"
    assert launcher.first_host("node[3,7-9]") == "node3"
    # explicit values win
    env = {**single, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234", "RANK": "1"}
    launcher.export_torchrun_environment(env)
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["MASTER_PORT"] == "1234"


def test_missing_launcher_and_address_are_explained(monkeypatch):
    with pytest.raises(launcher.LauncherError, match="RANK and WORLD_SIZE.*mpiexec.*srun"):
        launcher.export_torchrun_environment({})
    multi = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4",
             "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    monkeypatch.setattr(launcher, "_address_from_mpi", lambda: None)
    with pytest.raises(launcher.LauncherError, match="MASTER_ADDR and MASTER_PORT"):
        launcher.export_torchrun_environment(multi)


def test_init_without_launcher_names_what_is_missing():
    env = clean_env()
    done = subprocess.run([sys.executable, "-c",
                           "import torch.distributed as dist; dist.init_process_group('loco')"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0
    assert "no launcher found" in done.stderr and "mpiexec" in done.stderr


MPIEXEC = shutil.which("mpiexec")
needs_mpiexec = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found "
                                   "(pip install 'lowbitcc[mpi]' provides MPICH's)")

DDP_SCRIPT = r"""
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import lowbitcc
dist.init_process_group("loco")            # no arguments: everything from mpiexec
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 8)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(rank)
for step in range(3):
    x = torch.randn(32, 256, generator=g)
    loss = model(x).square().mean()
    opt.zero_grad(); loss.backward(); opt.step()
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
everyone = [torch.empty_like(flat) for _ in range(world)]
dist.all_gather(everyone, flat)
assert all(torch.equal(flat, e) for e in everyone), "replicas diverged"
stats = lowbitcc.stats()["compressed"]
assert stats["calls"] >= 3 and stats["wire_bytes"] > 0, stats
if rank == 0:
    print(f"OK world={world} compressed_calls={stats['calls']}", flush=True)
dist.destroy_process_group()
"""


@needs_mpiexec
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_ddp_over_loco_under_mpiexec(world):
    env = clean_env()
    done = subprocess.run([MPIEXEC, "-n", str(world), sys.executable, "-c", DDP_SCRIPT],
                          capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert f"OK world={world}" in done.stdout


@needs_mpiexec
def test_perf_under_mpiexec_with_the_mpi_backend():
    pytest.importorskip("mpi4py")
    env = clean_env()
    done = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "lowbitcc", "perf",
                           "all_reduce", "-b", "256K", "-e", "256K", "-n", "2", "-w", "1",
                           "--backend", "mpi", "gloo", "loco"],
                          capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    from lowbitcc.tools.perf import parse_table

    rows = {r["backend"]: r for r in parse_table(done.stdout)}
    assert set(rows) == {"mpi", "gloo", "loco4"}
    assert rows["mpi"]["oop_error"] == 0 and rows["mpi"]["ip_error"] == 0


def test_perf_under_torchrun():
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not on PATH")
    env = clean_env()
    done = subprocess.run([torchrun, "--nproc_per_node=2", "--no-python", sys.executable, "-m",
                           "lowbitcc", "perf", "reduce_scatter", "-b", "512K", "-e", "512K",
                           "-n", "1", "-w", "0", "--backend", "loco", "gloo"],
                          capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    from lowbitcc.tools.perf import parse_table

    rows = {r["backend"]: r for r in parse_table(done.stdout)}
    assert set(rows) == {"loco4", "gloo"} and rows["gloo"]["oop_error"] == 0
    assert 0 < rows["loco4"]["oop_error"] < 0.3



EXIT_SCRIPT = r"""
import torch, torch.distributed as dist
import lowbitcc
dist.init_process_group("loco")
world = dist.get_world_size()
for _ in range(50):
    out = torch.empty(world * 4096)
    dist.all_gather_into_tensor(out, torch.ones(4096))   # served by the group's runner
rank = dist.get_rank()
for _ in range(20):  # a pipeline's exchanges (served: held and waited for by the runner's thread)
    sending = dist.isend(torch.ones(4096), (rank + 1) % world)
    dist.recv(torch.empty(4096), (rank - 1) % world)
    sending.wait()
dist.isend(torch.ones(65536), (rank + 1) % world)  # its Work dropped at once
dist.recv(torch.empty(65536), (rank - 1) % world)
assert dist.group.WORLD._runner.served_moves >= 49 + 42
out = torch.empty(world * 262144)
dist.all_gather_into_tensor(out, torch.ones(262144), async_op=True)  # its Work dropped at once
# no destroy_process_group: the interpreter exits with the last call in flight or just done
"""


@needs_mpiexec
@pytest.mark.slow
def test_a_rank_exits_cleanly_right_after_served_calls():
    """A gloo thread that lets go of a call's Work last frees its tensors, taking the GIL: at
    the interpreter's exit that aborts the process ("terminate called without an active
    exception"; plain gloo, this script's all-gathers on a "gloo" group: 7 launches in 10). The
    runner keeps its served calls' Works (``backend/csrc/retired_works.h``), as the Python
    path's transport does, and its point-to-point calls' thread never lets go of one last
    (``backend/csrc/point_completer.h``): 8 launches, every rank exits 0 (6 launches in 10
    aborted without keeping the Works)."""
    env = clean_env()
    for launch in range(8):
        done = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-c", EXIT_SCRIPT],
                              capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 0, (launch, done.stderr[-3000:])
