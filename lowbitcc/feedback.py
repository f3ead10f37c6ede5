"""LoCo error-feedback state, one entry per logical tensor key.

Keys are strings built by the process group from the logical position of a call (see
docs/architecture.md): ``"<group>|<collective>|<dtype>|<numel>|<ordinal>|<stage>"``, or an explicit
name from `lowbitcc.feedback_key`. The store is per process and shared by all "loco" groups.

Each entry holds an `ErrorState` (the error of one shard source, int8 with per-group scales,
bf16 or fp32) and the number of times it was used. Rules:

- every ``reset_interval`` uses the state is dropped (the call runs as if it were new);
- a shape or storage change under the same key drops the state;
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
             device: torch.device | str = "cpu") -> tuple[ErrorState | None, int]:
        """Remove and return ``(state, uses)`` of ``key`` on ``device`` (a state loaded or kept
        elsewhere is moved there); ``(None, 0)`` when it must start anew."""
        with self._lock:
            entry = self._states.pop(key, None)
        if entry is None:
            return None, 0
        state, uses = entry
        if state.numel != numel or state.dtype != dtype:
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

    def state_dict(self) -> dict[str, Any]:
        """A picklable copy of every entry (CPU tensors), for checkpoints. Device states are
        copied after the device's queued work (a synchronisation)."""
        with self._lock:
            entries = list(self._states.items())
        states = {}
        for key, (state, uses) in entries:
            copy = state.to("cpu", copy=True)
            states[key] = {"uses": uses, "dtype": copy.dtype, "group_size": copy.group_size,
                           "data": copy.data, "scales": copy.scales}
        return {"version": STATE_DICT_VERSION, "states": states}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Replace every entry with those of ``state_dict`` (from `state_dict`)."""
        if state_dict.get("version") != STATE_DICT_VERSION:
            raise ValueError(
                f"lowbitcc: error-state dict version {state_dict.get('version')!r} is not "
                f"{STATE_DICT_VERSION}"
            )
        states = collections.OrderedDict(
            (key, (ErrorState(v["dtype"], v["data"], v["scales"], int(v["group_size"])).clone(),
                   int(v["uses"])))
            for key, v in state_dict["states"].items()
        )
        with self._lock:
            self._states = states
