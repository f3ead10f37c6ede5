"""Per-dimension settings on a DeviceMesh (issue 17): each dimension's groups get their own
`LocoConfig` through ``init_device_mesh(..., backend_override=...)``, or plain gloo."""

from __future__ import annotations

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
    return report


def test_each_mesh_dimension_takes_its_own_settings():
    """DP at 8 bits, compressing every call; TP a "loco" group at policy never: the TP
    all-reduce returns gloo's bits while the DP one is compressed (within 8-bit error)."""
    for report in run_ranks(_per_dimension, 4, "loco", timeout=120):
        backend, compressed, exact, error = report["dp"]
        assert (backend, compressed, exact) == ("loco", 1, False) and error < 0.05
        assert report["tp"][:3] == ("loco", 0, True)


def test_a_mesh_dimension_may_stay_on_gloo():
    for report in run_ranks(_per_dimension, 4, "gloo", timeout=120):
        assert report["dp"][:2] == ("loco", 1)
        assert report["tp"][:3] == ("gloo", 0, True)


def _train_2d(rank, world, gloo, scheme):
    from lowbitcc.tools.hybrid import train_2d

    losses, stats, backends = train_2d(rank, world, scheme)
    return losses, stats["compressed"]["calls"], backends


@pytest.mark.slow  # trains; tools/hybrid_bytes.py runs every scheme
def test_a_2x2_mesh_trains_with_dp_over_loco_and_tp_exact():
    """Data parallel over "loco" (4-bit LoCo gradients and 8-bit parameter all-gathers),
    tensor parallel exact on gloo: the loss of the last 5 of 30 steps within 1% of the
    all-gloo run on every rank."""
    reference = run_ranks(_train_2d, 4, "gloo", timeout=240)
    for scheme in ("hybrid+gathers",):  # tools/hybrid_bytes.py runs plain "hybrid" too
        for (ref, _, _), (ours, calls, backends) in zip(
                reference, run_ranks(_train_2d, 4, scheme, timeout=240), strict=True):
            assert backends == {"dp": "loco", "tp": "gloo"}, backends
            # a reduce-scatter per step, and with gathers an all-gather in forward too
            assert calls >= (60 if scheme == "hybrid+gathers" else 30), (scheme, calls)
            tail_ref, tail = sum(ref[-5:]) / 5, sum(ours[-5:]) / 5
            assert ours[-1] < 0.8 * ours[0], "did not train"
            assert abs(tail - tail_ref) <= 0.01 * tail_ref, (scheme, tail, tail_ref)
