"""Per-dimension settings on a DeviceMesh: each dimension's groups get their own
`LocoConfig` through ``init_device_mesh(..., backend_override=...)``, or plain gloo."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import lowbitcc
from tests.support.ranks import run_ranks

N = 1 << 17


def _per_dimension(rank, world, gloo, tp_backend):
    tp_override = ("loco", lowbitcc.LocoConfig(policy="never")) if tp_backend == "loco" else "gloo"
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"), backend_override={
        "dp": ("loco", lowbitcc.LocoConfig(bits=8, policy="always", cost_model=False)),
        "tp": tp_override})
    # gloo references for every dimension group, created by every rank in the same order
    references = {tuple(r): dist.new_group(r, backend="gloo")
                  for r in ([0, 2], [1, 3], [0, 1], [2, 3])}
    report = {}
    for dim in ("dp", "tp"):
        group = mesh.get_group(dim)
        reference = references[tuple(dist.get_process_group_ranks(group))]
        x = torch.linspace(-1, 1, N) * (rank + 1)
        ours, theirs = x.clone(), x.clone()
        lowbitcc.reset_stats()
        dist.all_reduce(ours, group=group)
        compressed = lowbitcc.stats()["compressed"]["calls"]
        dist.all_reduce(theirs, group=reference)
        report[dim] = (dist.get_backend(group), compressed, torch.equal(ours, theirs),
                       float((ours - theirs).abs().max()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lowbitcc.hybrid_mesh("cpu", (2, 2), ("dp", "tp"), configs={
            "tp": lowbitcc.LocoConfig(feedback=tp_backend == "loco")})
    report["warnings"] = [str(w.message) for w in caught if "hybrid_mesh" in str(w.message)]
    return report


def test_dimensions_whose_names_start_with_dp_are_data_parallel():
    from lowbitcc.mesh import is_data_parallel

    assert all(map(is_data_parallel, ("dp", "dp_replicate", "dp_shard", "dp_shard_cp")))
    assert not any(map(is_data_parallel, ("tp", "pp", "cp", "ep")))


def test_each_mesh_dimension_takes_its_own_settings():
    """DP at 8 bits, compressing every call; TP a "loco" group at policy never: the TP
    all-reduce returns gloo's bits while the DP one is compressed (within 8-bit error)."""
    for report in run_ranks(_per_dimension, 4, "loco", timeout=120):
        backend, compressed, exact, error = report["dp"]
        assert (backend, compressed, exact) == ("loco", 1, False) and error < 0.05
        assert report["tp"][:3] == ("loco", 0, True)
        # hybrid_mesh warns of feedback on a tensor-parallel dimension (not without it, below)
        assert len(report["warnings"]) == 1 and "'tp'" in report["warnings"][0]


def test_a_mesh_dimension_may_stay_on_gloo():
    for report in run_ranks(_per_dimension, 4, "gloo", timeout=120):
        assert report["dp"][:2] == ("loco", 1)
        assert report["tp"][:3] == ("gloo", 0, True)
        assert report["warnings"] == []


def _train_2d(rank, world, gloo, schemes, steps):
    import torch.distributed as dist

    from lowbitcc.tools import hybrid

    opts = hybrid.HybridOptions(config="quick", schemes=schemes, seeds=(0,), steps=steps,
                                warmup=1)
    return hybrid.train_seed(rank, world, opts, 0, dist.new_group(backend="gloo"))


@pytest.mark.slow  # about 17 s on 2 cores (`lowbitcc hybrid`'s GPT on 4 ranks); with `-m slow`
def test_a_2x2_gpt_mesh_trains_and_each_scheme_keeps_its_own_groups():
    """`lowbitcc hybrid`'s GPT (tensor-parallel attention and MLP x FSDP2), 6 steps: the
    exact scheme, built after the naive one in the same processes, compresses nothing (each
    scheme's mesh has its own groups); hybrid with 8-bit parameter all-gathers compresses its
    DP calls and ends within 2% of exact; naive compresses its TP calls as well."""
    for out in run_ranks(_train_2d, 4, ("naive", "exact", "hybrid+pg8"), 6, timeout=240):
        assert out["exact"]["compressed_calls"] == 0
        # per step the reduce-scatters of 2 blocks and the root, and the root's all-gather
        # (the blocks' 12.5 Ki-element shards are under the DP min_size of 16 Ki)
        assert out["hybrid+pg8"]["compressed_calls"] >= 6 * 4, out["hybrid+pg8"]
        # naive adds 4 TP all-reduces per block in backward (q, k, v, fc1), 2 in forward
        assert out["naive"]["compressed_calls"] >= out["hybrid+pg8"]["compressed_calls"] + 6 * 12
        ref = out["exact"]["val_loss"]
        assert abs(out["hybrid+pg8"]["val_loss"] - ref) <= 0.02 * ref
        assert out["exact"]["losses"][-1] < out["exact"]["losses"][0]


@pytest.mark.slow  # trains 30 steps; `lowbitcc hybrid` runs the study
def test_a_2x2_mesh_trains_with_dp_over_loco_and_tp_exact():
    """Data parallel over "loco" (4-bit LoCo gradients and 8-bit parameter all-gathers),
    tensor parallel exact on gloo: the training loss of the last 5 of 30 steps within 1% of
    the exact run on every rank."""
    for out in run_ranks(_train_2d, 4, ("exact", "hybrid+pg8"), 30, timeout=400):
        ref, ours = out["exact"]["losses"], out["hybrid+pg8"]["losses"]
        assert ours[-1] < 0.8 * ours[0], "did not train"
        tail_ref, tail = sum(ref[-5:]) / 5, sum(ours[-5:]) / 5
        assert abs(tail - tail_ref) <= 0.01 * tail_ref, (tail, tail_ref)


def _pipeline(rank, world, gloo, scheme, steps=20):
    """A two-stage pipeline (one Linear stage per "pp" rank, activations and their gradients
    sent point to point) with DDP on each stage over "dp": every dimension on gloo, or
    `hybrid_mesh` (DP over "loco" 4-bit, PP exact on gloo). Returns the last stage's losses
    (others: None), this rank's compressed calls and the dimensions' backends."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    names = (f"dp.{scheme}", f"pp.{scheme}")
    if scheme == "gloo":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names,
                                backend_override={n: "gloo" for n in names})
    else:
        mesh = lowbitcc.hybrid_mesh("cpu", (2, 2), names, configs={
            names[0]: lowbitcc.LocoConfig(cost_model=False, min_size=1024)})
    dp, pp = mesh.get_group(names[0]), mesh.get_group(names[1])
    stage, peer = mesh.get_local_rank(names[1]), dist.get_process_group_ranks(pp)
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(32, 256), nn.Tanh()), nn.Linear(256, 4)]
    model = DDP(layers[stage], process_group=dp)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(10 + mesh.get_local_rank(names[0]))
    teacher = torch.randn(32, 4, generator=torch.Generator().manual_seed(3))
    lowbitcc.reset_stats()
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 32, generator=data)
        opt.zero_grad()
        if stage == 0:
            h = model(x)
            dist.send(h.detach(), peer[1], group=pp)
            grad = torch.empty_like(h)
            dist.recv(grad, peer[1], group=pp)
            h.backward(grad)
        else:
            h = torch.empty(16, 256)
            dist.recv(h, peer[0], group=pp)
            h.requires_grad_()
            loss = nn.functional.mse_loss(model(h), torch.tanh(x @ teacher))
            loss.backward()
            dist.send(h.grad, peer[0], group=pp)
            losses.append(float(loss))
        opt.step()
    backends = tuple(dist.get_backend(g) for g in (dp, pp))
    return (losses or None), lowbitcc.stats()["compressed"]["calls"], backends


def _pipelines(rank, world, gloo):
    return {scheme: _pipeline(rank, world, gloo, scheme) for scheme in ("gloo", "hybrid")}


@pytest.mark.slow  # 4 ranks, two trainings
def test_a_pipeline_dimension_stays_exact_while_data_parallel_compresses():
    """`hybrid_mesh` on a (dp, pp) mesh: the pipeline's point-to-point traffic runs on gloo,
    both stages' DDP gradients are compressed (one bucket per step), and the last stage's
    loss stays within 2% of the all-gloo pipeline's (trained in the same ranks)."""
    for rank, out in enumerate(run_ranks(_pipelines, 4, timeout=120)):
        (ref, _, _), (mine, calls, backends) = out["gloo"], out["hybrid"]
        assert backends == ("loco", "gloo")
        assert calls >= 20, (rank, calls)
        if mine is not None:
            assert mine[-1] < 0.5 * mine[0], "did not train"
            tail_ref, tail = sum(ref[-5:]) / 5, sum(mine[-5:]) / 5
            assert abs(tail - tail_ref) <= 0.02 * tail_ref, (tail, tail_ref)
