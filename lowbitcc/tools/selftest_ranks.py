"""`lowbitcc selftest --ranks N`: the multi-rank checks, N ranks of real NCCL on this machine's
GPUs (ranks sharing a GPU get their own ``NCCL_HOSTID``: `spawn.gpu_rank_env`).

Each rank all-reduces and reduce-scatters its own input, compressed, once as CUDA tensors
(CUDA kernels, NCCL) and once as CPU tensors (C++ codec, gloo); the checks: the CUDA results
equal the CPU ones bit for bit on every rank, every rank holds the same all-reduce, and a call
whose size differs on one rank raises `CollectiveMismatchError` on every rank.
"""

from __future__ import annotations

import hashlib

import torch

from lowbitcc.tools import spawn

NUMEL = 3 * 65536 + 40


def _rank(rank: int, world: int) -> dict[str, object]:
    import torch.distributed as dist

    import lowbitcc
    from lowbitcc.backend.call_agreement import CollectiveMismatchError

    device = spawn.gpu_device(rank)
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(rank))
    on_gpu, on_cpu = x.to(device), x.clone()
    m = NUMEL // world
    out_gpu, out_cpu = torch.empty(m, device=device), torch.empty(m)
    with lowbitcc.compressed():
        for name, t, out in (("gpu", on_gpu, out_gpu), ("cpu", on_cpu, out_cpu)):
            with lowbitcc.feedback_key(f"selftest-ranks-{name}"):
                dist.all_reduce(t)
            with lowbitcc.feedback_key(f"selftest-ranks-rs-{name}"):
                dist.reduce_scatter_tensor(out, t[: m * world].clone())
    result = on_gpu.cpu()
    mismatch = torch.ones(NUMEL + (64 if rank == world - 1 else 0), device=device)
    try:
        with lowbitcc.compressed():
            dist.all_reduce(mismatch)
        torch.cuda.synchronize()
        raised = False
    except CollectiveMismatchError:
        raised = True
    return {"equal": torch.equal(result, on_cpu) and torch.equal(out_gpu.cpu(), out_cpu),
            "digest": hashlib.sha256(result.numpy().tobytes()).hexdigest(), "raised": raised}


def check(ranks: int) -> list[tuple[str, str, str]]:
    """The checks on ``ranks`` local ranks (see the module docstring): (name, "ok" or "FAIL",
    detail) each."""
    devices = torch.cuda.device_count()
    env = spawn.gpu_rank_env(ranks, devices)
    where = f"{ranks} ranks on {devices} GPU(s)" + (
        ", NCCL_HOSTID per rank" if ranks > devices else "")
    try:
        results = spawn.run_ranks(_rank, ranks, rank_env=env, timeout_s=300)
    except Exception as exc:  # noqa: BLE001 (reported as the check's failure)
        return [(f"{where}: compressed calls", "FAIL", str(exc).splitlines()[0])]
    equal = all(r["equal"] for r in results)
    same = len({r["digest"] for r in results}) == 1
    raised = all(r["raised"] for r in results)
    return [
        (f"{where}: compressed all-reduce and reduce-scatter, CUDA == CPU bit for bit",
         "ok" if equal else "FAIL", "" if equal else "results differ"),
        (f"{where}: every rank holds the same all-reduce", "ok" if same else "FAIL", ""),
        (f"{where}: a call of another size on one rank raises on every rank",
         "ok" if raised else "FAIL", ""),
    ]
