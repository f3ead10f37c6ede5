"""`CallSchedule`: the calls of an inline route as the ranks agreed on them, checked locally after.

Used where ``LocoConfig.call_schedule`` is on (off by default: see its docstring).

Training issues the same calls in the same order step after step. On an inline route (CUDA
tensors, or CPU ones under ``LOCO_ISSUER=inline``) the descriptor exchange of a compressed
call is a blocking host round trip: the calling thread waits while the group's worker
all-gathers the descriptors. The schedule removes it from the steady state:

- every reduction that would exchange a descriptor (`CompressedCalls.agrees_on`; leased ones
  too) takes the next *position* of its epoch (`policy.epoch`: a backward pass, or the calls
  between two optimizer steps), the same position on every rank while ranks issue the same
  calls;
- the first time a position's call runs, and again every `REAGREE_EVERY` runs, the ranks
  exchange descriptors as before (with rank 0's cost-model suggestion); where that agreement
  compresses the call on the direct schedule, the position keeps it (an `Entry`) for the next
  ``REAGREE_EVERY - 1`` runs, a count every rank holds alike, so the next agreement falls on
  the same call everywhere;
- a call whose position holds an entry with runs left, and which is the entry's call
  (`Entry.matches`: collective, dtype, op, size, code format, compressed), runs its
  compressed schedule at once: no exchange, no wait for another rank before the data moves.

A rank whose call is not its position's entry *deviates*, and knows it locally. It does not
wait on a mismatched exchange: it runs the entry's call in place of its own (`Deviation`), on
zeros, with every message flagged `wire.FLAG_DEVIATED` and naming its own call, so every
transfer the others expect happens at the size they expect. The direct schedule's first phase
hands every rank a message of every rank, so every rank reads the same verdict from it: if
every rank deviated to the same call (DDP rebuilding its buckets after the first step), the
ranks forget the schedule and agree on the new call synchronously, then run it; otherwise every
rank raises `CollectiveMismatchError` (the ranks that did not deviate from their decode, the
others from the verdict) and forgets the schedule, so the next calls agree again. On CUDA the
ranks that did not deviate see the flagged messages as foreign: their values turn to NaN and
the call is flagged non-finite, without a host synchronisation (docs/gpu.md).

Only the direct schedule keeps entries: the ring and the tree do not show every rank every
rank's message, so the verdict could differ between ranks. Thread-safety: one issuing thread
per device type, as for every inline call.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lowbitcc import policy, schedules, state
from lowbitcc.codec import wire
from lowbitcc.codec.shard_codec import ShardCodec
from lowbitcc.compressor import CallCompressor, Source

REAGREE_EVERY = 64
"""Runs of a position between two descriptor exchanges (the first of them exchanges)."""
CAPACITY = 4096
"""Positions kept per epoch kind; calls past it always exchange descriptors."""


def call_of(desc: wire.CallDescriptor) -> tuple:
    """What must be the same on every rank for a call to run as its position's entry."""
    return (desc.collective, desc.dtype, desc.op, desc.numel, desc.bits, desc.group_size,
            desc.fmt, desc.compressed, desc.parent)


@dataclasses.dataclass
class Entry:
    """The call the ranks agreed on at one position (``desc``: this rank's descriptor then),
    and how many more runs it may make without an exchange (``left``)."""

    desc: wire.CallDescriptor
    left: int

    def matches(self, desc: wire.CallDescriptor) -> bool:
        return call_of(desc) == call_of(self.desc)


Position = tuple[str, int]
"""(epoch kind, index of the call in its epoch)."""


class CallSchedule:
    """The agreed calls of one group's inline route (see the module docstring)."""

    def __init__(self) -> None:
        self._entries: dict[Position, Entry] = {}
        self._epoch: tuple[str, int] | None = None
        self._next = 0

    def advance(self) -> Position:
        """The position of the call issued now (counts it)."""
        epoch = policy.epoch()
        if epoch != self._epoch:
            self._epoch, self._next = epoch, 0
        self._next += 1
        return epoch[0], self._next - 1

    def entry(self, position: Position) -> Entry | None:
        """The entry a call at ``position`` runs as, if it has runs left (None: exchange)."""
        entry = self._entries.get(position)
        return entry if entry is not None and entry.left > 0 else None

    def ran(self, entry: Entry) -> None:
        """A call ran as ``entry`` without an exchange."""
        entry.left -= 1

    def agreed(self, position: Position, desc: wire.CallDescriptor) -> None:
        """The ranks agreed at ``position`` to compress ``desc``'s call on the direct schedule."""
        if position[1] < CAPACITY:
            self._entries[position] = Entry(desc, REAGREE_EVERY - 1)

    def forget(self) -> None:
        """Drop every entry (after a deviation or a mismatch): the next calls exchange."""
        self._entries.clear()


class Deviation:
    """A rank's call that is not its position's entry, run as the entry's call on zeros with
    flagged messages (see the module docstring). ``call`` is the deviating `CompressedCall`
    (its group, route, call number and own signature); `run` returns whether every rank
    deviated to this rank's call."""

    def __init__(self, call: Any, entry: Entry) -> None:
        self.call, self.entry = call, entry

    def run(self) -> bool:
        call, expected = self.call, self.entry.desc
        group = call.group
        cfg, n = group.config, group.size
        device = call.source.device
        m = -(-expected.numel // n)
        codec = ShardCodec(
            bits=expected.bits, group_size=expected.group_size,
            dtype_code=wire.DTYPE_CODES[expected.dtype], seq=call.seq, world=n,
            signature=wire.call_signature(expected.collective, expected.numel, expected.dtype),
            kernels=call.route.kernels, checksum=cfg.checksum_for(device.type),
            fmt=expected.fmt or "int", host_check=True)
        comp = CallCompressor(codec, state.FEEDBACK, "", state.STATS, error_dtype=None, beta=0.0,
                              reset_interval=0, rank=group.rank)
        own = wire.call_signature(call.collective, call.numel, call.source.dtype)
        comp.deviated = own
        source = Source(torch.zeros(n * m, dtype=expected.dtype, device=device), n, m)
        if expected.collective == "all_reduce":
            schedules.all_reduce("direct", source, torch.empty_like(source.tensor), comp,
                                 call.route.links, 0)
        else:
            schedules.reduce_scatter("direct", source, comp, call.route.links, 0)
        seen = comp.wire_error
        return (isinstance(seen, wire.DeviatedCallError)
                and all(s == own for s in seen.signatures))
