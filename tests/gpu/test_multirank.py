"""Several ranks of real NCCL under "loco" (``pytest -m gpu``; skipped without a GPU).

Ranks map to ``rank % device_count``; where they share a GPU, `spawn.gpu_rank_env` gives each
its own ``NCCL_HOSTID`` (NCCL then takes them for separate nodes over its socket transport),
and the test ids say so. Timings mean nothing there; results do: compressed all-reduce and
reduce-scatter identical on every rank and equal to the same call on CPU tensors (the C++
codec, gloo) bit for bit, a mismatched call raising on every rank, no host synchronisation.
Written 2026-11-26 without a GPU: **these tests have not run yet** (docs/gpu.md).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lowbitcc
from lowbitcc.backend.call_agreement import CollectiveMismatchError
from lowbitcc.codec import cuda
from lowbitcc.tools import spawn
from tests.support.ranks import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible to torch"),
    pytest.mark.skipif(not dist.is_nccl_available(), reason="torch was built without NCCL"),
    pytest.mark.skipif(not cuda.available(), reason="CuPy is not installed or sees no GPU"),
]

N = 3 * 65536 + 40


def _placement(world: int) -> str:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    shared = " sharing GPUs (NCCL_HOSTID per rank)" if 0 < gpus < world else ""
    return f"{world} ranks on {gpus} GPU(s){shared}"


WORLDS = [pytest.param(w, id=_placement(w)) for w in (2, 4)]


def _ranks(fn, world: int, *args, **kwargs):
    env = spawn.gpu_rank_env(world, torch.cuda.device_count())
    return run_ranks(fn, world, *args, rank_env=env, timeout=300, **kwargs)


def _same_on_every_rank(t: torch.Tensor, gloo) -> bool:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t, group=gloo)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _compressed_equals_cpu(rank, world, gloo, dtype):
    device = spawn.gpu_device(rank)
    x = torch.randn(N, generator=torch.Generator().manual_seed(rank)).to(dtype)
    on_gpu, on_cpu = x.to(device), x.clone()
    with lowbitcc.compressed():
        with lowbitcc.feedback_key("cuda-all-reduce"):
            dist.all_reduce(on_gpu)
        with lowbitcc.feedback_key("cpu-all-reduce"):
            dist.all_reduce(on_cpu)
    rows = x.reshape(-1)[: (N // world) * world]
    out_gpu = torch.empty(N // world, dtype=dtype, device=device)
    out_cpu = torch.empty(N // world, dtype=dtype)
    with lowbitcc.compressed():
        with lowbitcc.feedback_key("cuda-reduce-scatter"):
            dist.reduce_scatter_tensor(out_gpu, rows.to(device))
        with lowbitcc.feedback_key("cpu-reduce-scatter"):
            dist.reduce_scatter_tensor(out_cpu, rows.clone())
    got = on_gpu.cpu()
    return {"all_reduce_equal": torch.equal(got, on_cpu),
            "reduce_scatter_equal": torch.equal(out_gpu.cpu(), out_cpu),
            "identical": _same_on_every_rank(got, gloo),
            "compressed": lowbitcc.stats()["compressed"]["calls"]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world", WORLDS)
def test_compressed_calls_on_nccl_equal_the_cpu_calls_bit_for_bit(world, dtype):
    for r in _ranks(_compressed_equals_cpu, world, dtype):
        assert r["all_reduce_equal"] and r["reduce_scatter_equal"] and r["identical"], r
        assert r["compressed"] == 4, r  # two calls per device, all compressed


def _mismatch(rank, world, gloo):
    device = spawn.gpu_device(rank)
    x = torch.ones(N + (64 if rank == world - 1 else 0), device=device)
    try:
        with lowbitcc.compressed():
            dist.all_reduce(x)
        torch.cuda.synchronize()
        outcome = "completed"
    except CollectiveMismatchError:
        outcome = "raised"
    y = torch.ones(N, device=device)  # the group goes on
    with lowbitcc.compressed():
        dist.all_reduce(y)
    return outcome, float(y.sum().cpu()) / N


@pytest.mark.parametrize("world", WORLDS)
def test_a_mismatched_call_raises_on_every_rank_and_the_group_goes_on(world):
    for outcome, mean in _ranks(_mismatch, world):
        assert outcome == "raised"
        assert abs(mean - world) < 0.05 * world


def _no_host_sync(rank, world, gloo):
    device = spawn.gpu_device(rank)
    x = torch.randn(N, device=device)
    with lowbitcc.compressed():
        dist.all_reduce(x.clone())  # warm up: buffers, kernels, the descriptor's first use
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with lowbitcc.compressed():
            work = dist.all_reduce(x, async_op=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    work.wait()
    return _same_on_every_rank(x.cpu(), gloo)


@pytest.mark.parametrize("world", WORLDS)
def test_a_compressed_call_enqueues_without_a_host_sync_and_orders_with_the_stream(world):
    assert all(_ranks(_no_host_sync, world))
