"""lowbitcc: LoCo-compressed collectives for PyTorch behind ``init_process_group("loco")``.

Public API (everything else is internal):

- ``LocoConfig``: the configuration (also read from ``LOCO_*`` environment variables);
- ``exact()``, ``compressed()``, ``feedback_key(name)``: per-call control (context managers);
- ``stats()`` / ``reset_stats()``: bytes, calls and time of this process's "loco" groups;
- ``state_dict()`` / ``load_state_dict()``: the error-feedback state, for checkpoints.
"""

from __future__ import annotations

from typing import Any

from lowbitcc.config import LocoConfig
from lowbitcc.policy import compressed, exact, feedback_key
from lowbitcc.registration import BACKEND_NAME, register_backend

__version__ = "0.1.0"

register_backend()


def stats() -> dict[str, Any]:
    """Counters of compressed and exact calls issued by this process (see `lowbitcc.counters`)."""
    from lowbitcc.counters import STATS

    return STATS.snapshot()


def reset_stats() -> None:
    from lowbitcc.counters import STATS

    STATS.reset()


def state_dict() -> dict[str, Any]:
    """The error-feedback state of this process (every "loco" group), tensors cloned."""
    from lowbitcc.process_group import FEEDBACK

    return FEEDBACK.state_dict()


def load_state_dict(state: dict[str, Any]) -> None:
    """Replace this process's error-feedback state with ``state`` (from `state_dict`)."""
    from lowbitcc.process_group import FEEDBACK

    FEEDBACK.load_state_dict(state)


__all__ = [
    "BACKEND_NAME",
    "LocoConfig",
    "compressed",
    "exact",
    "feedback_key",
    "load_state_dict",
    "reset_stats",
    "state_dict",
    "stats",
]
