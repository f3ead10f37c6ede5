"""Resuming DDP bit for bit: `rebuild_ddp_buckets`.

DDP reduces its gradients in buckets laid out in reverse parameter order on its first step, then
rebuilds them once in the order the gradients became ready, and keeps that layout. A run resumed
from a checkpoint builds a new DDP, whose first step reduces the initial layout again, while the
error-feedback states saved with `lowbitcc.state_dict` were made on the rebuilt one: the resumed
step adds them to other elements (and the rebuild at the next step drops them), so it is not the
uninterrupted run's step. `rebuild_ddp_buckets` runs one forward and backward pass with every
call exact (no error state is read or written), without side effects on the module's buffers or
the random number generators, and drops the gradients it made; DDP rebuilds its buckets at the
next forward, so the first resumed step reduces the layout the states were made on
(docs/reliability.md; tested bit for bit in tests/backend/test_training.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_leaves

from lowbitcc import policy


def rebuild_ddp_buckets(model: DistributedDataParallel, *inputs: Any,
                        loss: Callable[[Any], torch.Tensor] | None = None,
                        **kwargs: Any) -> None:
    """Make ``model`` (a fresh DDP, e.g. after loading a checkpoint) rebuild its buckets before
    its first training step, as the run that saved the checkpoint did after its own first step.

    Runs ``model(*inputs, **kwargs)`` in training mode and ``loss(output)`` (default: the sum
    of every floating-point tensor in the output that requires grad) backward, under `exact()`;
    then restores the module's buffers (e.g. BatchNorm statistics) and the CPU and CUDA random
    number generators, and sets every gradient to None. ``inputs`` should be a batch like the
    training batches (the rebuilt layout follows the order in which gradients become ready). Call
    it on every rank, after loading the model, the optimizer and `lowbitcc.load_state_dict`.
    With the cost model on, the resumed run's exact/compressed choices may still differ from the
    uninterrupted run's (the cost model's timings are not checkpointed); ``LOCO_COST_MODEL=0``
    makes them the same."""
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"lowbitcc.rebuild_ddp_buckets needs a DistributedDataParallel model, got "
                        f"{type(model).__name__} (FSDP needs no rebuild)")
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    was_training = model.training
    model.train()
    try:
        with policy.exact():
            output = model(*inputs, **kwargs)
            value = loss(output) if loss is not None else _sum_of(output)
            value.backward()
    finally:
        model.train(was_training)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        model.zero_grad(set_to_none=True)


def _sum_of(output: Any) -> torch.Tensor:
    """The sum of every floating-point tensor in ``output`` that requires grad."""
    leaves = [t for t in tree_leaves(output)
              if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    if not leaves:
        raise ValueError("lowbitcc.rebuild_ddp_buckets: the model's output holds no tensor that "
                         "requires grad; pass loss=... to reduce it to one")
    return torch.stack([t.float().sum() for t in leaves]).sum()
