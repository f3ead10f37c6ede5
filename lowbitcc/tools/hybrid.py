"""Data parallel x tensor parallel training on a 2 x 2 CPU mesh, by scheme (issue 17).

`train_2d` runs on every rank of 4 (started by ``spawn.run_ranks``): FSDP2 on the "dp"
dimension over a column- then row-parallel MLP on "tp", Adam, ``steps`` steps of a teacher
regression, one data stream per DP rank. Schemes: "gloo" (every dimension on gloo), "hybrid"
(`lowbitcc.hybrid_mesh`: DP over "loco", 4-bit LoCo gradients with the cost model off; TP exact
on gloo), "hybrid+gathers" (the same with 8-bit parameter all-gathers), "naive" (TP over "loco"
too, every TP all-reduce at 4 bits: the activations in forward and their gradients in
backward). Used by
``tests/backend/test_device_mesh.py`` and ``tools/hybrid_bytes.py``; the seed of the hybrid
study.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import lowbitcc

SCHEMES = ("gloo", "hybrid", "hybrid+gathers", "naive")


def train_2d(rank: int, world: int, scheme: str, steps: int = 30, seed: int = 0
             ) -> tuple[list[float], dict[str, Any], dict[str, str]]:
    """``(losses, stats, backends)``: this rank's loss per step, its `lowbitcc.stats()` (the
    "loco" groups' counters, reset before training) and each dimension's backend. ``seed``
    draws the initial weights and the data."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if scheme not in SCHEMES:
        raise ValueError(f"lowbitcc: scheme must be one of {SCHEMES}, got {scheme!r}")
    if scheme == "gloo":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"),
                                backend_override={"dp": "gloo", "tp": "gloo"})
    else:
        configs = {"dp": lowbitcc.LocoConfig(cost_model=False)}
        if scheme == "naive":  # the TP all-reduces hold 2048 and 16384 elements
            configs["tp"] = lowbitcc.LocoConfig(policy="always", cost_model=False,
                                                min_size=1024)
        mesh = lowbitcc.hybrid_mesh("cpu", (2, 2), configs=configs,
                                    param_bits=8 if scheme == "hybrid+gathers" else None)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(),
                          nn.Linear(512, 8))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    teacher = torch.randn(64, 8, generator=torch.Generator().manual_seed(1234 + seed))
    data = torch.Generator().manual_seed(99 + 1000 * seed + mesh["dp"].get_local_rank())
    losses = []
    lowbitcc.reset_stats()
    for _ in range(steps):
        x = torch.randn(32, 64, generator=data)
        y = torch.tanh(x @ teacher) + 0.05 * torch.randn(32, 8, generator=data)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    backends = {dim: dist.get_backend(mesh.get_group(dim)) for dim in ("dp", "tp")}
    return losses, lowbitcc.stats(), backends
