"""lowbitcc: LoCo-compressed collectives for PyTorch behind ``init_process_group("loco")``.

Public API (everything else is internal):

- ``LocoConfig``: the configuration (also read from ``LOCO_*`` environment variables);
- ``exact()``, ``compressed()``, ``feedback_key(name)``: per-call control (context managers);
- ``stats()`` / ``reset_stats()``: bytes, calls and time of this process's "loco" groups;
- ``state_dict()`` / ``load_state_dict()``: the error-feedback state, for checkpoints.
"""

from __future__ import annotations

from typing import Any

from lowbitcc import state
from lowbitcc.backend import BACKEND_NAME
from lowbitcc.backend.registration import register
from lowbitcc.config import LocoConfig
from lowbitcc.policy import compressed, exact, feedback_key

__version__ = "0.1.0"

register()


def stats() -> dict[str, Any]:
    """Counters of compressed and exact calls issued by this process (see `lowbitcc.counters`)."""
    return state.STATS.snapshot()


def reset_stats() -> None:
    state.STATS.reset()


def state_dict() -> dict[str, Any]:
    """The error-feedback state of this process (every "loco" group), tensors cloned."""
    return state.FEEDBACK.state_dict()


def load_state_dict(saved: dict[str, Any]) -> None:
    """Replace this process's error-feedback state with ``saved`` (from `state_dict`)."""
    state.FEEDBACK.load_state_dict(saved)


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
