"""lowbitcc: LoCo-compressed collectives for PyTorch behind ``init_process_group("loco")``.

Public API (everything else is internal):

- ``LocoConfig``: the configuration (also read from ``LOCO_*`` environment variables);
- ``exact()``, ``compressed()``, ``compressible()``, ``feedback_key(name)``: per-call control
  (context managers);
- ``stats()`` / ``reset_stats()``: bytes, calls and time of this process's "loco" groups, and
  ``StepMetrics``: their per-step changes as flat scalars for loggers (`lowbitcc.metrics`);
- ``state_dict()`` / ``load_state_dict()``: the error-feedback state, for checkpoints;
  ``FeedbackState``: the same for torch.distributed.checkpoint (a ``Stateful``), resumable on
  another number of ranks (`lowbitcc.checkpoint`); and
  ``rebuild_ddp_buckets()``: a resumed DDP's bucket layout made the saved one's (`lowbitcc.resume`);
- ``hybrid_mesh()``: a DeviceMesh whose data-parallel dimension goes over "loco" and whose
  other dimensions stay exact (per-dimension `LocoConfig`s; `lowbitcc.mesh`);
- ``OuterSync``: DiLoCo-style outer synchronisation of sites, its pseudo-gradients over "loco"
  with LoCo feedback (`lowbitcc.outer_sync`, docs/wan.md);
- ``monitored_barrier()``: gloo's debugging barrier on a "loco" group (torch's
  ``dist.monitored_barrier`` accepts only groups named "gloo").
"""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

from lowbitcc import state
from lowbitcc.backend import BACKEND_NAME
from lowbitcc.backend.registration import register
from lowbitcc.checkpoint import FeedbackState
from lowbitcc.config import LocoConfig
from lowbitcc.mesh import hybrid_mesh
from lowbitcc.metrics import StepMetrics
from lowbitcc.outer_sync import OuterSync
from lowbitcc.policy import compressed, compressible, exact, feedback_key
from lowbitcc.resume import rebuild_ddp_buckets

__version__ = "0.1.0"

register()


def stats() -> dict[str, Any]:
    """Counters of compressed and exact calls issued by this process (see `lowbitcc.counters`)."""
    return state.STATS.snapshot()


def reset_stats() -> None:
    state.STATS.reset()


def end_step() -> None:
    """Mark the end of a training step in a loop that takes no ``torch.optim`` step (whose
    steps lowbitcc counts itself). Calls issued outside a backward pass count their places
    within a step: the error-feedback keys' ordinals (docs/architecture.md) and, on CUDA, the call
    schedule that spares steady-state calls their descriptor exchange (docs/gpu.md). Without
    steps, every such call is a new place: it gets a new error state and exchanges a
    descriptor."""
    state.end_step()


def state_dict() -> dict[str, Any]:
    """The error-feedback state of this process (every "loco" group), tensors cloned, with
    this process's rank in the default group (None before ``init_process_group``). A call holds
    its states until its Work completes: take this after waiting for the calls issued before
    (as a training step does: DDP's backward and FSDP's step wait for theirs)."""
    return state.FEEDBACK.state_dict(state.default_rank())


def load_state_dict(saved: dict[str, Any]) -> None:
    """Replace this process's error-feedback state with ``saved`` (from `state_dict` on the
    same rank). Raises ``ValueError`` naming the problem, and keeps the current state, if
    ``saved`` is not such a dict, was saved by another rank, or holds an unusable entry
    (shapes, dtypes, group sizes or scales that do not fit, non-finite values)."""
    state.FEEDBACK.load_state_dict(saved, state.default_rank())


def monitored_barrier(group: Any = None, timeout: datetime.timedelta | float | None = None,
                      wait_all_ranks: bool = False) -> None:
    """``torch.distributed.monitored_barrier`` for "loco" groups (torch refuses any backend not
    named "gloo"): a barrier over ``group`` (default: the default group) in which rank 0 raises
    a ``RuntimeError`` naming the rank (``wait_all_ranks``: all ranks) that did not arrive
    within ``timeout``. A rank outside ``group`` returns at once, as in torch."""
    from lowbitcc.backend.process_group import LocoProcessGroup

    if group is None:
        group = dist.distributed_c10d._get_default_group()
    elif group is dist.GroupMember.NON_GROUP_MEMBER:
        return
    if not isinstance(group, LocoProcessGroup):
        raise ValueError(f"lowbitcc.monitored_barrier needs a 'loco' group, got "
                         f"{dist.get_backend(group)!r} (use torch.distributed.monitored_barrier)")
    group.monitored_barrier(timeout, wait_all_ranks)


__all__ = [
    "BACKEND_NAME",
    "FeedbackState",
    "LocoConfig",
    "OuterSync",
    "StepMetrics",
    "compressed",
    "compressible",
    "end_step",
    "exact",
    "feedback_key",
    "hybrid_mesh",
    "load_state_dict",
    "monitored_barrier",
    "rebuild_ddp_buckets",
    "reset_stats",
    "state_dict",
    "stats",
]
