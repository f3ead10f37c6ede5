"""LoCo error-feedback state, one entry per logical tensor key.

Keys are strings built by the process group from the logical position of a call (see
docs/architecture.md): ``"<group>|<collective>|<dtype>|<numel>|<ordinal>|<stage>"``, or an explicit
name from `lowbitcc.feedback_key`. The store is per process and shared by all "loco" groups.

Each entry holds an `ErrorState` (the error of one shard source, int8 with per-group scales,
bf16 or fp32) and the number of times it was used. Rules:

- every ``reset_interval`` uses the state is dropped (the call runs as if it were new);
- a shape, storage or group-size change under the same key drops the state;
- a call that saw NaN/Inf drops the state instead of storing a poisoned one;
- at most ``max_keys`` entries are kept; the least recently used are dropped first.

`take` hands the state to the codec (which may update it in place) and `put` returns it.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import torch

from lowbitcc.codec.error_state import ErrorState

STATE_DICT_VERSION = 1


class FeedbackStore:
    """Error states by key, bounded by ``max_keys`` (least recently used dropped first)."""

    def __init__(self, max_keys: int = 4096) -> None:
        self.max_keys = max_keys
        self._states: collections.OrderedDict[str, tuple[ErrorState, int]] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._states)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._states)

    def take(self, key: str, numel: int, dtype: str, reset_interval: int,
             device: torch.device | str = "cpu", group_size: int | None = None,
             ) -> tuple[ErrorState | None, int]:
        """Remove and return ``(state, uses)`` of ``key`` on ``device`` (a state loaded or kept
        elsewhere is moved there); ``(None, 0)`` when it must start anew, also when it was made
        for another ``numel``, storage or ``group_size`` (None: any)."""
        with self._lock:
            entry = self._states.pop(key, None)
        if entry is None:
            return None, 0
        state, uses = entry
        if (state.numel != numel or state.dtype != dtype
                or (group_size is not None and state.group_size != group_size)):
            return None, 0
        if reset_interval and uses >= reset_interval:
            return None, 0
        return state.to(device), uses

    def put(self, key: str, state: ErrorState | None, uses: int, nonfinite: bool) -> None:
        """Store ``state`` after its ``uses``-th use; a non-finite call stores nothing."""
        with self._lock:
            self._states.pop(key, None)
            if nonfinite or state is None:
                return
            self._states[key] = (state, uses)
            while len(self._states) > self.max_keys:
                self._states.popitem(last=False)

    def uses(self, key: str) -> int:
        with self._lock:
            entry = self._states.get(key)
            return 0 if entry is None else entry[1]

    def clear(self) -> None:
        with self._lock:
            self._states.clear()

    def state_dict(self, rank: int | None = None) -> dict[str, Any]:
        """A picklable copy of every entry (CPU tensors), for checkpoints, recording ``rank``
        (this process's rank, checked on load). Device states are copied after the device's
        queued work (a synchronisation)."""
        with self._lock:
            entries = list(self._states.items())
        states = {}
        for key, (state, uses) in entries:
            copy = state.to("cpu", copy=True)
            states[key] = {"uses": uses, "dtype": copy.dtype, "group_size": copy.group_size,
                           "data": copy.data, "scales": copy.scales}
        return {"version": STATE_DICT_VERSION, "rank": rank, "states": states}

    def load_state_dict(self, state_dict: dict[str, Any], rank: int | None = None) -> None:
        """Replace every entry with those of ``state_dict`` (from `state_dict`), after checking
        all of it: nothing is replaced if any entry is unusable (ValueError naming it), or if
        the dict was saved by another rank than ``rank`` (each rank's error is its own)."""
        if not isinstance(state_dict, dict) or state_dict.get("version") != STATE_DICT_VERSION:
            version = state_dict.get("version") if isinstance(state_dict, dict) else state_dict
            raise ValueError(
                f"lowbitcc: error-state dict version {version!r} is not {STATE_DICT_VERSION} "
                "(pass what lowbitcc.state_dict() returned)")
        saved_rank = state_dict.get("rank")
        if rank is not None and saved_rank is not None and saved_rank != rank:
            raise ValueError(f"lowbitcc: error-state dict saved by rank {saved_rank}, loaded on "
                             f"rank {rank}; each rank must load its own")
        states: collections.OrderedDict[str, tuple[ErrorState, int]] = collections.OrderedDict()
        for key, v in dict(state_dict.get("states", {})).items():
            states[key] = _checked_entry(key, v)
        with self._lock:
            self._states = states


def _checked_entry(key: Any, v: Any) -> tuple[ErrorState, int]:
    """One saved entry as ``(state, uses)``; ValueError naming ``key`` if it is unusable."""
    def bad(why: str) -> ValueError:
        return ValueError(f"lowbitcc: error state {key!r} in the state dict: {why}")

    if not isinstance(key, str):
        raise bad("keys are strings")
    fields = ("dtype", "data", "scales", "group_size", "uses")
    if not isinstance(v, dict) or any(f not in v for f in fields):
        raise bad(f"an entry is a dict with {', '.join(fields)}")
    uses, group_size = v["uses"], v["group_size"]
    if not isinstance(uses, int) or uses < 0:
        raise bad(f"uses {uses!r} is not a non-negative int")
    state = ErrorState(v["dtype"], v["data"], v["scales"], group_size)
    problem = state.problem()
    if problem is not None:
        raise bad(problem)
    return state.clone(), uses
