"""What the training tests share: a small MLP, steps of a seeded regression on it, and the
parameters of every replica compared across ranks."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

INPUTS, OUTPUTS = 64, 8


def mlp() -> nn.Module:
    """64 -> 512 -> 512 -> 8 with tanh, seeded: 300,552 parameters, the same on every rank."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(INPUTS, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(),
                         nn.Linear(512, OUTPUTS))


def bucketed_ddp(group: dist.ProcessGroup) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A seeded 64 -> 64 -> 64 MLP with tanh in DDP over ``group``, its buckets 10 KB (two
    bucket calls a step), and its SGD (learning rate 0.1)."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)),
                                    process_group=group, bucket_cap_mb=0.01)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def regression_steps(model: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: int,
                     start: int = 0, after_step: Callable[[], object] | None = None) -> list[float]:
    """Steps ``start .. start + steps - 1`` of fitting ``model`` to the first outputs of its
    inputs, on this rank's own batches (seeded by rank and step); ``after_step`` runs after each
    optimizer step. Returns the losses."""
    losses = []
    for step in range(start, start + steps):
        x = torch.randn(16, INPUTS, generator=torch.Generator().manual_seed(100 * rank + step))
        loss = (model(x) - x[:, :OUTPUTS]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if after_step is not None:
            after_step()
        losses.append(float(loss.detach()))
    return losses


def flat_parameters(model: nn.Module) -> torch.Tensor:
    """Every parameter of ``model``, whole (FSDP2's DTensors gathered), in one flat tensor."""
    return torch.cat([p.detach().full_tensor().reshape(-1) if hasattr(p, "full_tensor")
                      else p.detach().reshape(-1) for p in model.parameters()])


def assert_replicas_equal(values: torch.Tensor, group: dist.ProcessGroup, what: str) -> None:
    """``values`` are bitwise the same on every rank of ``group`` (their maximum is them)."""
    top = values.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    assert torch.equal(top, values), f"{what}: ranks differ"
