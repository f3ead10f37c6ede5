"""`CallPlan`: one call place's steady-state compressed all-reduce or reduce-scatter, read and
run in one method.

Under the call schedule (`call_schedule`) a place whose entry is compressed runs the same call
step after step without a descriptor exchange (its agreement renewed in the background every 64
runs, `renewal`). Everything such a call
needs that does not change between its runs is made once, by the place's first planned run,
and kept with the place's entry (`call_schedule.Entry.plan`; carried to the next entry the
ranks agree on at the place while its call stays the same): the call's codec, one
`CallCompressor` bound to each run in turn (`CallCompressor.restart`), the decode buffer, the
statistics' byte counts and the cost model's size class. `CallPlan.run` is then the whole
call: call number, feedback key, encode, transfers, decodes, new error states, deferred
errors; the same arithmetic, transfers, keys and error states as the direct schedule
(`schedules.direct`) run through `compressed_call.AllReduceCall` or `ReduceScatterCall`, so
that ranks may differ in which of the two runs a call (`tests/backend/test_call_plans.py` holds
them equal bit for bit).

Served (`Reductions.at_issue`): an all-reduce of one contiguous dense tensor, or a
reduce-scatter of one into one output (`_reduce_scatter_base`, `reduce_scatter_tensor`), on an
issuer with
``plans`` (`LOCO_ISSUER=inline` on CPU, and CUDA outside a graph capture, whose issuer runs
`run` on the call's stream, `cuda_issue.CudaIssuer.compressed`), ``LocoConfig.call_plans``
on. A place's compressed entry always runs the direct schedule (`call_schedule.runs_for`),
and inline routes never cut rows into chunks. Not yet served: calls of several tensors
(a list of outputs, coalesced calls); those run their jobs as before.

On a device a run also keeps the place's call counter (`_count`, `interface.CallCount`), and
with ``LocoConfig.call_graphs`` its launches and transfers (`launch`) are captured in CUDA
graphs and replayed from the place's third run on (`place_graph.PlaceGraph`); without it, where
``LocoConfig.call_replay`` is on, they are recorded on the host once and issued from the record
(`launch_record.LaunchRecord`).

Threads: the calling thread only (the issuer's), one call at a time.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ReduceOp
from torch.multiprocessing.reductions import StorageWeakRef

from lowbitcc import policy, state
from lowbitcc.backend.call_agreement import CollectiveMismatchError
from lowbitcc.backend.compressed_call import CallGroup
from lowbitcc.backend.exact import input_factor, op_type
from lowbitcc.backend.place_graph import PlaceGraph
from lowbitcc.backend.routes import Route
from lowbitcc.codec import wire
from lowbitcc.codec.interface import CallCount, unfused
from lowbitcc.collectives import COLLECTIVES
from lowbitcc.compressor import Source
from lowbitcc.cost_model import CostModel
from lowbitcc.counters import RunTally

PLAN_COLLECTIVES = ("all_reduce", "reduce_scatter")
"""The collectives a plan runs."""


class CallPlan:
    """The steady-state compressed ``collective`` (one of `PLAN_COLLECTIVES`) of one place of ``group``,
    on ``route``, of input tensors like ``like`` (dtype, device, number of elements; see the
    module docstring)."""

    def __init__(self, group: CallGroup, route: Route, like: torch.Tensor,
                 collective: str = "all_reduce") -> None:
        n = group.size
        self.group, self.route, self.collective = group, route, collective
        self.numel = like.numel()
        self.m = m = -(-self.numel // n)
        self.nbytes = self.numel * like.element_size()
        self.codec_dtype = like.dtype
        self.device = like.device
        """Where the plan's tensors and kept buffers live (every run's tensors are there)."""
        self._cpu, self._cuda = like.device.type == "cpu", like.device.type == "cuda"
        self.logical_bytes = COLLECTIVES[collective].logical_bytes(n * m * like.element_size(), n)
        self.size_class = CostModel.size_class(collective, self.nbytes, self.device.type)
        self.codec = group.codec(collective, like.dtype, self.numel, self.device.type, route)
        self.comp = group.compressor(self.codec)
        self._own_codec = self.codec.with_seq(0) if self._cpu else None
        """On the CPU, the plan's own copy of its codec, renumbered for each run."""
        self._modelled = group.modelled(self.numel)
        self._factor: float | None = None
        """The runs' input factor, where their op's type fixes it (every run of a plan has
        the op type of the place's entry: `call_schedule.call_key`)."""
        self._source_cleared = like.new_empty(0)
        self._source = Source(self._source_cleared, n, m)  # each run's tensor and op's factor
        self.tally, self.transport = self._tallied(route.links.world)
        self._kept: dict[str, tuple[torch.Tensor, int, torch.dtype]] = {}  # `kept`'s, and as made
        self._pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # `_sent`'s, likewise
        self._rows: list[tuple[int, int, int, torch.Tensor]] | None = None  # `_columns`'
        self._rows_at = 0
        self._row_sizes: list[int] = []  # each of `_rows`' hi - lo
        self._slots: tuple[torch.Tensor, torch.Tensor] | None = None  # `_verdict_slot`'s
        self.turn = 0
        """Which of the plan's two verdict words the run has (`_verdict_slot`)."""
        self.shards = list(range(n))
        self.canary_entry: Any = None
        """The place's entry a run runs as, while the caller runs it: on CUDA its verdict
        becomes the entry's canary (`cuda_verdicts.keep_canaries`)."""
        self.verdict: torch.Tensor | None = None
        """After a run on a device: the call's flag of a foreign message received
        (`CallCompressor.foreign`), which the CUDA issuer turns into the Work's verdict word."""
        self.seq = 0
        self.runs = 0
        """The plan's runs so far (this one included, during a run)."""
        self._call_count: CallCount | None = None  # `_count`'s
        self._last_seq = 0
        self._counter_next: int | None = None  # what the counter holds after the last run
        self.stride = 0
        """Calls of the group from the plan's previous run to this one (0: none before)."""
        self.counter_holds_seq = False
        """During a device run: the place's counter holds the run's call number (the run
        before set it, having guessed this run's stride)."""
        self.graph = PlaceGraph.of(self)
        """The place's graphs or host records, where it replays them (`place_graph`)."""

    def _tallied(self, transport: Any) -> tuple[RunTally | None, Any]:
        """On the CPU, what a run counts (`counters.RunTally`: the compressor's statistics,
        and ``transport`` metering into it), added to `state.STATS` once at the run's end;
        on a device none (each step adds its own: a graph's capture counts the bytes of its
        replays, `place_graph`) and ``transport`` as it is."""
        if not self._cpu:
            return None, transport
        tally = self.comp.stats = RunTally(state.STATS)
        metering = getattr(transport, "metering", None)
        return tally, transport if metering is None else metering(tally)

    def run(self, tensor: torch.Tensor, op: Any, output: torch.Tensor | None = None) -> None:
        """All-reduce ``tensor`` (contiguous, like the plan's) by ``op`` in place, or (a
        reduce-scatter plan) reduce-scatter it into ``output`` (this rank's ``numel / size``
        elements), compressed; raises what the call met (a peer's deviation, a corrupt
        message) once every transfer of the call is done, as
        `compressed_call.CompressedCall` does."""
        group, comp = self.group, self.comp
        self.seq = group.agreement.next_seq()
        key, buffer = "", None
        if comp.error_dtype is not None:  # keys name error states, which a call without feedback lacks
            key, derived = group.key(self.collective, tensor, self.numel)
            buffer = StorageWeakRef(tensor.untyped_storage()) if derived else None
        else:  # counted all the same: a `feedback_key` block may also name another group's calls
            policy.explicit_key()
        stop = None
        if self._modelled and not policy.forced():
            group.cost_model.count(self.size_class)
            stop = group.clock(self.size_class, False, self.nbytes)
        tally = self.tally
        (tally or state.STATS).add_call("compressed", self.nbytes, self.logical_bytes)
        source = self._source
        try:
            if self._cpu:
                codec = self._own_codec
                codec.renumber(self.seq)
                comp.restart(codec, key, buffer)
            else:
                comp.restart(self.codec.with_seq(self.seq, self._count()), key, buffer,
                             self._verdict_slot())
            source.tensor = tensor if tensor.dim() == 1 else tensor.view(-1)
            factor = self._factor
            if factor is None:
                factor = input_factor(op, group.size)
                if op_type(op) != ReduceOp.PREMUL_SUM:  # fixed by the op's type and the world
                    self._factor = factor
            source.factor = factor
            self.runs += 1
            if self.graph is None or not self.graph.run(self, source, output):
                self.launch(source, output)
            if self._call_count is not None:  # what its last launch left there
                self._counter_next = self._call_count.value
            if not self._cpu:
                self.verdict = comp.foreign()
            comp.finish()
            if comp.wire_error is not None:
                comp.raise_deferred(CollectiveMismatchError)
            if stop is not None:
                stop()
        finally:
            source.tensor = self._source_cleared  # the call's tensor is not kept
            if tally is not None:
                tally.flush()

    def launch(self, source: Source, output: torch.Tensor | None) -> None:
        """The run's launches and transfers (eager, or captured by `place_graph`): ``source``'s
        tensor all-reduced in place, or reduce-scattered into ``output``."""
        if output is not None:
            self._reduce_scatter(source, output)
        elif self.group.size == 2:
            self._gather(source, source.tensor)
        else:
            self._scatter_gather(source, source.tensor)

    def buffers(self) -> list[torch.Tensor]:
        """Every device buffer the plan keeps (what a replay of its graph uses besides the
        call's tensors)."""
        kept = [buffer for buffer, _, _ in self._kept.values()]
        count = self._call_count
        return kept if count is None else [*kept, count.word, count.frame]

    def describe(self) -> str:
        """The last run's call, for messages."""
        return f"{self.collective} of {self.numel} {self.codec_dtype} elements (call #{self.seq})"

    def kept(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``dtype [numel]`` on the plan's device, made by the first run that asks for ``name`` and
        kept for every later run of the plan: the decode buffer ("decoded": fp32 ``[m]``, the
        reduced own row of more than two ranks, or a row decoded before its cast into the
        output), each stage's messages ("sent <stage>": uint8 ``[rows * P]``) and non-finite
        bytes ("flags <stage>": uint8 ``[rows * groups]``), and the received messages
        ("received <stage>": the all-gather's or the all-to-all's). A run's transfers and
        decodes of a buffer end before the next run writes it: inline calls wait for them; on
        CUDA the runs of a place are ordered on the issuer's stream, and each run marks the
        buffer used by its stream (a side stream for ``async_op``), so that the caching
        allocator hands it on only after every stream that used it, once the plan is gone."""
        kept = self._kept.get(name)
        if kept is None:
            kept = self._kept[name] = (torch.empty(numel, dtype=dtype, device=self.device),
                                       numel, dtype)
        buffer, made_numel, made_dtype = kept
        assert made_numel == numel and made_dtype == dtype, name
        if self._cuda:
            self._used_by_stream(buffer)
        return buffer

    def addresses(self) -> torch.Tensor:
        """The place's int64 ``[2]`` device word of its call's source and output addresses,
        which a replayed graph's first and last launches read (`interface.CallCount.addresses`,
        set by `place_graph.PlaceGraph` before each launch)."""
        return self.kept("addresses", 2, torch.int64)

    def _used_by_stream(self, *buffers: torch.Tensor) -> None:
        """On CUDA, mark kept ``buffers`` used by the run's (current) stream (`kept`)."""
        if self._cuda:
            stream = torch.cuda.current_stream(self.device)
            for buffer in buffers:
                buffer.record_stream(stream)

    def _count(self) -> CallCount:
        """On a device (never asked on the CPU: the C++ codec keeps none), the place's call
        counter (`interface.CallCount`, made by the first run with a zero word and frame
        accumulator, a row per rank and one, and kept; its ``value`` set anew by every run),
        whose word this run's last launch sets to the call number the place's next run takes
        where as many calls come between as since its previous run: the number a replayed
        graph of the place would use."""
        count, last, self._last_seq = self._call_count, self._last_seq, self.seq
        if count is None:
            count = self._call_count = CallCount(
                torch.zeros(2, dtype=torch.int32, device=self.device), False, None,
                torch.zeros(self.group.size + 1, dtype=torch.int64, device=self.device))
        elif self._cuda:
            stream = torch.cuda.current_stream(self.device)
            count.word.record_stream(stream)
            count.frame.record_stream(stream)
        self.stride = self.seq - last if last else 0
        self.counter_holds_seq, self._counter_next = self._counter_next == self.seq, None
        count.value = self.seq + self.stride if last else None
        return count

    def _verdict_slot(self) -> torch.Tensor | None:
        """A device run's verdict (uint8 ``[8]``) where the plan keeps no error states
        (feedback off, the default format's setting): one of two words the plan keeps and
        hands to its runs in turn. What reads a run's verdict after the run reads it on the
        run's stream before the next run of the place, which is ordered after it (the Work's
        verdict word and the place's canary are copied to the host behind the run), so the
        run after the next may write it again. With feedback on each run makes its own: its
        error states keep it as their poison word for as long as they are kept, which may
        outlast two runs (a key the next run does not use). None on the CPU."""
        if self._cpu or self.comp.error_dtype is not None:
            return None
        words = self.kept("verdicts", 16, torch.uint8)
        if self._slots is None:  # the kept words are never replaced
            self._slots = (words[:8], words[8:])
        self.turn ^= 1
        return self._slots[self.turn]

    def _sent(self, stage: str, rows: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept messages ``uint8 [rows, P]`` and non-finite bytes of ``stage``'s encode of
        ``rows`` rows of ``m`` elements (the pair made by the first run, as `kept`'s)."""
        pair = self._pairs.get(stage)
        if pair is None:
            size = self.codec.message_bytes(m)
            pair = self._pairs[stage] = (
                self.kept(f"sent {stage}", rows * size, torch.uint8).view(rows, size),
                self.kept(f"flags {stage}", rows * wire.ngroups(m, self.codec.group_size),
                          torch.uint8))
        elif self._cuda:
            self._used_by_stream(*pair)
        return pair

    def _columns(self, gathered: torch.Tensor) -> list[tuple[int, int, int, torch.Tensor]]:
        """Two ranks: per row ``r`` with elements, ``(r, lo, hi, column)``: its place
        ``[lo, hi)`` in the output and its messages in ``gathered`` (the received messages,
        contiguous, ``senders * rows * P`` bytes: the kept buffer unless a transport received
        into another), viewed again only where ``gathered`` moved."""
        if self._rows is None or self._rows_at != gathered.data_ptr():
            m, n = self.m, self.group.size
            by_sender = gathered.view(n, n, -1)
            self._rows = [(r, min(r * m, self.numel), min((r + 1) * m, self.numel),
                           by_sender[:, r]) for r in range(n) if r * m < self.numel]
            self._row_sizes = [hi - lo for _, lo, hi, _ in self._rows]
            self._rows_at = gathered.data_ptr()
        return self._rows

    def _gather(self, source: Source, out: torch.Tensor) -> None:
        """Two ranks: every row encoded (stage "gather"), all-gathered, and each row's two
        messages decoded and summed in rank order into its place in ``out``: on a device every
        row in one launch where the kernels can (`CallCompressor.decode_rows`), else row by
        row."""
        comp, n, m = self.comp, self.group.size, self.m
        messages = comp.encode("gather", source, self.shards, *self._sent("gather", n, m))
        kept = self.kept("received gather", n * messages.numel(), torch.uint8)
        pending = self.transport.all_gather_async(messages, kept)
        if not self._cpu:
            received = pending.wait()
            if not comp.decode_rows(received.view(n * n, -1), n, m, out):
                unfused(comp.codec.count, "row-by-row decode")  # each row's launch counts
                rows = self._columns(received)
                self._decode_rows(rows, [out[lo:hi] for _, lo, hi, _ in rows])
            return
        # the decodes' views are made while the transfer runs: the first Python after a wait
        # runs several times slower (caches, a woken core)
        rows = self._columns(kept)
        places = out.split_with_sizes(self._row_sizes)  # row r's [lo, hi), as in `rows`
        received = pending.wait()
        if received.data_ptr() != kept.data_ptr():  # a transport that received elsewhere
            rows = self._columns(received)
        self._decode_rows(rows, places)

    def _decode_rows(self, rows: list[tuple[int, int, int, torch.Tensor]],
                     places: list[torch.Tensor]) -> None:
        """Each row's messages (`_columns`) decoded and summed into its ``place`` (a slice of
        the output): straight where it is fp32 and whole, else through the decode buffer."""
        comp, m = self.comp, self.m
        for (r, lo, hi, column), place in zip(rows, places):
            if place.dtype == torch.float32 and hi - lo == m:
                comp.decode_sum(column, m, r, place)
            else:
                decoded = comp.decode_sum(column, m, r,
                                          self.kept("decoded", m, torch.float32))
                place.copy_(decoded[:hi - lo])

    def _reduce_scatter(self, source: Source, output: torch.Tensor) -> None:
        """Every row encoded (stage "rs") and sent to its owner, the own row's messages summed
        in rank order into ``output`` (straight where it is contiguous fp32, else through the
        decode buffer and a cast)."""
        comp, m, rank = self.comp, self.m, self.group.rank
        straight = output.dtype == torch.float32 and output.is_contiguous()
        target = output.view(-1) if straight else self.kept("decoded", m, torch.float32)
        received = self._scatter(source)  # (the target made before the wait, as in `_gather`)
        decoded = comp.decode_sum(received, m, rank, target)
        if not straight:
            output.copy_(decoded.view(output.shape))

    def _scatter_gather(self, source: Source, out: torch.Tensor) -> None:
        """More ranks: every row encoded (stage "rs") and sent to its owner, the own row's
        messages summed in rank order and re-encoded (stage "ag"; on CUDA in one launch,
        `CallCompressor.encode_sum`), all-gathered and decoded into ``out``."""
        comp, m, rank = self.comp, self.m, self.group.rank
        decoded = self.kept("decoded", m, torch.float32)
        mine = comp.encode_sum("ag", self._scatter(source), m, rank, decoded,
                               *self._sent("ag", 1, m))
        gathered = self.transport.all_gather_async(mine[0], self.kept(
            "received ag", self.group.size * mine.numel(), torch.uint8)).wait()
        comp.decode_into(gathered, m, self.shards, out)

    def _scatter(self, source: Source) -> torch.Tensor:
        """Every row of ``source`` encoded (stage "rs") and sent to its owner: the received
        messages of the own row, one per rank."""
        rows = len(self.shards)
        messages = self.comp.encode("rs", source, self.shards,
                                    *self._sent("rs", rows, self.m))
        return self.transport.all_to_all_async(messages, self.kept(
            "received rs", messages.numel(), torch.uint8)).wait()

