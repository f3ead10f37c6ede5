"""The descriptor exchange's frames: what each rank contributes to an exchange of call
descriptors (`lowbitcc.backend.call_agreement`), and how a receiver checks it.

A rank's *frame* is its call descriptor (`wire.CallDescriptor`, `wire.DESCRIPTOR_BYTES`), then,
for an exact reduction small enough, the call's input (`FRAME_PAYLOAD`), then zeros, then the
frame's check (`frame_checks`); each rank's row of an exchange holds its frame `FRAME_COPIES`
times over (docs/wire-format.md).
"""

from __future__ import annotations

import numpy as np

from lowbitcc.codec.wire import CHECKSUM_STEP, DESCRIPTOR_BYTES

FRAME_PAYLOAD = 96
"""Input bytes a frame carries: an exact reduction of at most this many bytes is done from the
gathered frames, in one exchange."""
FRAME_CHECK_BYTES = 8
FRAME_BYTES = DESCRIPTOR_BYTES + FRAME_PAYLOAD + FRAME_CHECK_BYTES
"""A rank's descriptor frame: the descriptor, then (an exact reduction small enough, see
`FRAME_PAYLOAD`) the call's input, then zeros, then the frame's check (`frame_checks`). Every
descriptor exchange all-gathers `FRAME_COPIES` of it per rank. One size for every call, so
that ranks that issued different calls still exchange frames alike."""
_FRAME_KEYS = np.array([((j + 1) * CHECKSUM_STEP | 1) % 2**64
                        for j in range((FRAME_BYTES - FRAME_CHECK_BYTES) // 4)], dtype=np.uint64)


def frame_checks(frames: np.ndarray) -> np.ndarray:
    """uint64 ``[rows]``: the check of each descriptor frame (``uint8 [rows, FRAME_BYTES]``),
    ``sum_j u_j * K_j mod 2**64`` over the little-endian 32-bit words ``u_j`` of its bytes
    before the check, with odd keys ``K_j = (j + 1) * CHECKSUM_STEP | 1``: a change within one
    word always changes it (an odd key is invertible modulo 2**64). The sender writes it into
    the frame's last `FRAME_CHECK_BYTES`."""
    words = np.ascontiguousarray(frames[:, :FRAME_BYTES - FRAME_CHECK_BYTES]).view("<u4")
    return (words.astype(np.uint64) * _FRAME_KEYS).sum(axis=1, dtype=np.uint64)

FRAME_COPIES = 2
"""Each rank's row of a descriptor exchange holds its frame this many times over
(`EXCHANGE_BYTES`); a receiver takes the first copy that passes its check (`pick_frames`), so a
row corrupted in one place still settles the call on every rank."""
EXCHANGE_BYTES = FRAME_COPIES * FRAME_BYTES
"""Bytes each rank contributes to a descriptor exchange."""


def exchange_row(descriptor: bytes, payload: np.ndarray | None = None) -> np.ndarray:
    """A rank's row of a descriptor exchange, uint8 ``[FRAME_COPIES, FRAME_BYTES]``: its frame
    (the packed ``descriptor``, then ``payload``'s bytes, at most `FRAME_PAYLOAD`, then zeros,
    then the frame's check) `FRAME_COPIES` times over."""
    frame = np.zeros((FRAME_COPIES, FRAME_BYTES), dtype=np.uint8)
    frame[0, :DESCRIPTOR_BYTES] = np.frombuffer(descriptor, dtype=np.uint8)
    if payload is not None:
        frame[0, DESCRIPTOR_BYTES:DESCRIPTOR_BYTES + payload.size] = payload
    frame[0, -FRAME_CHECK_BYTES:] = frame_checks(frame[:1]).view(np.uint8)
    frame[1:] = frame[0]
    return frame


def pick_frames(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """From the gathered rows ``uint8 [ranks, EXCHANGE_BYTES]`` of a descriptor exchange, return
    ``(frames, intact, corrected)``: ``frames`` ``uint8 [ranks, FRAME_BYTES]``, each rank's first
    copy that passes its check (its first copy where none does; a view of ``rows`` when every
    first copy passes); ``intact`` bool ``[ranks]``, whether one did; ``corrected``, whether
    only a later copy did."""
    frames = rows[:, :FRAME_BYTES]
    intact = frame_checks(frames) == _carried_checks(frames)
    corrected = np.zeros(len(intact), dtype=bool)
    if intact.all():
        return frames, intact, corrected
    frames = frames.copy()
    for copy in range(1, FRAME_COPIES):
        bad = np.flatnonzero(~intact)
        later = np.ascontiguousarray(rows[bad, copy * FRAME_BYTES:(copy + 1) * FRAME_BYTES])
        good = frame_checks(later) == _carried_checks(later)
        frames[bad[good]] = later[good]
        intact[bad[good]] = corrected[bad[good]] = True
        if intact.all():
            break
    return frames, intact, corrected


def _carried_checks(frames: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(frames[:, -FRAME_CHECK_BYTES:]).view("<u8")[:, 0]
