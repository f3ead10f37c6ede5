"""Compressed calls of one "loco" group: what happens between c10d's call and the schedule.

For each compressible all-reduce or reduce-scatter (the policy said so; see `lowbitcc.policy`),
`CompressedCalls` builds one worker job that

1. names the call's error-feedback key in the issuing thread (`key`: explicit, or group,
   collective, dtype, numel and the ordinal of that signature within the current backward pass or
   optimizer step) and its sequence number;
2. on the worker, exchanges call descriptors (one `wire.FRAME_BYTES` frame per rank, twice
   over) so that ranks that issued different calls all raise `CollectiveMismatchError`
   (``config.check``),
   and falls back to the exact call when the agreed size is under ``min_size``, when any rank
   would not compress it (its policy said exact: e.g. a joined DDP rank's shadow all-reduce,
   issued outside backward, or an `exact()` block on one rank; every CPU reduction comes here,
   see `agrees_on`, and one of at most `wire.FRAME_PAYLOAD` bytes is reduced from the frames
   themselves), or when rank 0's cost model (`lowbitcc.cost_model`,
   its suggestion carried in the descriptor) says the exact call has been faster for calls of
   this size. Rank 0's exact suggestion carries a *lease*: that many further calls of the
   size class (up to its next exploration) run exact without the exchange on every rank (a
   mismatch among them then behaves as on gloo; on CUDA they go straight to NCCL with the
   caller's options, `goes_exact`);
3. builds the call's `ShardCodec` (header fields, the route's kernels) and `CallCompressor`
   (codec, feedback store, statistics), accounts the logical bytes, and runs the schedule
   (``config.schedule``, or `choose_schedule` for "auto") over the route's links.

A `Route` is the device-specific part: which codec kernels and which links (transports) serve
tensors of one device type, whether its jobs run in the calling thread (``inline``: CUDA, see
`cuda_issue`) and which schedules its links can run. Schedules, keys, feedback, descriptor
agreement and byte accounting are shared by every device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from lowbitcc import policy, schedules, state
from lowbitcc.backend.cuda_issue import StreamTimings
from lowbitcc.backend.exact import (
    Reduction,
    count_exact,
    op_type,
    reduce_in_rank_order,
    reduces_in_rank_order,
)
from lowbitcc.backend.issue_queue import InnerWork, Job, callback_parent
from lowbitcc.backend.leases import Leases, Ticket
from lowbitcc.codec import wire
from lowbitcc.codec.interface import Kernels
from lowbitcc.codec.shard_codec import ShardCodec
from lowbitcc.collectives import COLLECTIVES
from lowbitcc.compressor import CallCompressor, Scratch, Source
from lowbitcc.config import LocoConfig
from lowbitcc.cost_model import CostModel, SizeClass
from lowbitcc.schedules.chunking import chunk_width
from lowbitcc.transports.gloo import GlooTransport
from lowbitcc.transports.links import Links
from lowbitcc.transports.topology import NodeLayout

log = logging.getLogger(__name__)


class CollectiveMismatchError(RuntimeError):
    """Ranks issued different collectives (shape, dtype, op or order) on the same group."""


class InvalidPeerCallError(ValueError):
    """Another rank's arguments for this call were invalid: that rank raised its own error, this
    one raises this, no data moved, and the group stays in step."""


class CorruptFrameError(wire.WireFormatError):
    """Every copy of a descriptor frame arrived corrupt on this rank (`wire.pick_frames`). ``exact_known``:
    the intact frames settle the call's path anyway (this rank, or another whose frame arrived
    intact, would not compress the call, and the call does not travel in the frames), so this
    rank can still take the exact path with the ranks that received every frame intact, and
    raise once the call is done."""

    def __init__(self, message: str, exact_known: bool) -> None:
        super().__init__(message)
        self.exact_known = exact_known


@dataclasses.dataclass(frozen=True)
class Route:
    """The codec kernels and the links that compressed calls on one device type use.

    ``inline``: the jobs run in the calling thread, not on the worker (the descriptor exchange,
    which uses the inner gloo group, is then handed to the worker), and are not cut into
    chunks (``chunk_size``): chunks let a CPU rank code one while the network moves another,
    but work enqueued on one CUDA stream gains nothing from them and pays each step's launch
    overhead once per chunk; ``schedules``: the ones the links can run (None: all)."""

    kernels: Kernels
    links: Links
    inline: bool = False
    schedules: tuple[str, ...] | None = None


def choose_schedule(config: LocoConfig, nbytes: int, world: int, layout: NodeLayout) -> str:
    """The schedule for a call of ``nbytes`` input bytes per rank on ``world`` ranks.

    ``config.schedule`` unless it is "auto"; auto takes hierarchical when the group spans
    several nodes of several ranks each, else tree below ``config.auto_tree_bytes`` from
    ``config.auto_tree_ranks`` ranks on, else ring from ``config.auto_ring_ranks`` ranks on,
    else direct. Every input is the same on every rank, so every rank chooses the same.
    """
    if config.schedule != "auto":
        return config.schedule
    if layout.regular and layout.nodes > 1 and layout.node_size > 1:
        return "hierarchical"
    if nbytes < config.auto_tree_bytes and world >= config.auto_tree_ranks:
        return "tree"
    if config.auto_ring_ranks and world >= config.auto_ring_ranks:
        return "ring"
    return "direct"


class CompressedCalls:
    """Builds the worker jobs of one group's compressed calls (see the module docstring).

    ``agreement`` is the group's inner gloo transport (descriptor exchange, unmetered);
    ``routes`` maps a device type to its `Route`; ``on_worker(fn)`` runs ``fn`` on the group's
    worker thread and waits (for inline routes). `group_name` is set by c10d after creation.
    """

    def __init__(self, rank: int, size: int, config: LocoConfig, agreement: GlooTransport,
                 routes: dict[str, Route],
                 on_worker: Callable[[Callable[[], None]], None] | None = None) -> None:
        self.rank = rank
        self.size = size
        self.config = config
        self.group_name = ""
        self._agreement = agreement
        self._routes = routes
        self._on_worker = on_worker
        self.cost_model = CostModel()
        self._stream_timings = StreamTimings()  # the CUDA calls' (the issuing thread's)
        self.leases = Leases(self.cost_model)
        self._lock = threading.Lock()
        self._seq = 0
        self._epoch: tuple[str, int] | None = None
        self._ordinals: dict[tuple, int] = {}
        self._scratch = Scratch()  # the worker thread's decode buffer

    def serves(self, device: torch.device) -> bool:
        return device.type in self._routes

    def agrees_on(self, numels: list[int], device_type: str = "cpu") -> bool:
        """Whether a reduction that this rank will not compress must still exchange descriptors
        (with ``wants=False``): another rank may be about to compress the same call, or to
        issue another one (a size, dtype or op mismatch then raises instead of hanging). Its
        calls have ``numels`` elements (the whole input of each). On CPU every such call
        exchanges (``check``, and a policy that may compress); the small ones carry their input
        in the frame (`wire.FRAME_PAYLOAD`) and need no second exchange. CUDA calls under
        ``min_size`` go straight to NCCL without it (docs/reliability.md)."""
        cfg = self.config
        return (cfg.check and cfg.policy != "never" and bool(numels)
                and (device_type == "cpu" or all(n >= cfg.min_size for n in numels)))

    def checks_data_movement(self) -> bool:
        """Whether exact data movements of CPU tensors (broadcast, all-gather, gather, scatter,
        all-to-all, barrier, reduce) exchange a descriptor first (`checked`): under
        ``check_all`` with a policy that may compress (where CPU reductions exchange one too),
        so that a broadcast on one rank against an all-reduce on another raises instead of
        hanging (docs/reliability.md)."""
        cfg = self.config
        return cfg.check and cfg.check_all and cfg.policy != "never"

    def checked(self, collective: str, dtype: torch.dtype, numel: int, job: Job, *,
                op: int = 0, root: int = 0) -> Job:
        """``job`` (an exact data movement, issued now) preceded on the worker by a descriptor
        exchange naming ``collective`` with ``numel`` elements of ``dtype`` (0 where ranks may
        differ), ``op`` and ``root``: raises `CollectiveMismatchError` on every rank if another
        rank issued another call."""
        desc = wire.CallDescriptor(collective=collective, dtype=dtype, op=op, numel=numel,
                                   seq=self._next_seq(), bits=0, group_size=root,
                                   compressed=False, parent=callback_parent())

        def run() -> Any:
            try:
                self._agree(desc)
            except CorruptFrameError as exc:
                return self._then_raise(exc, job)
            return job()

        return run

    def refused(self, collective: str, error: Exception, numels: list[int],
                like: torch.Tensor | None) -> Job:
        """The job of a call whose arguments this rank found invalid (``error``), where a
        valid call would exchange a descriptor: it exchanges one flagged `wire.DESC_INVALID`,
        so that every other rank raises `InvalidPeerCallError` for the same call instead of
        pairing its exchange with this rank's next call, then raises ``error``. ``numels``:
        the whole input of each call (tensor) the valid call would be, as this rank's outputs
        say, of ``like``'s dtype and device: it takes as many sequence numbers. Where the cost
        model has leased the first one's size class to the exact path, the valid ranks skip the
        exchange: this rank takes the lease and raises without one (the others then wait in
        gloo until the group's timeout, as on gloo). Data movements pass ``[0]`` and None (one
        call, never leased)."""
        seqs = [self._next_seq() for _ in numels]
        desc = wire.CallDescriptor(collective=collective, dtype=torch.float32, op=0, numel=0,
                                   seq=seqs[0], bits=0, group_size=0, compressed=False,
                                   invalid=True)
        ticket = None
        if like is not None and self._leasable(numels[0]):
            ticket = self.leases.begin(CostModel.size_class(
                collective, numels[0] * like.element_size(), like.device.type))

        def run() -> Any:
            try:
                if ticket is not None and (ticket.leased or ticket.take()):
                    raise error
                # this rank's own error says more than any the exchange raises
                with contextlib.suppress(CorruptFrameError, InvalidPeerCallError,
                                         CollectiveMismatchError):
                    self._agree(desc)
                raise error
            finally:
                if ticket is not None:
                    ticket.settle()

        return run

    def route(self, device: torch.device) -> Route:
        try:
            return self._routes[device.type]
        except KeyError:
            raise ValueError(
                f"lowbitcc: compressed calls on {device.type} tensors are not served by this "
                f"group (served: {', '.join(self._routes)})"
            ) from None

    # -- in the issuing thread ---------------------------------------------------------------
    def key(self, collective: str, tensor: torch.Tensor, numel: int) -> tuple[str, bool]:
        """The error-feedback key of this call (counts it within the current epoch), and
        whether it was derived from the call's position (False: named by `feedback_key`)."""
        explicit = policy.explicit_key()
        if explicit is not None:
            return f"{self.group_name}|{explicit}", False
        epoch = policy.epoch()
        signature = (collective, tensor.dtype, numel)
        with self._lock:
            if epoch != self._epoch:
                self._epoch = epoch
                self._ordinals.clear()
            ordinal = self._ordinals.get(signature, 0)
            self._ordinals[signature] = ordinal + 1
        dtype = str(tensor.dtype).replace("torch.", "")
        return f"{self.group_name}|{collective}|{dtype}|{numel}|{ordinal}", True

    def ticket(self, collective: str, like: torch.Tensor, numel: int,
               wants: bool) -> Ticket | None:
        """The lease decision (`leases`) of a reduction of ``numel`` elements of ``like``'s
        dtype and device, issued now by the calling thread; None where the call does not count
        against leases (`_leasable`). A ticket decided at once (``leased``) means the caller
        issues the exact call itself, with its own options (no job, no descriptor exchange;
        counted as its job would count it: the lease, the model's count, the feedback key's
        ordinal where the call ``wants`` compression, its call number, statistics); otherwise
        the caller passes the ticket to the call's job (`all_reduce`, `reduce_scatter`), which
        decides."""
        if not self._leasable(numel):
            return None
        ticket = self.leases.begin(CostModel.size_class(
            collective, numel * like.element_size(), like.device.type))
        if ticket.leased:
            self._next_seq()  # as its job would: the ranks' call numbers stay in step
            if wants:
                self.key(collective, like, numel)
        return ticket

    def goes_exact(self, collective: str, like: torch.Tensor, numel: int,
                   wants: bool = True) -> tuple[bool, Ticket | None]:
        """For a call on an inline route (CUDA), issued now in the calling thread: whether the
        caller should issue the exact call itself (calls under ``min_size``, exact on every rank
        whatever the policy, as CPU calls skip the exchange: `agrees_on`; calls leased at once,
        see `ticket`), and the call's ticket otherwise."""
        if numel < self.config.min_size:
            return True, None
        ticket = self.ticket(collective, like, numel, wants)
        return ticket is not None and ticket.leased, ticket

    def _leasable(self, numel: int) -> bool:
        """Whether a reduction of ``numel`` elements counts against the cost model's leases.
        Every rank counts the same calls, whatever its policy says (in a `compressed()` block
        too: the ranks holding the lease skip the exchange, so a rank that did not would hang)."""
        cfg = self.config
        return cfg.cost_model and cfg.check and numel >= cfg.min_size

    def _next_seq(self) -> int:
        with self._lock:
            self._seq += 1
            return self._seq

    def all_reduce(self, tensor: torch.Tensor, op: Any, exact: Job, wants: bool = True,
                   ticket: Ticket | None = None, leased: Job | None = None) -> Job:
        """The job of a compressed all-reduce of ``tensor`` in place (``exact``: the fallback
        after an exchange; ``wants``: whether this rank would compress it, see `agrees_on`;
        ``ticket``: the call's undecided lease decision from `ticket`, None: taken here;
        ``leased``: what runs when the job takes a lease, default ``exact``)."""

        def run(source: Source, comp: CallCompressor, route: Route) -> None:
            out = tensor.view(-1) if tensor.is_contiguous() else torch.empty_like(source.tensor)
            schedules.all_reduce(self._schedule(source, route), source, out, comp, route.links,
                                 self._chunk(route, source.m))
            if out.data_ptr() != tensor.data_ptr():
                tensor.copy_(out.view(tensor.shape))

        def deliver(reduced: torch.Tensor) -> None:
            tensor.copy_(reduced.view(tensor.shape))

        return self._job("all_reduce", tensor, op, run, deliver, exact, wants, ticket, leased)

    def reduce_scatter(self, output: torch.Tensor, source: torch.Tensor, op: Any,
                       exact: Job, wants: bool = True, ticket: Ticket | None = None,
                       leased: Job | None = None) -> Job:
        """The job of a compressed reduce-scatter of flat ``source`` (``size`` rows of
        ``output.numel()``) into ``output`` (``exact``, ``wants``, ``ticket``, ``leased``: see
        `all_reduce`)."""

        def run(src: Source, comp: CallCompressor, route: Route) -> None:
            reduced = schedules.reduce_scatter(self._schedule(src, route), src, comp, route.links,
                                               self._chunk(route, src.m))
            output.copy_(reduced.view(output.shape))

        def deliver(reduced: torch.Tensor) -> None:
            output.copy_(reduced.view(self.size, -1)[self.rank].view(output.shape))

        return self._job("reduce_scatter", source, op, run, deliver, exact, wants, ticket,
                         leased)

    def all_gather(self, output: torch.Tensor, source: torch.Tensor, exact: Job,
                   wants: bool = True) -> Job:
        """The job of an all-gather of flat ``source`` (``m`` elements per rank) into
        ``output`` (``size * m`` elements, same dtype) as ``config.param_bits``-bit codes (the
        parameter all-gathers of FSDP and ZeRO-3: `LocoConfig.param_bits`).

        No error feedback (parameters are not accumulated) and nearest rounding: every rank
        decodes the same messages with the same arithmetic, so ``output`` is bitwise the same
        on every rank, its own slot included; ``source`` is not modified. Ranks exchange
        descriptors first (``config.check``) and gather exact unless every rank would compress
        (``wants``: this rank's policy allows it; ``exact``: the fallback)."""
        cfg = self.config
        numel = source.numel()
        seq = self._next_seq()
        route = self.route(source.device)
        desc = wire.CallDescriptor(
            collective="all_gather", dtype=source.dtype, op=0, numel=numel, seq=seq,
            bits=cfg.param_bits, group_size=cfg.group_for("int"), compressed=wants,
            parent=callback_parent())

        def job() -> Any:
            try:
                agreed = not cfg.check or self._agree(desc).compressed
            except CorruptFrameError as exc:
                return self._then_raise(exc, exact)
            if not agreed:
                return exact()
            n = self.size
            itemsize = source.element_size()
            state.STATS.add("compressed", calls=1, tensor_bytes=numel * itemsize,
                            logical_bytes=COLLECTIVES["all_gather"].logical_bytes(
                                n * numel * itemsize, n))
            start = time.perf_counter()
            codec = ShardCodec(
                bits=cfg.param_bits, group_size=cfg.group_for("int"),
                dtype_code=wire.DTYPE_CODES[source.dtype], seq=seq, world=n,
                signature=wire.call_signature("all_gather", numel, source.dtype),
                kernels=route.kernels, checksum=cfg.checksum_for(source.device.type))
            flat = source.detach().reshape(-1).contiguous()
            mine = codec.encode(flat, 1, numel, 1.0, None, 0.0, [self.rank], None).messages
            encoded = time.perf_counter()
            gathered = route.links.world.all_gather(mine.view(-1))
            decoding = time.perf_counter()
            out = output.view(-1) if output.is_contiguous() else torch.empty_like(output).view(-1)
            codec.decode_into(gathered, numel, list(range(n)), out)
            if out.data_ptr() != output.data_ptr():
                output.copy_(out.view(output.shape))
            state.STATS.add("compressed", codec_s=encoded - start
                            + time.perf_counter() - decoding)
            return None

        return job

    def _job(self, collective: str, source: torch.Tensor, op: Any,
             run: Callable[[Source, CallCompressor, Route], None],
             deliver: Callable[[torch.Tensor], None], exact: Job, wants: bool,
             ticket: Ticket | None, leased: Job | None) -> Job:
        """The worker job of one reduction of ``source`` (``run``: its compressed schedule;
        ``deliver(reduced)``: writes the reduction of every rank's whole ``source``, flat, to
        the call's output, for calls that travel in the descriptor frame; ``exact``: the
        fallback; ``wants``: whether this rank would compress it; ``ticket``, ``leased``: see
        `all_reduce`)."""
        cfg = self.config
        numel = source.numel()
        seq = self._next_seq()
        key, derived = self.key(collective, source, numel) if wants else ("", False)
        # a derived key's layout is checked by the buffer it reduces; an explicit one is trusted
        buffer = StorageWeakRef(source.untyped_storage()) if derived else None
        route = self.route(source.device)
        itemsize = source.element_size()
        leasable = self._leasable(numel)
        modelled = leasable and not policy.forced()
        device = source.device.type
        nbytes = numel * itemsize
        framed = (cfg.check and not route.inline and nbytes <= wire.FRAME_PAYLOAD
                  and source.layout == torch.strided
                  and reduces_in_rank_order(op, source.dtype))
        desc = wire.CallDescriptor(
            collective=collective, dtype=source.dtype, op=int(op_type(op)), numel=numel, seq=seq,
            bits=cfg.bits, group_size=cfg.wire_group_size,
            compressed=wants and numel >= cfg.min_size, fmt=cfg.wire_format, framed=framed,
            parent=callback_parent(),
        )
        reduction = Reduction.of(op, self.size)
        factor = reduction.input_factor()
        if leasable and ticket is None:
            ticket = self.leases.begin(CostModel.size_class(collective, nbytes, device), now=False)

        def job() -> Any:
            try:
                return decide_and_run()
            finally:
                if ticket is not None:
                    ticket.settle()

        def decide_and_run() -> Any:
            suggestion = None
            if ticket is not None:
                if route.inline:
                    self._stream_timings.harvest(self.cost_model)
                if ticket.take():
                    return self._timed_exact(leased or exact, route, ticket.size_class, nbytes)
                if modelled:
                    suggestion = self.cost_model.suggest(collective, nbytes, device)
            call = desc if suggestion is None else dataclasses.replace(
                desc, prefer_exact=suggestion.exact, lease=suggestion.lease)
            leader, inputs = call, None
            if cfg.check and route.inline and self._on_worker is not None:
                agreed: list[wire.CallDescriptor] = []
                self._on_worker(lambda: agreed.append(self._agree(call)))
                leader = agreed[0]
            elif cfg.check:
                mine = reduction.scaled(source.detach().reshape(-1)) if framed else None
                try:
                    leader, inputs = self._exchange(call, mine)
                except CorruptFrameError as exc:
                    return self._then_raise(exc, exact)
            if not leader.compressed:  # some rank would not compress it (or it is too small)
                if inputs is None:
                    return exact()
                count_exact(collective, nbytes, self.size)
                rows = [inputs[r, :nbytes].clone().view(source.dtype) for r in range(self.size)]
                deliver(reduce_in_rank_order(rows, op, self.size))
                return None
            if suggestion is not None and leader.prefer_exact:
                state.STATS.add("exact", model_exact=1)
                if leader.lease and ticket is not None:  # rank 0's: every rank holds it
                    ticket.settle(leader.lease)
                return self._timed_exact(exact, route, suggestion.size_class, nbytes)
            if ticket is not None:  # decided: later calls need not wait for the schedule
                ticket.settle()
            stop = None if suggestion is None else self.clock(route, suggestion.size_class,
                                                               False, nbytes)
            n = self.size
            m = -(-numel // n)
            state.STATS.add("compressed", calls=1, tensor_bytes=numel * itemsize,
                            logical_bytes=COLLECTIVES[collective].logical_bytes(
                                n * m * itemsize, n))
            codec = ShardCodec(
                bits=cfg.bits, group_size=cfg.wire_group_size,
                dtype_code=wire.DTYPE_CODES[source.dtype], seq=seq, world=n,
                signature=wire.call_signature(collective, numel, source.dtype),
                kernels=route.kernels, rounding=cfg.rounding, seed=cfg.seed,
                checksum=cfg.checksum_for(device), fmt=cfg.wire_format,
            )
            comp = CallCompressor(
                codec, state.FEEDBACK, key, state.STATS,
                error_dtype=cfg.error_dtype if cfg.feedback else None, beta=cfg.beta,
                reset_interval=cfg.reset_interval, rank=self.rank,
                scratch=None if route.inline else self._scratch, buffer=buffer,
            )
            flat = source.detach().reshape(-1).contiguous()
            run(Source(flat, n, m, factor), comp, route)
            comp.finish()
            comp.raise_deferred()
            if stop is not None:
                stop()
            return None

        return job

    def clock(self, route: Route, size_class: SizeClass, exact: bool,
               nbytes: int) -> Callable[[], None]:
        """Start timing a call of ``size_class`` on one path; the returned function ends it,
        and its time goes to the cost model: wall time on the worker, or for ``route.inline``
        (CUDA) GPU time on the current stream, reported once the GPU has passed it."""
        if route.inline:
            timings = self._stream_timings
            begun = timings.start()
            return lambda: timings.stop(begun, size_class, exact, nbytes)
        start = time.perf_counter()
        return lambda: self.cost_model.record(size_class, exact, time.perf_counter() - start,
                                              nbytes)

    def _timed_exact(self, exact: Job, route: Route, size_class: SizeClass, nbytes: int) -> Any:
        """Start ``exact``; its time, until the inner work completes, goes to the cost model."""
        stop = self.clock(route, size_class, True, nbytes)
        result = exact()
        if not isinstance(result, InnerWork):
            stop()
            return result
        finish = result.finish

        def timed_finish() -> list[torch.Tensor]:
            stop()
            return finish()

        return InnerWork(result.work, timed_finish)

    # -- on the worker -------------------------------------------------------------------------
    def _agree(self, desc: wire.CallDescriptor) -> wire.CallDescriptor:
        """`_exchange` without an input: rank 0's descriptor, as agreed."""
        return self._exchange(desc)[0]

    def _exchange(self, desc: wire.CallDescriptor, own: torch.Tensor | None = None
                  ) -> tuple[wire.CallDescriptor, torch.Tensor | None]:
        """All-gather one `wire.FRAME_BYTES` frame per rank (`wire.FRAME_COPIES` times over):
        ``desc``, then ``own`` (this rank's contribution to a reduction of at most
        `wire.FRAME_PAYLOAD` bytes, flat). A frame counts as intact if one of its copies passes
        its check (a warning names a corrected one). Raises `CollectiveMismatchError` on every
        rank if the calls differ, and `CorruptFrameError` on a rank that received a frame none
        of whose copies passes (the intact frames are compared first). Returns rank 0's
        descriptor (whose advisory fields every rank follows), marked compressed only if every
        rank's is, and with ``own`` every rank's frame after the descriptor (uint8, one row per
        rank: the first ``own``'s bytes of each are that rank's contribution; the descriptors
        agreeing, the dtypes and sizes do)."""
        frame = np.zeros((wire.FRAME_COPIES, wire.FRAME_BYTES), dtype=np.uint8)
        frame[0, :wire.DESCRIPTOR_BYTES] = np.frombuffer(desc.pack(), dtype=np.uint8)
        if own is not None:
            raw = own.contiguous().view(-1).view(torch.uint8).numpy()
            frame[0, wire.DESCRIPTOR_BYTES:wire.DESCRIPTOR_BYTES + raw.size] = raw
        frame[0, -wire.FRAME_CHECK_BYTES:] = wire.frame_checks(frame[:1]).view(np.uint8)
        frame[1:] = frame[0]
        gathered = self._agreement.all_gather(torch.from_numpy(frame.reshape(-1)))
        rows, intact, corrected = wire.pick_frames(gathered.numpy())
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
        if ((head == head[:1]).all() and (parent == parent[:1]).all()
                and (flags & wire.DESC_FRAMED == flags[:1] & wire.DESC_FRAMED).all()):
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
    def _then_raise(error: CorruptFrameError, start: Job) -> Any:
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

    def _chunk(self, route: Route, m: int) -> int:
        """The chunk width for rows of ``m`` elements: ``chunk_size``, widened to a
        ``max_chunks``-th of the row where that is wider (0 for ``route.inline``: no chunks)."""
        if route.inline:
            return 0
        return chunk_width(m, self.config.chunk_size, self.config.max_chunks)

    def _schedule(self, source: Source, route: Route) -> str:
        nbytes = source.tensor.numel() * source.tensor.element_size()
        name = choose_schedule(self.config, nbytes, self.size, route.links.layout)
        if route.schedules is None or name in route.schedules:
            return name
        if self.config.schedule == "auto":
            return route.schedules[0]
        raise ValueError(
            f"lowbitcc: LOCO_SCHEDULE={name} cannot run on {source.tensor.device.type} tensors; "
            f"their transport runs {', '.join(route.schedules)} (or auto)")
