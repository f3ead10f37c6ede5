"""Bytes per step on the data-parallel dimension, and the final loss, of FSDP2 x tensor
parallel on a 2 x 2 CPU mesh, three ways: all gloo, hybrid (DP over "loco" 4-bit LoCo, TP
exact on gloo), hybrid with 8-bit parameter all-gathers. The training is the one of
``tests/backend/test_device_mesh.py::test_a_2x2_mesh_trains_with_dp_over_loco_and_tp_exact``
(30 steps, seed 0); it prints rank 0's ``lowbitcc.stats()`` of the "dp" groups per step.

    python tools/hybrid_bytes.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import lowbitcc
from lowbitcc.tools import spawn

STEPS = 30


def _train(rank: int, world: int, scheme: str) -> tuple[list[float], dict]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if scheme == "gloo":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"),
                                backend_override={"dp": "gloo", "tp": "gloo"})
    else:
        mesh = lowbitcc.hybrid_mesh("cpu", (2, 2), configs={
            "dp": lowbitcc.LocoConfig(cost_model=False)},
            param_bits=8 if scheme == "hybrid+gathers" else None)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(),
                          nn.Linear(512, 8))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    teacher = torch.randn(64, 8, generator=torch.Generator().manual_seed(1234))
    data = torch.Generator().manual_seed(99 + mesh["dp"].get_local_rank())
    losses = []
    lowbitcc.reset_stats()
    for _ in range(STEPS):
        x = torch.randn(32, 64, generator=data)
        y = torch.tanh(x @ teacher) + 0.05 * torch.randn(32, 8, generator=data)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    dist.barrier()
    return losses, lowbitcc.stats()


def main() -> None:
    print(f"{'scheme':>15} {'last-5 loss':>11} {'RS+AG logical MB':>16} {'codes MB':>8} "
          f"{'exact MB':>8}")
    for scheme in ("gloo", "hybrid", "hybrid+gathers"):
        losses, stats = spawn.run_ranks(_train, 4, scheme, backend="gloo", timeout_s=600)[0]
        comp, exact = stats["compressed"], stats["exact"]
        print(f"{scheme:>15} {sum(losses[-5:]) / 5:>11.5f} "
              f"{comp['logical_bytes'] / STEPS / 1e6:>16.3f} "
              f"{comp['wire_bytes'] / STEPS / 1e6:>8.3f} "
              f"{exact['tensor_bytes'] / STEPS / 1e6:>8.3f}")


if __name__ == "__main__":
    main()
