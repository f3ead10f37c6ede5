"""The error-feedback state in checkpoints: with torch.distributed.checkpoint (DCP) as a
``Stateful``, and across a change of world size.

**DCP.** `FeedbackState` goes in the dict given to ``dcp.save`` / ``dcp.load`` beside the model
and optimizer::

    state = {"model": model_sd, "optim": optim_sd, "loco": lowbitcc.FeedbackState()}
    dcp.save(state, checkpoint_id=path)    # and dcp.load(state, checkpoint_id=path)

DCP takes values saved under the same name by several ranks for replicas and writes one of
them, which would keep one rank's error and drop the others'. So `FeedbackState.state_dict`
gathers every rank's state (`lowbitcc.state_dict`, a collective over the default group: every
rank must call it, as ``dcp.save`` does) into one object, the same on every rank, that DCP writes
once: ``{"world": N, "ranks": [state of rank 0, ..., rank N - 1]}``, serialised as bytes (DCP
would otherwise flatten it into names that depend on N, which a loading run of another size
could not ask for). Its size is N times one rank's state (int8 storage: about one byte per
compressed element per rank, plus a scale per group).

**Another world size.** Loaded by M ranks, rank ``j`` gets (`reshard`):

- M == N: its own state, as saved (a resumed run continues bit for bit, as with
  `lowbitcc.load_state_dict`);
- M != N: for each call whose key was derived from its position (``group|collective|dtype|
  numel|ordinal``) and whose states are the direct schedule's unchunked stages, the residual the
  group carried for the call is preserved: every old rank's input residual (stage ``"gather"``
  at 2 ranks, ``"rs"`` at more: ``n`` rows of ``ceil(numel / n)`` elements, each padded to whole
  groups) and the reduced rows' residual (``"ag"``, one row per rank) unpadded into vectors of
  ``numel`` elements and summed; each new rank's input stage gets ``sum / M`` in the new
  layout, so the new group's residuals sum to the old group's (the bias the feedback was
  correcting is still corrected, once, at the next use); the new ``"ag"`` states start at zero.
  Everything else starts anew, with a warning naming how many keys: keys named by
  `lowbitcc.feedback_key` (their tensor size is not in the key), reduce-scatter keys (FSDP's
  inputs are laid out by rank, and their size changes with the world size), chunked or other
  schedules' stages, and every key at M == 1 (no communication to feed back into).
"""

from __future__ import annotations

import io
import logging
from typing import Any

import torch
import torch.distributed as dist

from lowbitcc import state
from lowbitcc.codec.error_state import ErrorState
from lowbitcc.feedback import STATE_DICT_VERSION

log = logging.getLogger("lowbitcc.checkpoint")

INPUT_STAGES = ("gather", "rs")
REDUCED_STAGE = "ag"


class FeedbackState:
    """This process's error-feedback state as a DCP ``Stateful`` (module docstring).

    `state_dict` and `load_state_dict` are collectives of the default group when it exists:
    call them on every rank, as ``dcp.save`` and ``dcp.load`` do."""

    def state_dict(self) -> dict[str, Any]:
        rank = state.default_rank()
        mine = state.FEEDBACK.state_dict(rank)
        if rank is None:
            ranks = [mine]
        else:
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
        buffer = io.BytesIO()
        torch.save({"world": len(ranks), "ranks": ranks}, buffer)
        return {"feedback": buffer.getvalue()}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Load what `state_dict` saved, resharded to this world size (`reshard`). Raises
        ``ValueError`` naming the problem, and keeps the current state, if ``saved`` is not
        such a dict."""
        raw = saved.get("feedback") if isinstance(saved, dict) else None
        if not isinstance(raw, bytes | bytearray):
            raise ValueError("lowbitcc.FeedbackState: expected the dict its state_dict() made "
                             "(a 'feedback' entry of bytes)")
        payload = torch.load(io.BytesIO(raw), weights_only=False)
        rank = state.default_rank()
        world = 1 if rank is None else dist.get_world_size()
        state.FEEDBACK.load_state_dict(reshard(payload["ranks"], world, rank or 0), rank)


def reshard(saved: list[dict[str, Any]], world: int, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s state dict (`lowbitcc.load_state_dict`'s format) in a group of ``world``
    ranks, from the ``saved`` state dicts of every rank of the old group, in rank order (module
    docstring). Logs a warning where keys start anew."""
    if not saved or not all(isinstance(s, dict) and "states" in s for s in saved):
        raise ValueError("lowbitcc: reshard needs every old rank's lowbitcc.state_dict()")
    old = len(saved)
    if old == world:
        return {**saved[rank], "rank": rank}
    calls: dict[str, dict[str, list[tuple[int, dict[str, Any]]]]] = {}
    for r, sd in enumerate(saved):
        for key, entry in sd["states"].items():
            call, _, stage = key.rpartition("|")
            calls.setdefault(call, {}).setdefault(stage, []).append((r, entry))
    states: dict[str, Any] = {}
    dropped = 0
    for call, stages in calls.items():
        numel = _numel_of(call)
        if world == 1 or numel is None or not _direct_unchunked(stages, old):
            dropped += 1
            continue
        total = _summed_residual(stages, old, numel)
        stage = "gather" if world == 2 else "rs"
        entry = next(e for s in INPUT_STAGES for _, e in stages.get(s, []))
        states[f"{call}|{stage}"] = _entry_for(total / world, world, entry)
    if dropped:
        log.warning("lowbitcc: error-feedback state of %d of %d calls starts anew after "
                    "resuming %d ranks' state on %d (docs/reliability.md)", dropped,
                    len(calls), old, world)
    return {"version": STATE_DICT_VERSION, "rank": rank, "states": states}


def _numel_of(call: str) -> int | None:
    """The tensor size in a derived key (``group|collective|dtype|numel|ordinal``), or None for
    keys that do not carry it (explicit keys) or reduce-scatters (laid out by rank)."""
    parts = call.split("|")
    if len(parts) != 5 or parts[1] != "all_reduce" or not parts[3].isdigit():
        return None
    return int(parts[3])


def _direct_unchunked(stages: dict[str, list], old: int) -> bool:
    expected = {"gather"} if old == 2 else {"rs", REDUCED_STAGE}
    return set(stages) <= expected and any(s in stages for s in INPUT_STAGES)


def _rows(entry: dict[str, Any], rows: int, m: int) -> torch.Tensor:
    """The first ``m`` elements of each of ``rows`` rows of a saved entry, flat fp32."""
    error = ErrorState(entry["dtype"], entry["data"], entry["scales"], entry["group_size"])
    return error.decode().view(rows, -1)[:, :m].reshape(-1)


def _summed_residual(stages: dict[str, list], old: int, numel: int) -> torch.Tensor:
    """The old group's residual of one all-reduce, summed over ranks and stages, ``numel``
    fp32 elements."""
    m = -(-numel // old)
    total = torch.zeros(old * m)
    for s in INPUT_STAGES:
        for _, entry in stages.get(s, []):
            total += _rows(entry, old, m)
    for r, entry in stages.get(REDUCED_STAGE, []):
        total[r * m:(r + 1) * m] += _rows(entry, 1, m)
    return total[:numel]


def _entry_for(residual: torch.Tensor, world: int, like: dict[str, Any]) -> dict[str, Any]:
    """``residual`` (``numel`` fp32) as a saved entry of the input stage of ``world`` ranks, in
    ``like``'s storage and group size, used 0 times."""
    group = like["group_size"]
    m = -(-residual.numel() // world)
    padded = -(-m // group) * group
    rows = torch.zeros(world * m)
    rows[:residual.numel()] = residual
    laid = torch.zeros(world, padded)
    laid[:, :m] = rows.view(world, m)
    error = ErrorState.encode(laid.reshape(-1), like["dtype"], group)
    return {"uses": 0, "dtype": error.dtype, "group_size": group, "data": error.data,
            "scales": error.scales, "streak": 0}
