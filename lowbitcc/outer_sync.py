"""DiLoCo-style outer synchronisation: train locally, and every ``every`` steps average the
pseudo-gradients of the sites over a group and take one outer optimizer step.

Each site (one rank, or a DDP or FSDP2 group of ranks) runs its own inner optimizer; the sites
meet only in `OuterSync.sync`:

1. the pseudo-gradient ``anchor - current`` of every parameter (``anchor``: the parameters
   after the previous outer step), flattened into one fp32 buffer: **one** all-reduce per
   outer step, so a latency-bound link pays one call's round trips, not one per tensor;
2. that buffer summed over ``group`` (divided by its size) under the error-feedback key ``key``
   (`lowbitcc.feedback_key`), so that LoCo's feedback follows the pseudo-gradient from one
   outer step to the next; ``compress`` says how a "loco" group sends it: ``"auto"`` where the
   group's cost model finds that compression pays on its link (`lowbitcc.compressible`; always,
   with the cost model off), ``"always"`` (`lowbitcc.compressed`), ``"never"``
   (`lowbitcc.exact`); over a group of another backend (gloo, nccl, a torchft-style process
   group) the same call runs exact;
3. the outer optimizer (SGD with Nesterov momentum, DiLoCo's: lr 0.7, momentum 0.9) steps the
   anchor by the averaged pseudo-gradient, and every parameter is set to the new anchor.

Parameters may be plain tensors (DDP, or no wrapper) or FSDP2's DTensors: the pseudo-gradient of
a DTensor is taken on its local shard, so every site must shard alike (same site size), as a
DeviceMesh of ``("outer", "inner")`` dimensions gives. The anchor and the outer optimizer's
momentum are one copy of this rank's parameters (or shards) in fp32, on their device.

`state_dict` / `load_state_dict` carry the anchor, the momentum and the step count; the error
feedback of the outer calls is in `lowbitcc.state_dict` (per rank) like every other key.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from lowbitcc.policy import compressed, compressible, exact, feedback_key

_MODES = {"auto": compressible, "always": compressed, "never": exact}


def _local(param: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of ``param`` (a DTensor's local shard; plain tensors as they
    are), detached; writing into it writes the parameter."""
    local = param.to_local() if hasattr(param, "to_local") else param
    return local.detach()


class OuterSync:
    """Outer synchronisation of ``params`` over ``group`` every ``every`` inner steps.

    Call `step` after each inner optimizer step (it calls `sync` every ``every``-th time and
    returns whether it did), or `sync` directly. Every rank of ``group`` must call `sync` at the
    same points, with parameters of the same shapes in the same order (it is a collective).
    """

    def __init__(self, params: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None,
                 every: int = 50, lr: float = 0.7, momentum: float = 0.9,
                 nesterov: bool = True, compress: str = "auto", key: str = "outer") -> None:
        self.params = [p for p in params]
        if not self.params:
            raise ValueError("lowbitcc.OuterSync: no parameters")
        if compress not in _MODES:
            raise ValueError(f"lowbitcc.OuterSync: compress must be one of {list(_MODES)}, "
                             f"got {compress!r}")
        if every < 1:
            raise ValueError(f"lowbitcc.OuterSync: every must be at least 1, got {every}")
        self.group = group
        self.every = every
        self.compress = compress
        self.key = key
        self.inner_steps = 0
        self.outer_steps = 0
        with torch.no_grad():
            self.anchor = [torch.nn.Parameter(_local(p).float().clone()) for p in self.params]
        self.optimizer = torch.optim.SGD(self.anchor, lr=lr, momentum=momentum,
                                         nesterov=nesterov and momentum > 0)

    def step(self) -> bool:
        """Count one inner step; synchronise when it is the ``every``-th. Returns whether it
        synchronised."""
        self.inner_steps += 1
        if self.inner_steps % self.every:
            return False
        self.sync()
        return True

    @torch.no_grad()
    def sync(self) -> None:
        """One outer step (module docstring): every rank of ``group`` ends with the same
        anchor, and its parameters set to it."""
        locals_ = [_local(p) for p in self.params]
        flat = torch.cat([(a - loc.float()).reshape(-1) for a, loc in zip(self.anchor, locals_,
                                                                          strict=True)])
        with _MODES[self.compress](), feedback_key(self.key):
            dist.all_reduce(flat, group=self.group)
        flat /= dist.get_world_size(self.group)
        offset = 0
        for anchor in self.anchor:
            anchor.grad = flat[offset:offset + anchor.numel()].view_as(anchor)
            offset += anchor.numel()
        self.optimizer.step()
        for anchor, loc in zip(self.anchor, locals_, strict=True):
            anchor.grad = None
            loc.copy_(anchor)
        self.outer_steps += 1

    def state_dict(self) -> dict[str, Any]:
        """The anchor and the outer optimizer's state (copies: later steps do not change
        them) and the step counts."""
        return {"anchor": [a.detach().clone() for a in self.anchor],
                "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                "inner_steps": self.inner_steps, "outer_steps": self.outer_steps}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore `state_dict`'s output (same parameters' shapes; copied, so ``saved`` stays
        as it was). Raises ``ValueError`` naming the first anchor tensor that does not fit, and
        changes nothing then."""
        anchors = saved.get("anchor") if isinstance(saved, dict) else None
        if not isinstance(anchors, list) or len(anchors) != len(self.anchor):
            raise ValueError("lowbitcc.OuterSync.load_state_dict: expected a state_dict of "
                             f"{len(self.anchor)} anchor tensors")
        for i, (mine, theirs) in enumerate(zip(self.anchor, anchors, strict=True)):
            if not isinstance(theirs, torch.Tensor) or theirs.shape != mine.shape:
                raise ValueError(f"lowbitcc.OuterSync.load_state_dict: anchor {i} has shape "
                                 f"{getattr(theirs, 'shape', None)}, the parameter "
                                 f"{tuple(mine.shape)}")
        with torch.no_grad():
            for mine, theirs in zip(self.anchor, anchors, strict=True):
                mine.copy_(theirs)
        self.optimizer.load_state_dict(copy.deepcopy(saved["optimizer"]))  # not aliased
        self.inner_steps = int(saved["inner_steps"])
        self.outer_steps = int(saved["outer_steps"])
