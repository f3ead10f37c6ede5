"""`CallPlan`: what one call place keeps for its steady-state compressed runs (one run as its
issuer takes it: `plan_run.PlanRun`).

Under the call schedule (`call_schedule`) a place whose entry is compressed runs the same call
step after step without a descriptor exchange (its agreement renewed in the background every 64
runs, `renewal`). Everything such a call needs that does not change between its runs is made
once, by the place's first run, and kept with the place's entry (`call_schedule.Entry.plan`;
carried to the next entry the ranks agree on at the place while its call stays the same): the
call's codec (its own copy, renumbered for each run on the CPU), one `CallCompressor` bound to
each run in turn (`CallCompressor.restart`) with every buffer the schedule uses
(`compressor.Buffers`: messages, received messages, decodes), the schedule's name and chunk
width, the statistics' byte counts and the cost model's size class. `CallPlan.run` is then the
whole call: encode, transfers, decodes and new error states, by **the schedule's own code**
(`schedules.all_reduce` / `reduce_scatter`, the same as a call's job runs after an exchange,
`compressed_call`), so a run's bytes, keys and error states are the job's.

Served (`reductions.Reductions`): every compressed entry: an all-reduce of one tensor (in
place), a reduce-scatter of one input into one output, and each tensor of a coalesced call,
on every issuer and schedule. A tensor that is not contiguous is staged through a kept buffer.

On a device a run also keeps the place's call counter (`_count`, `interface.CallCount`), and
with ``LocoConfig.call_graphs`` its launches and transfers (`launch`) are captured in CUDA
graphs and replayed from the place's third run on (`place_graph.PlaceGraph`); without it they
are recorded on the host once and issued from the record (`launch_record.LaunchRecord`), where
the direct schedule runs unchunked.

Threads: one run at a time, on the issuer's thread (the worker runs its jobs in order).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ReduceOp
from torch.multiprocessing.reductions import StorageWeakRef

from lowbitcc import schedules, state
from lowbitcc.backend.call_agreement import CollectiveMismatchError
from lowbitcc.backend.compressed_call import CallGroup
from lowbitcc.backend.exact import input_factor, op_type
from lowbitcc.backend.place_graph import PlaceGraph
from lowbitcc.backend.routes import Route
from lowbitcc.buffers import Buffers
from lowbitcc.codec import wire
from lowbitcc.codec.interface import CallCount
from lowbitcc.collectives import COLLECTIVES
from lowbitcc.compressor import Source
from lowbitcc.cost_model import CostModel
from lowbitcc.counters import RunTally

PLAN_COLLECTIVES = ("all_reduce", "reduce_scatter")
"""The collectives a plan runs."""


class CallPlan:
    """The steady-state compressed ``collective`` (one of `PLAN_COLLECTIVES`) of one place of
    ``group``, on ``route``, of flat input tensors like ``like`` (dtype, device, number of
    elements; see the module docstring)."""

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
        self.schedule = group.schedule_for(self.nbytes, route, self.device.type)
        self.chunk = group.chunk(route, m)
        self.codec = group.codec(collective, like.dtype, self.numel, self.device.type, route)
        self.kept_buffers = Buffers(keeps_messages=True,
                                    on_use=self._used_by_stream if self._cuda else None)
        self.comp = group.compressor(self.codec, scratch=self.kept_buffers)
        self._own_codec = self.codec.with_seq(0) if self._cpu else None
        """On the CPU, the plan's own copy of its codec, renumbered for each run."""
        self.modelled = group.modelled(self.numel)
        self._factor: float | None = None
        """The runs' input factor, where their op's type fixes it (every run of a plan has
        the op type of the place's entry: `call_schedule.call_key`)."""
        self._source_cleared = like.new_empty(0)
        self._source = Source(self._source_cleared, n, m)  # each run's tensor and op's factor
        self.tally, world = self._tallied(route.links.world)
        self._links = route.links
        self.links = route.links if world is route.links.world else route.links.with_world(world)
        self._slots: tuple[torch.Tensor, torch.Tensor] | None = None  # `_verdict_slot`'s
        self.turn = 0
        """Which of the plan's two verdict words the run has (`_verdict_slot`)."""
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
        self._no_core()

    def _no_core(self) -> None:
        """The plan's C++ core and what it hands back to the plan to decode (`finish_received`),
        none yet: `plan_cores.make_core` sets them once."""
        self.core: Any = None
        """The plan's C++ core (`plan_cores`: a ``PlanCore``, which the group's runner runs),
        or None: its runs are all Python's; made once, where ``core_checked`` is still False."""
        self.core_checked = False
        self.core_received: list[tuple[int, int, int | None, torch.Tensor]] = []
        """The core's transfers, each its columns ``a .. b``, its row (None: every row) and the
        buffer it receives into: an all-reduce's as `schedules.direct.decode_gathered` takes
        them."""
        self.core_gathered: list[torch.Tensor] = []
        """An all-reduce's core on more than two ranks: each transfer's second phase's buffer
        (its all-gather's of every rank's reduced row), beside ``core_received``'s."""
        self.core_kept: tuple[Any, ...] | None = None
        """A tree or ring schedule's core: what its decodes read (`schedules.tree.decode_kept`:
        its children's messages, None for a leaf, and the root's codes; `schedules.ring.
        decode_kept`: what each step received, each chunk's gathered rows, its columns); a
        hierarchical schedule's: ``("hier", rail)``, where its rail's all-reduce decodes (fp32
        ``[nodes * m]``, the core's rail sums; its transfers are ``core_received``'s and
        ``core_gathered``'s)."""

    @property
    def transport(self) -> Any:
        """The world transport the plan's runs use (`launch_record` lends it another while it
        records a run)."""
        return self.links.world

    @transport.setter
    def transport(self, world: Any) -> None:
        self.links = self._links.with_world(world)

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

    def run(self, tensor: torch.Tensor, op: Any, output: torch.Tensor | None, seq: int,
            key: str, buffer: StorageWeakRef | None, timed: bool) -> None:
        """All-reduce ``tensor`` (like the plan's) by ``op`` in place, or (a reduce-scatter
        plan) reduce-scatter flat ``tensor`` into ``output`` (this rank's ``numel / size``
        elements), compressed, as call number ``seq`` under feedback key ``key`` (``buffer``:
        the storage a derived key's layout is checked by; `CallCompressor`'s); ``timed``: the
        run's wall (CUDA: stream) time goes to the cost model. Raises what the call met (a
        peer's deviation, a corrupt message) once every transfer of the call is done, as
        `compressed_call.CompressedCall` does."""
        group, comp = self.group, self.comp
        if self.core is not None:
            self.core.wait()  # its last run in C++, whose buffers this one writes
        self.seq = seq
        stop = group.clock(self.size_class, False, self.nbytes) if timed else None
        tally = self.tally
        (tally or state.STATS).add_call("compressed", self.nbytes, self.logical_bytes)
        source = self._source
        try:
            if self._cpu:
                codec = self._own_codec
                codec.renumber(seq)
                comp.restart(codec, key, buffer)
            else:
                comp.restart(self.codec.with_seq(seq, self._count()), key, buffer,
                             self._verdict_slot())
            staged = not tensor.is_contiguous()
            flat = self._staged(tensor) if staged else (
                tensor if tensor.dim() == 1 else tensor.view(-1))
            source.tensor = flat
            factor = self._factor
            if factor is None:
                factor = input_factor(op, group.size)
                if op_type(op) != ReduceOp.PREMUL_SUM:  # fixed by the op's type and the world
                    self._factor = factor
            source.factor = factor
            self.runs += 1
            if self.graph is None or not self.graph.run(self, source, output):
                self.launch(source, output)
            if staged and output is None:
                tensor.copy_(flat.view(tensor.shape))
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

    def finish_received(self, tensor: torch.Tensor, seq: int,
                        output: torch.Tensor | None = None) -> bool:
        """The end of call number ``seq`` that the plan's core (`plan_cores`) ran on flat
        ``tensor`` (into ``output``: a reduce-scatter) until its transfers completed (into
        ``core_received``'s buffers) and that met a message its C++ check refused: the decodes
        by the schedule's own code, then the error `run` raises (on the thread that completed
        the last transfer, with the GIL). Returns, where they raise nothing (the Python check
        accepts what the C++ one refuses, e.g. an unknown flag bit), whether they met a
        non-finite value: the run's error states are then dropped, as `CallCompressor.finish`
        drops them on the Python path, and else kept."""
        comp, codec = self.comp, self._own_codec
        assert codec is not None  # (a core is a CPU plan's)
        self.seq = seq
        codec.renumber(seq)
        comp.restart(codec, "", None)
        try:
            if self.core_kept is not None:
                self._finish_off_direct(tensor, output)
            elif output is None and self.core_gathered:
                schedules.direct.decode_two_phases(
                    self.core_received, self.core_gathered, tensor.view(-1), comp, self.m,
                    self.group.rank, self.group.size)
            elif output is None:
                schedules.direct.decode_gathered(self.core_received, tensor.view(-1), comp,
                                                 self.m, self.group.size)
            else:
                target, straight = self._scattered_into(output)
                schedules.direct.decode_scattered(self.core_received, target, comp,
                                                  self.group.rank, self.group.size)
                if not straight:
                    output.copy_(target.view(output.shape))
            comp.finish()
            comp.raise_deferred(CollectiveMismatchError)
            return bool(comp.nonfinite)
        finally:
            if self.tally is not None:
                self.tally.flush()

    def _finish_off_direct(self, tensor: torch.Tensor, output: torch.Tensor | None) -> None:
        """`finish_received`'s decodes for a tree or ring schedule's core (their schedules'
        ``decode_kept``): into flat ``tensor`` (an all-reduce), or into ``output`` (straight
        where it is contiguous fp32, else through the plan's buffer and a cast); for a
        hierarchical schedule's, its rail's (the direct schedule's decodes; an all-reduce's
        into the core's rail sums, ``core_kept``'s, which the core then all-gathers over the
        node: it calls this before that step, ``backend/csrc/hier_run.h``)."""
        target, straight = (None, True) if output is None else self._scattered_into(output)
        flat, rank = tensor.view(-1), self.group.rank
        into = flat if output is None else None
        assert self.core_kept is not None and self._factor is not None
        if self.schedule == "hierarchical":  # the rail's decodes (an all-reduce's: its scratch)
            lay, rail, direct = self.links.layout, self.core_kept[1], schedules.direct
            if output is not None:
                direct.decode_scattered(self.core_received, target, self.comp, lay.node,
                                        lay.nodes)
            elif self.core_gathered:
                direct.decode_two_phases(self.core_received, self.core_gathered, rail,
                                         self.comp, self.m, lay.node, lay.nodes)
            else:
                direct.decode_gathered(self.core_received, rail, self.comp, self.m, lay.nodes)
        elif self.schedule == "tree":
            children, codes = self.core_kept
            schedules.tree.decode_kept(children, codes, self.comp, self.m, rank, into, target)
        else:
            arrived, gathered, ranges = self.core_kept
            source = Source(flat, self.group.size, self.m, self._factor)
            schedules.ring.decode_kept(arrived, gathered, ranges, self.comp, source, rank, into,
                                       target)
        if not straight:
            output.copy_(target.view(output.shape))

    def accepts(self, messages: torch.Tensor, m: int, shard: int, seq: int) -> bool:
        """Whether received ``messages`` (uint8 ``[n, P]``) of ``shard``'s ``m`` columns belong
        to call number ``seq`` by the Python path's own check (`ShardCodec.check_on_host`): what
        the plan's core asks where the C++ ``verify`` refused them, before it sums them
        (`plan_cores`; on the calling thread, with the GIL)."""
        codec = self._own_codec
        assert codec is not None  # (a core is a CPU plan's)
        codec.renumber(seq)
        try:
            codec.check_on_host(messages, m, [shard] * messages.shape[0])
        except wire.WireFormatError:
            return False
        return True

    def _staged(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor that is not contiguous, copied into the plan's flat staging buffer."""
        flat = self.kept("staged", self.numel, tensor.dtype)
        flat.view(tensor.shape).copy_(tensor)
        return flat

    def launch(self, source: Source, output: torch.Tensor | None) -> None:
        """The run's launches and transfers (eager, or captured by `place_graph`): the
        schedule's own code on ``source``: its tensor all-reduced in place, or reduce-scattered
        into ``output`` (straight where it is contiguous fp32, else through the decode buffer
        and a cast)."""
        comp, links, chunk = self.comp, self.links, self.chunk
        if output is None:
            schedules.all_reduce(self.schedule, source, source.tensor, comp, links, chunk)
            return
        target, straight = self._scattered_into(output)
        reduced = schedules.reduce_scatter(self.schedule, source, comp, links, chunk, target)
        if not straight:
            output.copy_(reduced.view(output.shape))

    def _scattered_into(self, output: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Where a reduce-scatter run decodes its sum (fp32 ``[m]``): ``output`` itself where it
        is contiguous fp32 (True), else the plan's buffer, which the run then copies into
        ``output`` (False)."""
        if output.dtype == torch.float32 and output.is_contiguous():
            return output.view(-1), True
        return self.kept("reduced", self.m, torch.float32), False

    def buffers(self) -> list[torch.Tensor]:
        """Every device buffer the plan keeps (what a replay of its graph uses besides the
        call's tensors)."""
        kept = self.kept_buffers.tensors()
        count = self._call_count
        return kept if count is None else [*kept, count.word, count.frame]

    def describe(self) -> str:
        """The last run's call, for messages."""
        return f"{self.collective} of {self.numel} {self.codec_dtype} elements (call #{self.seq})"

    def kept(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``dtype [numel]`` on the plan's device, made by the first run that asks for ``name``
        and kept for every later run of the plan (`compressor.Buffers`)."""
        return self.kept_buffers.get(name, numel, dtype, self.device)

    def addresses(self) -> torch.Tensor:
        """The place's int64 ``[2]`` device word of its call's source and output addresses,
        which a replayed graph's first and last launches read (`interface.CallCount.addresses`,
        set by `place_graph.PlaceGraph` before each launch)."""
        return self.kept("addresses", 2, torch.int64)

    def _used_by_stream(self, *buffers: torch.Tensor) -> None:
        """On CUDA, mark kept ``buffers`` used by the run's (current) stream (`kept`)."""
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
            self._used_by_stream(count.word, count.frame)
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
        slots = self._slots
        if slots is None:  # the kept words are never replaced
            words = self.kept("verdicts", 16, torch.uint8)
            slots = self._slots = (words[:8], words[8:])
        elif self._cuda:  # (as `kept` marks them: a view marks the words' whole storage)
            self._used_by_stream(slots[0])
        self.turn ^= 1
        return slots[self.turn]
