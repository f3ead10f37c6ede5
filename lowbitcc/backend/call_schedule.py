"""`CallSchedule`: the calls of an inline route as the ranks agreed on them, checked locally after.

Used where ``LocoConfig.call_schedule`` is on (off by default: see its docstring).

Training issues the same calls in the same order step after step. On an inline route (CUDA
tensors, or CPU ones under ``LOCO_ISSUER=inline``) the descriptor exchange of a compressed
call is a blocking host round trip: the calling thread waits while the group's worker
all-gathers the descriptors. The schedule removes it from the steady state:

- every reduction that would exchange a descriptor (`CompressedCalls.agrees_on`; leased ones
  too) takes the next *index*, the same on every rank while ranks issue the same calls;
- while the *period* is not known every call exchanges; it becomes known when the first call
  of an epoch (`policy.epoch`: a backward pass, or the calls between optimizer steps) is
  agreed equal to the first call of an earlier epoch. From then on a call's *place* is its
  index modulo the period, and epochs no longer matter (DDP's ``Join``: the joined rank's
  shadow calls run outside backward, yet take the places of the calls they shadow);
- where an agreement compresses a call on the direct schedule, its place keeps it (an
  `Entry`) for ``REAGREE_EVERY - 1`` more runs, a count every rank holds alike, so the next
  agreement (with rank 0's cost-model suggestion) falls on the same call everywhere;
- a call whose place holds an entry with runs left, and which is the entry's call
  (`Entry.matches`: collective, dtype, op, size, code format), runs compressed at once, also
  on a rank that alone would not have compressed it: no exchange, no wait before data moves.

A rank whose call is not its place's entry *deviates*, and knows it locally. It does not wait
on a mismatched exchange: it runs the entry's call in place of its own (`Deviation`), on
zeros, with every message flagged `wire.FLAG_DEVIATED` and naming its own call, so every
transfer the others expect happens at the size they expect. The direct schedule's first phase
hands every rank a message of every rank, so the deviating ranks (which read the headers on
the host) all reach the same verdict: if every rank deviated to the same call (DDP rebuilding
its buckets), every rank starts its schedule again (`restart`) and agrees on the call; else
every rank raises `CollectiveMismatchError` (the ranks that did not deviate from their decode:
on CUDA they see NaN and the call flagged non-finite instead, without a host synchronisation)
and every rank keeps its schedule, so that all keep counting alike.

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
from lowbitcc.compressor import CallCompressor, Source

REAGREE_EVERY = 64
"""Runs of a place between two descriptor exchanges (the first of them exchanges)."""
CAPACITY = 4096
"""Calls kept while the period is unknown; past it, learning starts again."""


def call_of(desc: wire.CallDescriptor) -> tuple:
    """What must be the same on every rank for a call to run as its place's entry (not whether
    this rank would compress it: the agreement at the place decided that for every rank)."""
    return (desc.collective, desc.dtype, desc.op, desc.numel, desc.bits, desc.group_size,
            desc.fmt, desc.parent)


@dataclasses.dataclass
class Entry:
    """The call the ranks agreed on at one place (``desc``: this rank's descriptor then), and
    how many more runs it may make without an exchange (``left``)."""

    desc: wire.CallDescriptor
    left: int

    def matches(self, desc: wire.CallDescriptor) -> bool:
        return call_of(desc) == call_of(self.desc)


class CallSchedule:
    """The agreed calls of one group's inline route (see the module docstring).

    Every call that would exchange a descriptor takes the next *index* (`advance`). While the
    *period* is unknown, every call exchanges, and the compressed ones are kept by index; the
    period becomes known when the first call of an epoch (`policy.epoch`) is agreed equal to
    the first call of an earlier epoch: the calls between repeat from then on, and a call's
    *place* is its index modulo the period. Epochs are not consulted after that, so ranks whose
    calls stay in step keep their places whatever their epochs (DDP's ``Join``: the joined
    rank's shadow calls run outside backward). All of this depends only on the calls and the
    agreements, the same on every rank."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._entries: dict[int, Entry] = {}
        self._starts: list[int] = []  # while learning: the index of each epoch's first call
        self._period: int | None = None
        self._origin = 0
        self._epoch: tuple[str, int] | None = None
        self._next = 0

    def advance(self) -> int:
        """The index of the call issued now (counts it)."""
        index = self._next
        self._next += 1
        epoch = policy.epoch()
        if epoch != self._epoch:
            self._epoch = epoch
            if self._period is None:
                self._starts.append(index)
        return index

    def entry(self, index: int) -> Entry | None:
        """The entry a call at ``index`` runs as, if it has runs left (None: exchange)."""
        if self._period is None:
            return None
        entry = self._entries.get(self._place(index))
        return entry if entry is not None and entry.left > 0 else None

    def ran(self, entry: Entry) -> None:
        """A call ran as ``entry`` without an exchange."""
        entry.left -= 1

    def agreed(self, index: int, desc: wire.CallDescriptor) -> None:
        """The ranks agreed at ``index`` to compress ``desc``'s call on the direct schedule."""
        if self._period is None:
            self._learn(index, desc)
        if self._period is not None:
            self._entries[self._place(index)] = Entry(desc, REAGREE_EVERY - 1)

    def restart(self) -> int:
        """Forget everything (every rank deviated alike): the call issued now is index 0."""
        self._reset()
        return self.advance()

    def _place(self, index: int) -> int:
        assert self._period is not None
        return self._origin + (index - self._origin) % self._period

    def _learn(self, index: int, desc: wire.CallDescriptor) -> None:
        """Keep the call agreed at ``index``; close the period where it repeats the first call
        of an earlier epoch."""
        if self._starts and index == self._starts[-1]:
            for start in self._starts[:-1]:
                first = self._entries.get(start)
                if first is not None and first.matches(desc):
                    self._period, self._origin = index - start, start
                    self._entries = {i: e for i, e in self._entries.items() if i >= start}
                    self._starts = []
                    return
        if self._starts and index - self._starts[0] >= CAPACITY:
            self._entries.clear()
            self._starts = [index]
        self._entries[index] = Entry(desc, REAGREE_EVERY - 1)


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
        n = group.size
        device = call.source.device
        m = -(-expected.numel // n)
        # the agreed call's codec (the group's settings are agreed too), its headers read on
        # the host even on CUDA: the verdict needs every rank's
        codec = dataclasses.replace(
            group.codec(expected.collective, expected.dtype, expected.numel, device.type,
                        call.route), seq=call.seq, host_check=True)
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
