"""LoCo error-feedback state, one entry per logical tensor key.

Keys are strings built by the process group from the logical position of a call (see
docs/architecture.md): ``"<group>|<collective>|<dtype>|<numel>|<ordinal>|<stage>"``, or an explicit
name from `lowbitcc.feedback_key`. The store is per process and shared by all "loco" groups.

Each entry holds the error ``e`` of one shard matrix (fp32 ``[n, mp]`` when decoded) stored as
int8 codes with one fp32 scale per group (the codec's 8-bit quantizer), or as bf16 / fp32, plus
the number of times it was used. Rules:

- every ``reset_interval`` uses the state is dropped (the call runs as if it were new);
- a shape change under the same key drops the state;
- a call whose input holds NaN/Inf drops the state instead of storing a poisoned one;
- at most ``max_keys`` entries are kept; the least recently used are dropped first.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any

import torch

from lowbitcc.kernels import reference

STATE_DICT_VERSION = 1


@dataclasses.dataclass
class ErrorState:
    """The stored error of one key. ``data`` is int8 codes, bf16 or fp32, shaped ``[n, mp]``."""

    uses: int
    data: torch.Tensor
    scales: torch.Tensor | None

    def decode(self) -> torch.Tensor:
        if self.scales is None:
            return self.data.to(torch.float32)
        rows = self.scales.numel()
        return reference.dequantize(self.data.view(rows, -1), self.scales).view(self.data.shape)

    @classmethod
    def encode(cls, e: torch.Tensor, uses: int, dtype: str, group_size: int) -> ErrorState:
        if dtype == "int8":
            codes, scales = reference.quantize(e.reshape(-1, group_size), 8)
            return cls(uses, codes.view(e.shape), scales)
        if dtype == "bf16":
            return cls(uses, e.to(torch.bfloat16), None)
        return cls(uses, e.clone(), None)


class FeedbackStore:
    """Error states by key, bounded by ``max_keys`` (least recently used dropped first)."""

    def __init__(self, max_keys: int = 4096) -> None:
        self.max_keys = max_keys
        self._states: collections.OrderedDict[str, ErrorState] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._states)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._states)

    def load(self, key: str, shape: tuple[int, int], reset_interval: int) -> torch.Tensor | None:
        """The fp32 error for ``key`` (None: start from zero) and count this use."""
        with self._lock:
            state = self._states.get(key)
            if state is None or tuple(state.data.shape) != tuple(shape):
                self._states.pop(key, None)
                return None
            self._states.move_to_end(key)
            if reset_interval and state.uses >= reset_interval:
                del self._states[key]
                return None
            return state.decode()

    def store(
        self, key: str, error: torch.Tensor, nonfinite: bool, dtype: str, group_size: int
    ) -> None:
        """Save the new error of ``key``; a non-finite call drops the key instead."""
        with self._lock:
            previous = self._states.pop(key, None)
            if nonfinite:
                return
            uses = 1 if previous is None else previous.uses + 1
            self._states[key] = ErrorState.encode(error, uses, dtype, group_size)
            while len(self._states) > self.max_keys:
                self._states.popitem(last=False)

    def drop(self, key: str) -> None:
        with self._lock:
            self._states.pop(key, None)

    def uses(self, key: str) -> int:
        with self._lock:
            state = self._states.get(key)
            return 0 if state is None else state.uses

    def clear(self) -> None:
        with self._lock:
            self._states.clear()

    def state_dict(self) -> dict[str, Any]:
        """A picklable copy of every entry (tensors cloned), for checkpoints."""
        with self._lock:
            return {
                "version": STATE_DICT_VERSION,
                "states": {
                    key: {
                        "uses": s.uses,
                        "data": s.data.clone(),
                        "scales": None if s.scales is None else s.scales.clone(),
                    }
                    for key, s in self._states.items()
                },
            }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Replace every entry with those of ``state_dict`` (from `state_dict`)."""
        if state_dict.get("version") != STATE_DICT_VERSION:
            raise ValueError(
                f"lowbitcc: error-state dict version {state_dict.get('version')!r} is not "
                f"{STATE_DICT_VERSION}"
            )
        states = collections.OrderedDict(
            (key, ErrorState(int(v["uses"]), v["data"].clone(),
                             None if v["scales"] is None else v["scales"].clone()))
            for key, v in state_dict["states"].items()
        )
        with self._lock:
            self._states = states
