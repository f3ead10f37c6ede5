"""LoCo error-feedback state, one entry per logical tensor key.

Keys are strings built by the process group from the logical position of a call (see
docs/architecture.md): ``"<group>|<collective>|<dtype>|<numel>|<ordinal>|<stage>"``, or an explicit
name from `lowbitcc.feedback_key`. The store is per process and shared by all "loco" groups.

Each entry holds an `ErrorState` (the error of one shard source, int8 with per-group scales,
bf16 or fp32) and the number of times it was used. Rules:

- every ``reset_interval`` uses the state is dropped (the call runs as if it were new);
- a shape, storage or group-size change under the same key drops the state;
- a call that saw NaN/Inf drops the state instead of storing a poisoned one (a call on a
  device, which cannot tell on the host, stores it with the call's verdict as its poison word,
  which voids it: `ErrorState.poison`; a CPU call that a plan's C++ core runs, whose last
  decodes end after it stored its states, stores them with its verdict, which drops them where
  the call then saw one: `ErrorState.run_verdict`, `_void`; such a state counts nowhere, not in
  `len`, `keys`, `uses`, checkpoints nor ``max_keys``, as if it had not been stored);
- a changed *layout* drops the state (see below);
- at most ``max_keys`` entries are kept; the least recently used are dropped first.

`take` hands the state to the codec (which may update it in place) and `put` returns it.

Layout changes. A key names a call's position, not the data: when DDP rebuilds its buckets
after its first step, a bucket of the same size may hold other parameters, in another order,
and its saved error would be added to the wrong elements. The store cannot see parameters, but
it sees the buffer a call reduces (`buffer`, a weak reference to the tensor's storage, passed
by the group for keys it derived; explicit `lowbitcc.feedback_key` keys are trusted). Per key
it keeps ``streak``: how many uses in a row came with the same storage (> 0), or with a new one
(< 0). A new storage drops the state when the key's buffer was stable (``streak > 0``: a
persistent buffer, such as a DDP bucket, was replaced) or not yet known (``streak == 0``: the
second use, where DDP's rebuild lands); keys whose storage changes at every use (FSDP's
reduce-scatter inputs, gradients freed by ``zero_grad``) are then known as transient and keep
their states. A state loaded by `load_state_dict` keeps its streak and is applied at its first
use (the store has not seen that run's buffers yet), so a resumed run is bit-identical to the
uninterrupted one wherever its layout is the same: FSDP, explicit keys, a DDP that does not
rebuild its buckets. A resumed DDP that rebuilds them (the default) drops the states when it
does, and its first step may add them to its initial layout (docs/reliability.md).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from lowbitcc.codec.error_state import ErrorState

log = logging.getLogger(__name__)

STATE_DICT_VERSION = 2
"""1: entries without ``streak`` (loaded with streak 0)."""


@dataclasses.dataclass
class _Layout:
    """What the store knows of the buffers a key's calls reduced (see the module docstring)."""

    buffer: StorageWeakRef | None
    streak: int = 0


class FeedbackStore:
    """Error states by key, bounded by ``max_keys`` (least recently used dropped first)."""

    def __init__(self, max_keys: int = 4096) -> None:
        self.max_keys = max_keys
        self._states: collections.OrderedDict[str, tuple[ErrorState, int]] = (
            collections.OrderedDict()
        )
        self._layouts: collections.OrderedDict[str, _Layout] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.layout_resets = 0
        """States dropped because their key's buffer was replaced (see the module docstring)."""

    def __len__(self) -> int:
        return len(self.keys())

    def keys(self) -> list[str]:
        with self._lock:
            return [key for key, (state, _) in self._states.items() if not _void(state)]

    def take(self, key: str, numel: int, dtype: str, reset_interval: int,
             device: torch.device | str = "cpu", group_size: int | None = None,
             buffer: StorageWeakRef | None = None) -> tuple[ErrorState | None, int]:
        """Remove and return ``(state, uses)`` of ``key`` on ``device`` (a state loaded or kept
        elsewhere is moved there); ``(None, 0)`` when it must start anew, also when it was made
        for another ``numel``, storage or ``group_size`` (None: any), or when ``buffer`` (the
        storage this call reduces; None: not tracked) says the layout changed."""
        with self._lock:
            entry = self._states.pop(key, None)
            if entry is not None and _void(entry[0]):
                entry = None  # (as if its call had not stored it)
            replaced = buffer is not None and self._replaced(key, buffer)
            if entry is not None and replaced:
                self.layout_resets += 1
        if entry is None:
            return None, 0
        if replaced:
            log.debug("lowbitcc: error state %s dropped: its buffer was replaced", key)
            return None, 0
        state, uses = entry
        if (state.numel != numel or state.dtype != dtype
                or (group_size is not None and state.group_size != group_size)):
            return None, 0
        if reset_interval and uses >= reset_interval:
            return None, 0
        return state.to(device), uses

    def _replaced(self, key: str, buffer: StorageWeakRef) -> bool:
        """Record that ``key``'s call reduces ``buffer``; whether its state must go (the lock
        is held)."""
        layout = self._layouts.pop(key, None) or _Layout(None)
        replaced = False
        if layout.buffer is None:  # a new key, or loaded: the first buffer of this run
            layout.buffer = buffer
        elif layout.buffer == buffer:
            layout.streak = max(layout.streak, 0) + 1
        else:
            layout.buffer = buffer
            replaced = layout.streak >= 0  # else transient buffers: a new one every use
            layout.streak = -1 if replaced else layout.streak - 1
        self._layouts[key] = layout
        self._bound(self._layouts)
        return replaced

    def _bound(self, entries: collections.OrderedDict) -> None:
        """Drop the least recently used of ``entries`` (``_states`` or ``_layouts``) beyond
        ``max_keys``, states that count as dropped first (`_void`); the lock is held (a plan's
        C++ core calls it too, `feedback_slots.h`)."""
        if len(entries) > self.max_keys and entries is self._states:
            for key in [k for k, (state, _) in entries.items() if _void(state)]:
                del entries[key]
        while len(entries) > self.max_keys:
            entries.popitem(last=False)

    def put(self, key: str, state: ErrorState | None, uses: int, nonfinite: bool) -> None:
        """Store ``state`` after its ``uses``-th use; a non-finite call stores nothing."""
        with self._lock:
            self._states.pop(key, None)
            if nonfinite or state is None:
                return
            self._states[key] = (state, uses)
            self._bound(self._states)

    def uses(self, key: str) -> int:
        with self._lock:
            entry = self._states.get(key)
            return 0 if entry is None or _void(entry[0]) else entry[1]

    def clear(self) -> None:
        with self._lock:
            self._states.clear()
            self._layouts.clear()

    def state_dict(self, rank: int | None = None) -> dict[str, Any]:
        """A picklable copy of every entry (CPU tensors), for checkpoints, recording ``rank``
        (this process's rank, checked on load). Device states are copied after the device's
        queued work (a synchronisation)."""
        with self._lock:
            entries = list(self._states.items())
            streaks = {key: layout.streak for key, layout in self._layouts.items()}
        states = {}
        for key, (state, uses) in entries:
            if _void(state):  # dropped at its next use
                continue
            copy = state.to("cpu", copy=True)
            states[key] = {"uses": uses, "dtype": copy.dtype, "group_size": copy.group_size,
                           "data": copy.data, "scales": copy.scales,
                           "streak": streaks.get(key, 0)}
        return {"version": STATE_DICT_VERSION, "rank": rank, "states": states}

    def load_state_dict(self, state_dict: dict[str, Any], rank: int | None = None) -> None:
        """Replace every entry with those of ``state_dict`` (from `state_dict`), after checking
        all of it: nothing is replaced if any entry is unusable (ValueError naming it), or if
        the dict was saved by another rank than ``rank`` (each rank's error is its own)."""
        version = state_dict.get("version") if isinstance(state_dict, dict) else state_dict
        if not isinstance(state_dict, dict) or type(version) is not int or version not in (
                1, STATE_DICT_VERSION):
            raise ValueError(
                f"lowbitcc: error-state dict version {version!r} is not 1 or "
                f"{STATE_DICT_VERSION} (pass what lowbitcc.state_dict() returned)")
        saved_rank = state_dict.get("rank")
        if rank is not None and saved_rank is not None and saved_rank != rank:
            raise ValueError(f"lowbitcc: error-state dict saved by rank {saved_rank}, loaded on "
                             f"rank {rank}; each rank must load its own")
        states: collections.OrderedDict[str, tuple[ErrorState, int]] = collections.OrderedDict()
        layouts: collections.OrderedDict[str, _Layout] = collections.OrderedDict()
        for key, v in dict(state_dict.get("states", {})).items():
            states[key] = _checked_entry(key, v)
            streak = v.get("streak", 0)
            if not isinstance(streak, int) or isinstance(streak, bool):
                raise ValueError(f"lowbitcc: error state {key!r} in the state dict: streak "
                                 f"{streak!r} is not an int")
            layouts[key] = _Layout(None, streak)
        with self._lock:
            self._states = states
            self._layouts = layouts


def _void(state: ErrorState) -> bool:
    """Whether ``state`` counts as dropped by its ``run_verdict``: a plan's C++ core stores a CPU
    call's states before the call's last decodes, with the call's verdict, which says (once the
    call is done: this waits for it) whether it then met a non-finite value or a foreign message
    or a failed transfer (`lowbitcc.backend.plan_cores`); such a state counts as dropped, as the
    Python path's own `put` drops it. A verdict that keeps the state is let go of."""
    verdict = state.run_verdict
    if verdict is None:
        return False
    if verdict.dropped():
        return True
    state.run_verdict = None
    return False


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
