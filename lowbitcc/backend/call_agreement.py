"""The per-call agreement protocol of a "loco" group: call descriptors, frames, refusals.

Before a reduction (and, under ``check_all``, an exact data movement), every rank all-gathers
one `exchange_frame.FRAME_BYTES` frame on the group's inner gloo group,
`exchange_frame.FRAME_COPIES` times over: a `wire.CallDescriptor` naming the call (collective,
dtype, op, size, call number, bits, the parent call whose callback issued it, whether this rank
would compress it, its cost model's suggestion), then, for an exact reduction of at most
`exchange_frame.FRAME_PAYLOAD` bytes, the rank's input itself, then a check of the frame.
`CallAgreement.exchange` compares the intact frames and raises on every rank where the calls
differ (`CollectiveMismatchError`), where a rank refused its own arguments
(`InvalidPeerCallError`, flag `wire.DESC_INVALID`) or where a frame arrived corrupt in every
copy (`CorruptFrameError`); otherwise every rank follows rank 0's descriptor. Runs where the
group's inner gloo operations are issued: on the worker thread (docs/architecture.md
"Descriptor check", docs/reliability.md).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from lowbitcc.backend.deviated_output import CollectiveMismatchError
from lowbitcc.backend.issue_queue import Job
from lowbitcc.backend.works import InnerWork, callback_parent
from lowbitcc.codec import exchange_frame, wire
from lowbitcc.transports.gloo import GlooTransport

log = logging.getLogger(__name__)


class DeviatedPeerError(CollectiveMismatchError):
    """A rank's descriptor says it deviated from its call schedule since its last exchange
    (`wire.DESC_DEVIATED`): it ran an agreed exact call on a NaN-filled buffer in place of its
    own, so the other ranks' outputs of that call were NaN. Raised on every rank, in the
    exchange; every rank then starts its call schedule again."""


class InvalidPeerCallError(ValueError):
    """Another rank's arguments for this call were invalid: that rank raised its own error, this
    one raises this, no data moved, and the group stays in step."""


class CorruptFrameError(wire.WireFormatError):
    """Every copy of a descriptor frame arrived corrupt on this rank
    (`exchange_frame.pick_frames`). ``exact_known``: the intact frames settle the call's path
    anyway (this rank, or another whose frame arrived intact, would not compress the call, and
    the call does not travel in the frames), so this rank can still take the exact path with
    the ranks that received every frame intact, and raise once the call is done."""

    def __init__(self, message: str, exact_known: bool) -> None:
        super().__init__(message)
        self.exact_known = exact_known


class CallAgreement:
    """The descriptor exchanges of one group's calls over ``transport``, its inner gloo group
    (unmetered); `group_name` is set by c10d after creation. `next_seq` numbers the calls
    (thread-safe); the exchanges run on one thread at a time, in issue order."""

    def __init__(self, rank: int, transport: GlooTransport) -> None:
        self.rank = rank
        self.group_name = ""
        self._transport = transport
        self.next_seq: Callable[[], int] = itertools.count(1).__next__
        """The next call number (the same call has the same number on every rank); a C
        function, which holds the GIL throughout: no lock needed."""

    def checked(self, collective: str, dtype: torch.dtype, numel: int, job: Job, *,
                op: int = 0, root: int = 0) -> Job:
        """``job`` (an exact data movement, issued now) preceded on the worker by a descriptor
        exchange naming ``collective`` with ``numel`` elements of ``dtype`` (0 where ranks may
        differ), ``op`` and ``root``: raises `CollectiveMismatchError` on every rank if another
        rank issued another call."""
        desc = wire.CallDescriptor(collective=collective, dtype=dtype, op=op, numel=numel,
                                   seq=self.next_seq(), bits=0, group_size=root,
                                   compressed=False, parent=callback_parent())

        def run() -> Any:
            try:
                self.agree(desc)
            except CorruptFrameError as exc:
                return self.then_raise(exc, job)
            return job()

        return run

    def agree(self, desc: wire.CallDescriptor) -> wire.CallDescriptor:
        """`exchange` without an input: rank 0's descriptor, as agreed."""
        return self.exchange(desc)[0]

    def exchange(self, desc: wire.CallDescriptor, own: torch.Tensor | None = None
                  ) -> tuple[wire.CallDescriptor, torch.Tensor | None]:
        """All-gather one `exchange_frame.FRAME_BYTES` frame per rank
        (`exchange_frame.FRAME_COPIES` times over): ``desc``, then ``own`` (this rank's
        contribution to a reduction of at most `exchange_frame.FRAME_PAYLOAD` bytes, flat). A
        frame counts as intact if one of its copies passes its check (a warning names a
        corrected one). Raises `CollectiveMismatchError` on every rank if the calls differ, and
        `CorruptFrameError` on a rank that received a frame none of whose copies passes (the
        intact frames are compared first). Returns rank 0's descriptor (whose advisory fields
        every rank follows), marked compressed only if every rank's is, and with ``own`` every
        rank's frame after the descriptor (uint8, one row per rank: the first ``own``'s bytes
        of each are that rank's contribution; the descriptors agreeing, the dtypes and sizes
        do)."""
        payload = None if own is None else own.contiguous().view(-1).view(torch.uint8).numpy()
        frame = exchange_frame.exchange_row(desc.pack(), payload)
        gathered = self._transport.all_gather(torch.from_numpy(frame.reshape(-1)))
        rows, intact, corrected = exchange_frame.pick_frames(gathered.numpy())
        for r in np.flatnonzero(corrected):
            log.warning("lowbitcc: a copy of rank %d's call descriptor frame arrived corrupt on "
                        "rank %d of group '%s' (its check fails); another copy passed and "
                        "settles the call", int(r), self.rank, self.group_name)
        flags = rows[:, wire.DESC_FLAGS_OFFSET]
        if desc.invalid:
            return desc, None
        refusing = np.flatnonzero(intact & ((flags & wire.DESC_INVALID) != 0))
        if refusing.size:
            raise InvalidPeerCallError(
                f"lowbitcc: rank {int(refusing[0])} of group '{self.group_name}' called "
                f"{desc.collective} (call #{desc.seq}) with invalid arguments and raised its own "
                "error; this rank raises too, no data moved, and the group stays usable")
        deviated = np.flatnonzero(intact & ((flags & wire.DESC_DEVIATED) != 0))
        if deviated.size:
            raise DeviatedPeerError(
                f"lowbitcc: rank {int(deviated[0])} of group '{self.group_name}' issued a call "
                "that differed from the one the ranks had agreed on at its place in their "
                "sequence of calls, since the group's previous descriptor exchange: it raised "
                "there, and the other ranks' outputs of that call are NaN. Every rank raises "
                f"here (call #{desc.seq}); the ranks agree on their calls anew")
        self._check_match(rows, np.flatnonzero(intact))
        if not intact.all():
            # exact on every rank if any rank would not compress it (this one, or one whose
            # frame arrived intact), unless the call itself travels in the frames
            declined = (rows[intact, wire.DESC_FLAGS_OFFSET] & wire.DESC_COMPRESSED) == 0
            exact_known = not desc.framed and (not desc.compressed or bool(declined.any()))
            raise CorruptFrameError(
                f"lowbitcc: the call descriptor frame of rank {int(np.flatnonzero(~intact)[0])} "
                f"arrived corrupt on rank {self.rank} of group '{self.group_name}' (its check "
                "fails); " + ("this rank took the exact path, as the intact frames say every "
                              "rank does, and raises now that the call is done" if exact_known
                              else "this rank cannot know what that rank called and raises; "
                              "ranks that received it intact go on with the call"),
                exact_known)
        leader = dataclasses.replace(
            wire.CallDescriptor.unpack(rows[0, :wire.DESCRIPTOR_BYTES].tobytes()),
            compressed=bool((flags & wire.DESC_COMPRESSED).all()))
        return leader, None if own is None else torch.from_numpy(rows[:, wire.DESCRIPTOR_BYTES:])

    def _check_match(self, rows: np.ndarray, ranks: np.ndarray) -> None:
        """Raise `CollectiveMismatchError` unless the frames ``rows[ranks]`` describe one call."""
        head, flags = rows[ranks, :wire.DESC_FLAGS_OFFSET], rows[ranks, wire.DESC_FLAGS_OFFSET]
        parent = rows[ranks, wire.DESC_PARENT_OFFSET:wire.DESCRIPTOR_BYTES]
        compared = flags & (wire.DESC_FRAMED | wire.DESC_PART)
        if ((head == head[:1]).all() and (parent == parent[:1]).all()
                and (compared == compared[:1]).all()):
            return
        descs = {int(r): wire.CallDescriptor.unpack(rows[r, :wire.DESCRIPTOR_BYTES].tobytes())
                 for r in ranks}
        first = next(iter(descs.values()))
        if any(d.call() != first.call() for d in descs.values()):
            lines = "; ".join(f"rank {r}: {d.describe()}" for r, d in descs.items())
            raise CollectiveMismatchError(
                f"lowbitcc: ranks of group '{self.group_name}' issued different collectives: "
                f"{lines}")

    @staticmethod
    def then_raise(error: CorruptFrameError, start: Job) -> Any:
        """Run ``start`` (the call's exact path, which the ranks that received every frame
        intact take too) and raise ``error`` once the call is done: when its inner work
        finishes, or now if it left none in flight."""
        if not error.exact_known:
            raise error
        result = start()
        if not isinstance(result, InnerWork):
            raise error
        finish = result.finish

        def finish_then_raise() -> list[torch.Tensor]:
            finish()
            raise error

        return InnerWork(result.work, finish_then_raise)
