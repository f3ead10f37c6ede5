"""The "loco" group on CUDA tensors (``pytest -m gpu``; skipped without a GPU).

World size 1 runs on one GPU: routing, exact calls on the inner NCCL group, the compressed
path (CUDA kernels, NCCL transfers, decode) against the same call on CPU tensors, stream
ordering with ``async_op=True``, no host synchronisation, CUDA graph capture, checkpoints.
DDP and FSDP2 against ``nccl`` run on at least 2 ranks: one per GPU, or several on one GPU
with their own ``NCCL_HOSTID`` (`lowbitcc.tools.spawn.gpu_rank_env`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

import lowbitcc
from lowbitcc.codec import cuda

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible to torch"),
    pytest.mark.skipif(not dist.is_nccl_available(), reason="torch was built without NCCL"),
]

needs_cupy = pytest.mark.skipif(not cuda.available(), reason="CuPy is not installed or sees no GPU")


@pytest.fixture(scope="module")
def group():
    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("loco", init_method=f"file://{tmp}/store", rank=0, world_size=1,
                                pg_options=lowbitcc.LocoConfig(min_size=1, schedule="auto",
                                                               feedback=True),
                                device_id=torch.device("cuda", 0))
        yield dist.group.WORLD
        dist.destroy_process_group()


def test_group_attaches_nccl_and_gloo(group):
    assert dist.get_backend(group) == "loco"
    assert isinstance(group._get_backend(torch.device("cuda")), dist.ProcessGroupNCCL)
    assert isinstance(group._get_backend(torch.device("cpu")), dist.ProcessGroupGloo)


def test_exact_cuda_calls_run_on_nccl(group):
    lowbitcc.reset_stats()
    with lowbitcc.exact():
        t = torch.arange(8, dtype=torch.float32, device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        assert t.tolist() == list(range(8))
        dist.broadcast(t, 0)
        out = torch.empty(8, device="cuda")
        dist.all_gather_into_tensor(out, t)
        assert torch.equal(out, t)
        outs = [torch.empty(8, device="cuda")]
        dist.all_gather(outs, t)
        assert torch.equal(outs[0], t)
        rs = torch.empty(8, device="cuda")
        dist.reduce_scatter_tensor(rs, t)
        assert torch.equal(rs, t)
        a2a = torch.empty(8, device="cuda")
        dist.all_to_all_single(a2a, t)
        assert torch.equal(a2a, t)
        work = dist.all_reduce(t, async_op=True)
        assert isinstance(work, dist.Work)
        work.wait()
    assert lowbitcc.stats()["compressed"]["calls"] == 0


def test_synchronous_exact_calls_return_works_ordered_on_the_callers_stream(group):
    """NCCL in synchronous mode returns no Work; the group's is ordered after the call on the
    stream it ran on: waiting orders the waiter's stream after it, without a host wait."""
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    t = torch.ones(1 << 20, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with lowbitcc.exact(), torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # keeps the side stream busy well past the host's return
        t.mul_(2)
        work = group.allreduce([t], opts)
    torch.cuda.set_sync_debug_mode("error")
    try:
        work.wait()  # the current (default) stream now waits for the side stream's call
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(t.sum().cpu(), torch.tensor(2.0 * (1 << 20)))
    assert work.is_completed() and work.get_future().value()[0] is t
    t.record_stream(side)


@needs_cupy
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compressed_all_reduce_equals_the_cpu_call_bit_for_bit(group, dtype):
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(3)).to(dtype)
    on_cpu, on_gpu = x.clone(), x.cuda()
    lowbitcc.reset_stats()
    with lowbitcc.compressed():
        for _ in range(3):  # error feedback carries over calls
            with lowbitcc.feedback_key(f"cpu-{dtype}"):
                dist.all_reduce(on_cpu)
            with lowbitcc.feedback_key(f"gpu-{dtype}"):
                dist.all_reduce(on_gpu)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(on_cpu.view(bits), on_gpu.cpu().view(bits))
    assert not torch.equal(on_cpu, x)  # it was quantized
    stats = lowbitcc.stats()["compressed"]
    assert stats["calls"] == 6
    assert stats["relative_error"] > 0


@needs_cupy
def test_the_default_format_without_feedback_equals_the_cpu_call_bit_for_bit(group):
    """The default since 2026-11-27 (NVFP4, no error state; the module's group keeps feedback
    on): compressed CUDA calls equal the CPU calls bit for bit."""
    plain = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(min_size=1))
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(4))
    on_cpu, on_gpu = x.clone(), x.cuda()
    lowbitcc.reset_stats()
    states = len(lowbitcc.state_dict()["states"])
    with lowbitcc.compressed():
        for _ in range(2):
            dist.all_reduce(on_cpu, group=plain)
            dist.all_reduce(on_gpu, group=plain)
    assert torch.equal(on_cpu.view(torch.int32), on_gpu.cpu().view(torch.int32))
    assert not torch.equal(on_cpu, x)  # it was quantized
    assert lowbitcc.stats()["compressed"]["calls"] == 4
    assert len(lowbitcc.state_dict()["states"]) == states  # no error state kept


@needs_cupy
@pytest.mark.parametrize("fmt", ["nvint3", "nvfp3"])
@pytest.mark.parametrize("feedback", [False, True])
def test_three_bit_calls_equal_the_cpu_calls_bit_for_bit(group, fmt, feedback):
    """The 3-bit formats (3-bit fields packed across bytes, docs/wire-format.md) on CUDA
    against the CPU's C++ codec: all-reduces (three, so that an error state carries over) and
    a reduce-scatter, with and without feedback, the same bits."""
    three = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(
        min_size=1, format=fmt, bits=3, feedback=feedback))
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(5))
    on_cpu, on_gpu = x.clone(), x.cuda()
    scattered_cpu, scattered_gpu = torch.empty_like(x), torch.empty_like(on_gpu)
    lowbitcc.reset_stats()
    with lowbitcc.compressed():
        for _ in range(3):
            with lowbitcc.feedback_key(f"cpu-{fmt}-{feedback}"):
                dist.all_reduce(on_cpu, group=three)
            with lowbitcc.feedback_key(f"gpu-{fmt}-{feedback}"):
                dist.all_reduce(on_gpu, group=three)
        dist.reduce_scatter_tensor(scattered_cpu, x, group=three)
        dist.reduce_scatter_tensor(scattered_gpu, x.cuda(), group=three)
    assert torch.equal(on_cpu.view(torch.int32), on_gpu.cpu().view(torch.int32))
    assert torch.equal(scattered_cpu.view(torch.int32), scattered_gpu.cpu().view(torch.int32))
    assert not torch.equal(on_cpu, x) and not torch.equal(scattered_cpu, x)  # quantized
    assert lowbitcc.stats()["compressed"]["calls"] == 8


@needs_cupy
def test_a_non_finite_call_voids_its_states_on_cuda_as_on_the_cpu(group):
    """A call that sees a NaN leaves its states voided by the call's verdict (their ``poison``
    word, read by the next encode: no kernel clears them); the calls after it must equal the
    same calls on CPU tensors, whose host drops the states, bit for bit."""
    gen = torch.Generator().manual_seed(5)
    inputs = [torch.randn(70_001, generator=gen) for _ in range(5)]
    inputs[2][123] = float("nan")
    results = {}
    with lowbitcc.compressed():
        for device in ("cpu", "cuda"):
            with lowbitcc.feedback_key(f"poison-{device}"):
                results[device] = []
                for x in inputs:
                    y = x.clone().to(device)  # the CPU pass must not overwrite the inputs
                    dist.all_reduce(y)
                    results[device].append(y.cpu())
    for call, (want, got) in enumerate(zip(results["cpu"], results["cuda"], strict=True)):
        # NaN where the CPU call has NaN (a GPU writes its canonical NaN, not the CPU's bits),
        # the same bits elsewhere
        nan = want.isnan()
        assert torch.equal(nan, got.isnan()), (call, nan.nonzero()[:4], got.isnan().nonzero()[:4])
        differ = (want.view(torch.int32) != got.view(torch.int32)) & ~nan
        assert not differ.any(), (call, differ.nonzero()[:4].flatten())
    assert results["cuda"][2].isnan().any()  # the NaN call's result
    assert results["cuda"][3].isfinite().all()


@needs_cupy
def test_compressed_reduce_scatter_on_cuda(group):
    x = torch.randn(4096 * 3, device="cuda")
    out = torch.empty_like(x)
    ref_in, ref_out = x.cpu(), torch.empty(x.numel())
    with lowbitcc.compressed():
        with lowbitcc.feedback_key("rs-gpu"):
            dist.reduce_scatter_tensor(out, x)
        with lowbitcc.feedback_key("rs-cpu"):
            dist.reduce_scatter_tensor(ref_out, ref_in)
    assert torch.equal(out.cpu(), ref_out)


@needs_cupy
def test_compressed_call_enqueues_without_host_sync(group):
    x = torch.randn(1 << 20, device="cuda")
    with lowbitcc.compressed(), lowbitcc.feedback_key("nosync"):
        dist.all_reduce(x)  # builds and loads the kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            dist.all_reduce(x)
            dist.all_reduce(x, async_op=True).wait()
        finally:
            torch.cuda.set_sync_debug_mode(0)


@needs_cupy
def test_cost_model_sends_cuda_calls_exact_where_compressing_does_not_pay(group):
    """At world size 1 NCCL's all-reduce moves nothing and takes microseconds, which encoding
    and decoding cannot beat: after its warm-up (``warmup`` compressed calls, then as many exact)
    the model, fed GPU times of the calls, sends every call exact (bit for bit the input),
    without a host wait."""
    modelled = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(
        policy="always", min_size=1, cost_model=True))
    x = torch.randn(1 << 20, device="cuda")
    warmup = modelled.cost_model.warmup
    lowbitcc.reset_stats()
    for _ in range(2 * warmup):
        dist.all_reduce(x.clone(), group=modelled)
    torch.cuda.synchronize()  # the warm-up's events are done: its timings are read next call
    results = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(20):
            y = x.clone()
            dist.all_reduce(y, group=modelled)
            results.append(y)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    stats = lowbitcc.stats()
    assert (stats["compressed"]["calls"], stats["exact"]["model_exact"]) == (warmup, warmup + 20)
    assert all(torch.equal(y, x) for y in results)
    (row,) = [r for r in modelled.cost_model.table() if r["device"] == "cuda"]
    assert 0 < row["exact_s_per_GB"] < row["compressed_s_per_GB"], row


@needs_cupy
def test_cuda_calls_under_min_size_go_to_nccl_without_a_descriptor_exchange(group):
    """Calls under ``min_size`` are exact on every rank, so they skip the host-side exchange
    (about 0.5 ms a call through the worker) and go to NCCL with the caller's options."""
    small = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(
        policy="always", min_size=1 << 20))
    exchanged = []
    agree = small._compressed.agreement.agree
    small._compressed.agreement.agree = lambda desc: exchanged.append(desc) or agree(desc)
    x = torch.ones(4096, device="cuda")
    out = torch.empty(4096, device="cuda")
    with lowbitcc.compressed():
        dist.all_reduce(x, group=small)
        dist.reduce_scatter_tensor(out, x, group=small)
        dist.all_reduce(torch.ones(1 << 20, device="cuda"), group=small)  # at min_size
    assert torch.equal(out, x) and torch.equal(x, torch.ones_like(x))
    assert [d.numel for d in exchanged] == [1 << 20]


@needs_cupy
def test_cuda_calls_left_exact_by_the_policy_exchange_a_descriptor(group):
    """An all-reduce or reduce-scatter of at least ``min_size`` elements that this rank leaves
    exact (outside backward, an integer dtype) still exchanges its descriptor: another rank may
    be about to compress the same call, and then both must take the exact path."""
    checked = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(
        min_size=1024, cost_model=False))
    world = dist.get_world_size()
    exchanged = []
    agree = checked._compressed.agreement.agree
    checked._compressed.agreement.agree = lambda desc: exchanged.append(desc) or agree(desc)
    x = torch.ones(4096, device="cuda")
    counts = torch.ones(4096, dtype=torch.int32, device="cuda")
    out = torch.empty(4096, device="cuda")
    dist.all_reduce(x, group=checked)  # outside backward: exact by policy
    dist.all_reduce(counts, group=checked)
    dist.reduce_scatter_tensor(out, torch.ones(4096 * world, device="cuda"), group=checked)
    dist.all_reduce(torch.ones(100, device="cuda"), group=checked)  # under min_size: no exchange
    torch.cuda.synchronize()
    assert [(d.numel, d.compressed) for d in exchanged] == [
        (4096, False), (4096, False), (4096 * world, False)]
    assert torch.equal(x, torch.full_like(x, world)) and torch.equal(out, x)
    assert torch.equal(counts, torch.full_like(counts, world))


@needs_cupy
def test_async_op_orders_with_the_callers_stream(group):
    from lowbitcc.tools import selftest

    lowbitcc.reset_stats()
    x = torch.randn(1 << 22, generator=torch.Generator().manual_seed(5))
    outcome = selftest.async_ordering(x, busy_products=30)
    assert outcome.status == "ok", outcome
    assert lowbitcc.stats()["compressed"]["calls"] == 2  # both calls were compressed
@needs_cupy
def test_side_stream_future_callbacks_see_the_result(group):
    x = torch.ones(1 << 16, device="cuda")
    with lowbitcc.compressed(), lowbitcc.feedback_key("then"):
        fut = dist.all_reduce(x, async_op=True).get_future()
        doubled = fut.then(lambda f: f.value()[0] * 2).wait()
    assert torch.allclose(doubled.cpu(), torch.full((1 << 16,), 2.0), rtol=0.02)


def _state_lifetime_calls(group, device: torch.device, inputs, hold_back) -> list[torch.Tensor]:
    """Key K's error state made by a synchronous call (memory of the caller's stream), updated
    in place by an asynchronous call on the side stream, dropped on the host by the next call
    (``reset_interval`` 2); ``hold_back()`` runs after that drop. The three results."""
    xs = [x.to(device) for x in inputs]
    with lowbitcc.compressed(), lowbitcc.feedback_key(f"state-lifetime-{device.type}"):
        dist.all_reduce(xs[0], group=group)
        hold_back("before")
        second = dist.all_reduce(xs[1], group=group, async_op=True)
        third = dist.all_reduce(xs[2], group=group, async_op=True)  # drops the state on the host
        hold_back("after")
        second.wait()
        third.wait()
    return xs


@needs_cupy
def test_an_error_state_dropped_on_the_host_outlives_its_use_on_the_side_stream(group):
    """The asynchronous call's kernels read and write the state on the side stream, held back
    by a sleep; the host drops it at the next call, and the caller then allocates memory of the
    same sizes on its own stream and fills it. The results must equal the same calls on CPU
    tensors bit for bit, and the caller's tensors must keep their values: the state is marked
    as used on the side stream (`ErrorState.record_stream`), so the allocator cannot hand its
    memory to the caller while the side stream still uses it. On the H200 (2026-11-26) this
    test passed also with that marking disabled (`benchmarks/gpu_suite.sh unfixed`): the
    allocator did not reuse the memory here, so it checks the behaviour, not the race."""
    device = torch.device("cuda", 0)
    lifetimes = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(
        min_size=1, reset_interval=2, cost_model=False, format="mxfp4", feedback=True))
    n = 1 << 16
    gen = torch.Generator().manual_seed(11)
    inputs = [torch.randn(n, generator=gen) for _ in range(3)]
    with lowbitcc.compressed(), lowbitcc.feedback_key("side-stream"):  # makes the side stream
        dist.all_reduce(torch.ones(n, device=device), group=lifetimes, async_op=True).wait()
    side = lifetimes._cuda._side[device]
    caller_tensors: list[torch.Tensor] = []

    def hold_back(when: str) -> None:
        if when == "before":
            with torch.cuda.stream(side):
                torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU clock
            return
        for _ in range(8):  # the sizes of an int8 state and its scales, and then some
            caller_tensors.append(torch.full((n,), 77, dtype=torch.int8, device=device))
            caller_tensors.append(torch.full((n // 32,), 3.0e30, device=device))

    got = _state_lifetime_calls(lifetimes, device, inputs, hold_back)
    torch.cuda.synchronize()
    want = _state_lifetime_calls(lifetimes, torch.device("cpu"), inputs, lambda when: None)
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want))
    assert all(bool((t == t.flatten()[0]).all()) for t in caller_tensors)


@needs_cupy
def test_graph_capture_takes_the_exact_path(group):
    x = torch.ones(1 << 16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with lowbitcc.compressed(), torch.cuda.stream(stream):
        dist.all_reduce(x)  # warm up outside the capture
        graph = torch.cuda.CUDAGraph()
        lowbitcc.reset_stats()
        with torch.cuda.graph(graph):
            dist.all_reduce(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert lowbitcc.stats()["compressed"]["calls"] == 0


@needs_cupy
def test_checkpoint_is_on_the_cpu_and_resumes_on_the_gpu(group):
    x = torch.randn(50_000, device="cuda")
    with lowbitcc.compressed(), lowbitcc.feedback_key("ckpt"):
        dist.all_reduce(x.clone())
    saved = lowbitcc.state_dict()
    assert saved["states"] and all(v["data"].device.type == "cpu"
                                   for v in saved["states"].values())
    with lowbitcc.compressed(), lowbitcc.feedback_key("ckpt"):
        a = x.clone()
        dist.all_reduce(a)
    lowbitcc.load_state_dict(saved)
    with lowbitcc.compressed(), lowbitcc.feedback_key("ckpt"):
        b = x.clone()
        dist.all_reduce(b)
    assert torch.equal(a, b)


def _train(model_fn, wrap, rank: int, steps: int) -> float:
    torch.manual_seed(0)
    model = wrap(model_fn().cuda())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    loss = torch.zeros(())
    for _ in range(steps):
        x = torch.randn(64, 256, generator=gen).cuda()
        y = torch.randint(10, (64,), generator=gen).cuda()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())


def _mlp():
    import torch.nn as nn

    return nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                         nn.Linear(512, 10))


def _parity_rank(rank: int, world: int, gloo, kind: str, steps: int) -> dict[str, float]:
    """The same training on the "loco" default group and on a plain nccl group, one GPU per
    rank: DDP, or FSDP2 (fully_shard) on a one-dimensional mesh of each group."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lowbitcc.tools import spawn

    device = spawn.gpu_device(rank)
    nccl = dist.new_group(list(range(world)), backend="nccl")
    losses = {}
    for name, group in (("loco", dist.group.WORLD), ("nccl", nccl)):
        lowbitcc.reset_stats()
        if kind == "ddp":
            def wrap(m, group=group):
                return DDP(m, device_ids=[device.index], process_group=group)
        else:
            mesh = DeviceMesh.from_group(group, "cuda")

            def wrap(m, mesh=mesh):
                for layer in m:
                    if isinstance(layer, torch.nn.Linear):
                        fully_shard(layer, mesh=mesh)
                return fully_shard(m, mesh=mesh)
        losses[name] = _train(_mlp, wrap, rank, steps)
        if name == "loco":
            stats = lowbitcc.stats()["compressed"]
            losses["calls"] = stats["calls"]
            losses["ratio"] = stats["wire_bytes"] / max(stats["logical_bytes"], 1)
    return losses


@needs_cupy
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_training_on_loco_matches_nccl(kind, world):
    """2 and 4 ranks: one per GPU, or several on one GPU with their own ``NCCL_HOSTID``
    (`spawn.gpu_rank_env`); every bucket goes through the compressed path."""
    from lowbitcc.tools import spawn
    from tests.support.ranks import run_ranks

    rank_env = spawn.gpu_rank_env(world, torch.cuda.device_count())
    # the cost model off: on fast GPU links it would (rightly) send most buckets exact
    for r in run_ranks(_parity_rank, world, kind, 30, env={"LOCO_COST_MODEL": "0"},
                       rank_env=rank_env, timeout=600):
        assert r["calls"] > 0, r  # gradients went through the compressed path
        assert abs(r["loco"] - r["nccl"]) < 0.05 * abs(r["nccl"]) + 0.02, r
        assert 0 < r["ratio"] <= 1 / 6, r


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lowbitcc.tools.cli", *args],
                          capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in os.environ.items()
                               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")})


@needs_cupy
def test_codec_bench_and_perf_run_on_cuda(tmp_path):
    """codec-bench's CUDA rows carry the device throughputs (the profiler saw GPU work)."""
    import json

    bench = _cli("codec-bench", "--device", "cuda", "-b", "1M", "-e", "4M", "--min-time", "0.05",
                 "--json", str(tmp_path / "c.json"))
    assert bench.returncode == 0, bench.stderr[-3000:]
    assert "cuda" in bench.stdout and "4MiB" in bench.stdout
    rows = [r for r in json.loads((tmp_path / "c.json").read_text())["rows"] if r["impl"] == "cuda"]
    assert rows and all(r[f"{k}_device_GBps"] > 0 for r in rows for k in ("copy", "encode", "decode"))
    perf = _cli("perf", "all_reduce", "--device", "cuda", "--np", "1", "--backend", "loco",
                "nccl", "-b", "1M", "-e", "4M", "-n", "3", "-w", "1")
    assert perf.returncode == 0, perf.stderr[-3000:]
    assert "loco4" in perf.stdout and "nccl" in perf.stdout


@needs_cupy
def test_bench_train_runs_on_cuda_against_nccl(tmp_path):
    """`lowbitcc bench-train --device cuda` on 2 ranks (sharing a GPU where there is one):
    every CUDA scheme trains and reports, from the same model and batches."""
    import json

    from lowbitcc.tools.bench_train import default_schemes

    done = _cli("bench-train", "--device", "cuda", "--np", "2", "--config", "quick", "--steps",
                "3", "--warmup", "1", "--json", str(tmp_path / "b.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["scheme"]: r for r in json.loads((tmp_path / "b.json").read_text())["rows"]}
    assert list(rows) == list(default_schemes("cuda"))
    losses = [r["final_loss"] for r in rows.values()]
    assert max(losses) - min(losses) < 0.1, losses


@needs_cupy
def test_the_demo_trains_on_gpus_against_nccl():
    """`lowbitcc demo` where a GPU is visible: DDP over loco beside DDP over nccl, 2 ranks
    (sharing the GPU where there is one), the same lines as on the CPU."""
    from tests.support.ranks import clean_env

    done = subprocess.run([sys.executable, "-m", "lowbitcc", "demo", "--steps", "6", "--width",
                           "64", "--depth", "1", "--link", "none"], capture_output=True,
                          text=True, timeout=300, env=clean_env())
    assert done.returncode == 0, done.stderr[-3000:]
    for line in ("ranks on GPUs", "loss nccl", "loss loco", "cost model:", "x nccl's speed"):
        assert line in done.stdout, done.stdout
