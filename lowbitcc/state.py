"""Process-wide state of lowbitcc, kept in one place.

- `STATS`: the counters behind `lowbitcc.stats()`; every "loco" group of the process adds to them.
- `FEEDBACK`: the error-feedback store shared by every "loco" group of the process (behind
  `lowbitcc.state_dict()`). It keeps at most the largest ``max_keys`` of the groups created so
  far (`bound_feedback`): a group must never lose states because a later group asked for fewer.
- The optimizer-step counter: outside backward, feedback keys count calls within one optimizer
  step (`lowbitcc.policy.epoch`). A torch ``Optimizer`` step post-hook keeps it; `install_step_hook`
  installs that hook once, when the first "loco" group is created, so that ``import lowbitcc``
  changes nothing in torch beyond the backend name.

Everything here is thread-safe: groups are created from the main thread, calls come from any.
"""

from __future__ import annotations

import threading

import torch.distributed as dist

from lowbitcc.counters import Stats
from lowbitcc.feedback import FeedbackStore

STATS = Stats()
FEEDBACK = FeedbackStore()

_lock = threading.Lock()
_optimizer_steps = 0
_step_hook = None
_key_bounds: list[int] = []


def default_rank() -> int | None:
    """This process's rank in the default group; None before ``init_process_group`` (what the
    error-feedback state dicts record and check)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def optimizer_steps() -> int:
    """Optimizer steps taken in this process since the first "loco" group was created."""
    return _optimizer_steps


def _count_optimizer_step(*_args: object) -> None:
    global _optimizer_steps
    with _lock:
        _optimizer_steps += 1


def end_step() -> None:
    """A training step ended without a torch optimizer step (`lowbitcc.end_step`)."""
    _count_optimizer_step()


def install_step_hook() -> None:
    """Install the optimizer step post-hook (idempotent; called by each new "loco" group)."""
    global _step_hook
    with _lock:
        if _step_hook is not None:
            return
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _step_hook = register_optimizer_step_post_hook(_count_optimizer_step)


def bound_feedback(max_keys: int) -> None:
    """A new group asks the store to keep up to ``max_keys`` states: the bound becomes the
    largest any group of this process asked for."""
    with _lock:
        _key_bounds.append(max_keys)
        FEEDBACK.max_keys = max(_key_bounds)
