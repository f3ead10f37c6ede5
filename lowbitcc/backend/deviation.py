"""What a rank runs when its call is not the one its place in the call schedule agreed on.

A rank that deviates (`call_schedule`) must not leave the others waiting on a transfer it does
not make, nor make one of another size. So it runs the agreed call in place of its own, on
values that tell the ranks what happened:

- `Deviation`, at a *compressed* entry: the agreed compressed call on zeros, every message
  flagged `wire.FLAG_DEVIATED` and naming this rank's own call. The direct schedule's first
  phase hands every rank a message of every rank, so every rank reads every rank's flag: where
  every rank deviated to the same call, every rank starts its schedule again; else every rank
  raises `CollectiveMismatchError` at this call (on CUDA the ranks that did not deviate see the
  call's outputs NaN and its flag non-finite instead, without a host synchronisation). On
  another schedule (ring, tree, hierarchical) not every rank reads every rank's messages, and
  the hierarchical one sums inside a node exactly: there the agreed call runs on NaN, this rank
  raises, every rank that reads a flagged message (or one built from it) raises at this call,
  and the others' outputs are NaN, which the place's canary (`call_schedule`) turns into an
  exchange at its next run, where this rank's descriptor reports the deviation.
- `ExactDeviation`, at an *exact* entry (floating-point SUM, AVG or PREMUL_SUM of one tensor):
  the agreed exact call on a buffer of NaN whose first `PROBE` elements (of each rank's part,
  for a reduce-scatter) are -0.0. Where every rank deviated, every contribution there is -0.0
  and so is the sum: every rank starts its schedule again. Else the sum there is another value
  (a rank that did not deviate added its own; only inputs that are themselves -0.0 at every
  such element on every such rank would look alike), this rank raises, and the others' outputs
  are NaN everywhere else, which their Works read when the call completes: they raise
  `CollectiveMismatchError` at this call too (`deviated_output`); and again at their next
  exchange (`wire.DESC_DEVIATED`), which their NaN canary brings forward to the place's second
  run after this one (`call_entry.Entry.keep`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from lowbitcc import schedules, state
from lowbitcc.backend.call_schedule import Entry
from lowbitcc.backend.deviated_output import probe_of
from lowbitcc.codec import wire
from lowbitcc.compressor import CallCompressor, Source

INVALID_SIGNATURE = 0xFFFFFFFF
"""The signature a rank that refused its own arguments sends for its call (no call's)."""


class Deviation:
    """A rank's call that is not its place's compressed ``entry``, run as the entry's call
    (its schedule and chunks) with flagged messages (see the module docstring), on ``group``
    (the `compressed_calls.CompressedCalls`) over ``route``, as call number ``seq``, on
    ``device``; ``signature``: `wire.call_signature` of this rank's own call
    (`INVALID_SIGNATURE` for a call this rank refused). `run` returns whether every rank
    deviated to this rank's call; ``direct``, once it ran, whether the entry's schedule is the
    direct one (else the call contributed NaN, and the others' outputs are NaN where no flagged
    message reached them)."""

    def __init__(self, group: Any, route: Any, seq: int, device: torch.device, entry: Entry,
                 signature: int) -> None:
        self.group, self.route, self.seq, self.device = group, route, seq, device
        self.entry, self.signature = entry, signature
        self.direct = True

    def run(self) -> bool:
        group, expected, device = self.group, self.entry.desc, self.device
        n = group.size
        m = -(-expected.numel // n)
        name = group.schedule_for(expected.numel * expected.dtype.itemsize, self.route,
                                  device.type)
        self.direct = name == "direct"
        # the agreed call's codec (the group's settings are agreed too), its headers read on
        # the host even on CUDA: the verdict needs every rank's
        codec = dataclasses.replace(
            group.codec(expected.collective, expected.dtype, expected.numel, device.type,
                        self.route), seq=self.seq, host_check=True)
        comp = CallCompressor(codec, state.FEEDBACK, "", state.STATS, error_dtype=None, beta=0.0,
                              reset_interval=0, rank=group.rank)
        comp.deviated = self.signature
        source = Source(torch.full((n * m,), 0.0 if self.direct else float("nan"),
                                   dtype=expected.dtype, device=device), n, m)
        chunk = group.chunk(self.route, m)
        if expected.collective == "all_reduce":
            schedules.all_reduce(name, source, torch.empty_like(source.tensor), comp,
                                 self.route.links, chunk)
        else:
            schedules.reduce_scatter(name, source, comp, self.route.links, chunk)
        seen = comp.wire_error
        return (self.direct and self.signature != INVALID_SIGNATURE
                and isinstance(seen, wire.DeviatedCallError)
                and all(s == self.signature for s in seen.signatures))


class ExactDeviation:
    """A rank's call that is not its place's exact entry ``entry`` (see the module docstring),
    run as the entry's call through ``issue(method, args, outputs)`` (the issuer's own call on
    the group's exact transport, as the others issue it) on ``world`` ranks, on ``device``."""

    def __init__(self, entry: Entry, world: int, device: torch.device, issue: Any) -> None:
        self.entry, self.world, self.device, self._issue = entry, world, device, issue

    def run(self) -> bool:
        """Run it and wait; whether every rank deviated (every probed element came back -0.0)."""
        desc = self.entry.desc
        n = self.world
        parts = n if desc.collective == "reduce_scatter" else 1
        m = desc.numel // parts
        probe = probe_of(m)
        buffer = torch.full((parts, m), float("nan"), dtype=desc.dtype, device=self.device)
        buffer[:, :probe] = -0.0
        opts = dist.AllreduceOptions() if parts == 1 else dist.ReduceScatterOptions()
        # SUM where the others run AVG or PREMUL_SUM: their scaling applies to their own inputs
        opts.reduceOp = dist.ReduceOp.SUM
        if parts == 1:
            out = buffer.view(-1)
            work = self._issue("allreduce", ([out], opts), [out])
        else:
            out = torch.empty(m, dtype=desc.dtype, device=self.device)
            work = self._issue("_reduce_scatter_base", (out, buffer.view(-1), opts), [out])
        work.wait()
        probed = out[:probe].cpu()
        return bool(((probed == 0) & torch.signbit(probed)).all())
