"""torch.compile over "loco": DDP around a compiled model, a compiled DDP (DDPOptimizer's
bucketed graph breaks), compiled autograd, and a compiled FSDP2 model train with their gradients
compressed, replicas equal, within the training tests' tolerance of the same run over gloo.

A compiled DDP failed before `lowbitcc.backend.eager`: DDP's bucket rebuild in its compiled
forward calls the group's Python ``broadcast`` from C++, and torch.compile tried to compile it
("Attempted to access unregistered member on an OpaqueObject"). The ``aot_eager`` backend keeps
these tests fast (dynamo, AOTAutograd and DDPOptimizer run; inductor's code generation does
not, and the collectives do not depend on it)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lowbitcc
from tests.support.ranks import run_ranks
from tests.support.training import assert_replicas_equal, flat_parameters, mlp, regression_steps

STEPS = 5
LOSS_TOLERANCE = 0.02


def _compiled(mode: str, group: dist.ProcessGroup) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = mlp()
    if mode == "ddp-of-compiled":
        return DDP(torch.compile(model, backend="aot_eager"), process_group=group)
    if mode in ("compiled-ddp", "compiled-autograd"):
        return torch.compile(DDP(model, process_group=group), backend="aot_eager")
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, "cpu")
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return torch.compile(fully_shard(model, mesh=mesh), backend="aot_eager")


def _train(model: nn.Module, rank: int) -> list[float]:
    return regression_steps(model, torch.optim.SGD(model.parameters(), lr=0.05), rank, STEPS)


def _both(rank, world, gloo, mode):
    import torch._dynamo

    torch._dynamo.config.compiled_autograd = mode == "compiled-autograd"
    loco_model = _compiled(mode, dist.group.WORLD)
    loco = _train(loco_model, rank)
    stats = lowbitcc.stats()["compressed"]
    compressed = (stats["calls"], stats["wire_bytes"] / max(1, stats["logical_bytes"]))
    assert_replicas_equal(flat_parameters(loco_model), gloo, mode)
    torch._dynamo.reset()
    reference = _train(_compiled(mode, gloo), rank)
    return loco, reference, compressed


@pytest.mark.parametrize("mode", ["ddp-of-compiled", "compiled-ddp", "compiled-autograd",
                                  "fsdp2-compiled"])
def test_compiled_models_train_over_loco_with_their_gradients_compressed(mode):
    results = run_ranks(_both, 2, mode, env={"LOCO_COST_MODEL": "0", "LOCO_MIN_SIZE": "4096"},
                        timeout=300)
    for loco, reference, (compressed, ratio) in results:
        assert compressed >= STEPS, f"{mode}: {compressed} compressed calls in {STEPS} steps"
        assert ratio < 1 / 6, f"{mode}: wire bytes {ratio:.3f} of the logical bytes"
        gap = abs(sum(loco[-2:]) - sum(reference[-2:])) / sum(reference[-2:])
        assert gap < LOSS_TOLERANCE, (mode, loco, reference)
