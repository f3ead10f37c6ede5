"""`CallCompressor`: what a schedule needs to compress one call, bound to that call.

A schedule sees only these operations, on shard sources (see `lowbitcc.codec.shard_codec`):
``encode(stage, source, shard_ids)`` compensates the source with the error state of
``(key, stage)``, quantizes and frames it; ``decode_sum``, ``decode_rows`` and ``decode_into``
validate and decode received messages (``encode_sum`` decodes, sums and encodes again);
``scratch`` lends a reusable fp32 buffer and ``received`` the buffer a transfer receives into.
New error states are kept until `finish`, which stores them, or drops every stage's state if
anything in the call was non-finite. Error state, statistics and the codec stay out of the
schedule; so do the buffers (`Buffers`): a call place that runs the same call again and again
(`lowbitcc.backend.call_plan.CallPlan`) keeps every buffer its schedule uses, and its steady
call allocates nothing.

A received message that fails validation (`wire.WireFormatError`: corrupt, truncated, or of
another call) does not stop the schedule: the decode that met it yields NaN, the error is kept,
every message this rank encodes afterwards in the call carries `wire.FLAG_PEER_ERROR` (so the
ranks that receive them fail their decode in turn; not after a decode whose values nothing this
rank sends depends on, a call's last decodes: ``final``), and `raise_deferred` raises it
once the schedule has finished. So every rank completes the same
transfers, the group stays in step for its next call, and each rank that received a bad
message, or a message built from one, raises.

On CUDA tensors nothing here reads the GPU from the host: the call's non-finite flag stays a
0-dim device tensor, the encodes add their residual sums into the statistics' accumulator
(`Stats.accumulator`, as on the CPU), and `finish` stores the new error states with the call's
verdict as their poison word (`ErrorState.poison`: where the call was non-finite or met a
foreign message the state counts as zero, which compensates exactly like a dropped one)
instead of dropping them, so a call is enqueued without waiting for the GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import zlib

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from lowbitcc.buffers import Buffers
from lowbitcc.codec import framing, wire
from lowbitcc.codec.error_state import ErrorState
from lowbitcc.codec.interface import SumSpec
from lowbitcc.codec.shard_codec import Flag, ShardCodec
from lowbitcc.counters import Stats
from lowbitcc.feedback import FeedbackStore


def mark_deviated(messages: torch.Tensor, signature: int) -> None:
    """Flag ``messages`` (uint8 ``[rows, P]``) `wire.FLAG_DEVIATED`, naming ``signature``."""
    messages[:, wire.FLAGS_OFFSET] |= wire.FLAG_DEVIATED
    named = torch.tensor(list(signature.to_bytes(4, "little")), dtype=torch.uint8)
    messages[:, wire.SIGNATURE_OFFSET:wire.SIGNATURE_OFFSET + 4] = named.to(messages.device)


@dataclasses.dataclass(slots=True)
class Source:
    """``rows`` rows of ``m`` elements of flat ``tensor`` (zero past its end), times ``factor``."""

    tensor: torch.Tensor
    rows: int
    m: int
    factor: float = 1.0


class CallCompressor:
    """Codec + error feedback + statistics for the call keyed ``key``, on rank ``rank``.

    ``error_dtype`` is the error-state storage ("int8", "bf16", "fp32"; None: no feedback),
    ``beta`` LoCo's moving-average factor, ``reset_interval`` the uses after which a key's state
    starts anew (0: never), ``buffer`` the storage the call reduces (None: not tracked; how
    the store detects a changed layout); see `lowbitcc.feedback`.
    """

    def __init__(
        self, codec: ShardCodec, store: FeedbackStore, key: str, stats: Stats, *,
        error_dtype: str | None, beta: float, reset_interval: int, rank: int = 0,
        scratch: Buffers | None = None, buffer: StorageWeakRef | None = None,
        count_sums: bool = True,
    ) -> None:
        self.rank = rank
        self.count_sums = count_sums
        """Whether the encodes add their residual sums to ``stats`` (`Stats.accumulator`)."""
        self._sums: torch.Tensor | None = None  # `_accumulator`'s, and for which stats
        self._sums_of: Stats | None = None
        self._buffers = scratch
        self.error_dtype = error_dtype
        self.beta = beta
        self.reset_interval = reset_interval
        self.store = store
        self.stats = stats
        self._new_states: dict[str, tuple[ErrorState | None, int]] = {}
        self._foreign_flags: tuple[tuple[torch.Tensor, torch.Tensor] | None, ...] = (None, None)
        """`foreign`'s last two answers, by the verdict they view."""
        self.restart(codec, key, buffer)

    def restart(self, codec: ShardCodec, key: str, buffer: StorageWeakRef | None,
                verdict: torch.Tensor | None = None) -> None:
        """Bind this compressor to a new call (``codec`` with its call number, ``key``,
        ``buffer``), forgetting the last one's flags, errors and sums: a call place's
        `call_plan.CallPlan` keeps one compressor for every call it runs. The last call must
        have finished (`finish`). ``verdict``: device memory for the call's verdict (uint8
        ``[8]``, any content: the call's first encode zeroes it, or its first decode if none
        encodes first) that the caller owns and hands to no other call while this call's
        verdict may still be read (`call_plan.CallPlan`'s two slots); None: the call makes its
        own where it runs on a device."""
        self.codec = codec
        self.key = key
        self.buffer = buffer
        self.nonfinite: Flag = False
        self._codec_s = 0.0  # the call's codec seconds, added to the statistics by `finish`
        self._new_states.clear()
        self.wire_error: wire.WireFormatError | None = None
        self._verdict: torch.Tensor | None = verdict
        """The call's verdict on its device (`framing.new_verdict`), made by its first encode
        or decode of device tensors where the caller gave none: the kernels set its bytes, so
        the call's flags cost no launch of their own."""
        self._verdict_unset = verdict is not None  # given, and not yet zeroed by this call
        self.tainted = False
        """A decode whose values this rank sends on met a foreign message: every encode of the
        call after it flags its messages `wire.FLAG_PEER_ERROR`."""
        self.final = False
        """Set by a schedule around decodes whose values nothing this rank sends later in the
        call depends on (the direct schedule's: a reduce-scatter's, the all-reduce's last phase,
        the two ranks' all-gather), and cleared after them: a foreign message they meet is
        raised at the end as any other, but does not make the call ``tainted`` (no receiver's
        result depends on it; a call place's C++ core decodes them on gloo's threads, after or
        beside later encodes, and flags none either). An attribute, not a context manager: the
        CUDA branch's steady run counts its host calls."""
        self.deviated: int | None = None
        """The `wire.call_signature` of this rank's own call where this compressor runs another
        (the agreed one) in its place (`lowbitcc.backend.call_schedule`): every message it
        encodes is flagged `wire.FLAG_DEVIATED` and names the rank's own call."""

    def encode(self, stage: str, source: Source, shard_ids: list[int],
               out: torch.Tensor | None = None, nonfinite: torch.Tensor | None = None,
               summed: SumSpec | None = None) -> torch.Tensor:
        """Messages ``uint8 [rows, P]`` for the rows of ``source`` (in ``out`` where given, and
        the groups' non-finite bytes in ``nonfinite``, else in the buffers the compressor keeps
        for ``stage`` where it keeps them, `Buffers.messages`; ``summed``: `encode_sum`'s; all
        three `ShardCodec.encode`'s)."""
        start = time.perf_counter()
        if out is None and self._buffers is not None and self._buffers.keeps_messages:
            out, nonfinite = self._buffers.messages(stage, source.rows, source.m, self.codec,
                                                    source.tensor.device)
        error_dtype = self.error_dtype
        key, state, uses = "", None, 0
        if error_dtype:
            key = f"{self.key}|{stage}"
            numel = source.rows * self.codec.padded(source.m)
            state, uses = self.store.take(key, numel, error_dtype, self.reset_interval,
                                          source.tensor.device, self.codec.group_size,
                                          self.buffer)
        stream = _random_stream(stage, self.rank)
        device = source.tensor.device
        on_device = device.type != "cpu"
        first = on_device and (self._verdict is None or self._verdict_unset)
        result = self.codec.encode(
            source.tensor, source.rows, source.m, source.factor, state, self.beta, shard_ids,
            error_dtype, stream, out,
            sums=self._accumulator(device) if self.count_sums else None,
            verdict=self._device_verdict(device, cleared_by_encode=first) if on_device else None,
            clear_verdict=first, nonfinite=nonfinite, summed=summed,
        )
        self._flag(result.any_nonfinite)
        if error_dtype:
            self._new_states[key] = (result.error, uses + 1)
        if self.tainted:
            result.messages[:, wire.FLAGS_OFFSET] |= wire.FLAG_PEER_ERROR
        if self.deviated is not None:
            mark_deviated(result.messages, self.deviated)
        self._codec_s += time.perf_counter() - start
        return result.messages

    def _accumulator(self, device: torch.device) -> torch.Tensor:
        """The statistics' accumulator of the residual sums on ``device`` (`Stats.accumulator`;
        this thread's on the CPU: a compressor is used by one thread), kept while ``stats``
        stays the same."""
        sums, stats = self._sums, self.stats
        if sums is None or self._sums_of is not stats or sums.device != device:
            sums = self._sums = stats.accumulator("compressed", device)
            self._sums_of = stats
        return sums

    def encode_sum(self, stage: str, received: torch.Tensor, m: int, shard: int,
                   scratch: torch.Tensor, out: torch.Tensor | None = None,
                   nonfinite: torch.Tensor | None = None) -> torch.Tensor:
        """`encode` of ``stage``'s one row, ``shard``'s fp32 sum in rank order of ``received``
        (uint8 ``[k, P]``, the row's messages from every rank, rows contiguous): one launch
        where the codec's kernels decode the messages inside the encode (`ShardCodec.sum_spec`;
        ``scratch``, fp32 ``[m]``, is then not written), else `decode_sum` into ``scratch`` and
        `encode`. The same bytes, error states and flags either way."""
        verdict = self._device_verdict(received.device)
        summed = None
        if verdict is not None:
            try:
                summed = self.codec.sum_spec(received, m, shard, verdict)
            except wire.WireFormatError:  # `decode_sum` meets it again, and defers it
                summed = None
        if summed is None:
            reduced = self.decode_sum(received, m, shard, scratch)
            return self.encode(stage, Source(reduced, 1, m), [shard], out, nonfinite)
        return self.encode(stage, Source(scratch, 1, m), [shard], out, nonfinite, summed)

    def _flag(self, nonfinite: Flag) -> None:
        """OR a host ``nonfinite`` into the call's flag (a device flag is already in the call's
        verdict)."""
        if isinstance(nonfinite, torch.Tensor):
            if nonfinite.device.type != "cpu":
                return
            nonfinite = bool(nonfinite)
        self.nonfinite = self.nonfinite or nonfinite

    def _device_verdict(self, device: torch.device,
                        cleared_by_encode: bool = False) -> torch.Tensor | None:
        """The call's verdict where ``device`` is not the CPU (made on first use: by an encode,
        which then zeroes it, ``cleared_by_encode``; else zero-filled), else None."""
        if device.type == "cpu":
            return None
        if self._verdict is None:
            self._verdict = framing.new_verdict(device, cleared_by_encode)
        elif self._verdict_unset and not cleared_by_encode:
            self._verdict.zero_()  # a given verdict that no encode of the call has cleared
        self._verdict_unset = False
        return self._verdict

    def rebind(self) -> None:
        """`restart` with this call's codec, key, buffer and given verdict again: forget what
        launches that never ran did here (a graph's capture that failed, `backend.place_graph`;
        its first encode took the verdict as cleared)."""
        self.restart(self.codec, self.key, self.buffer, self._verdict)

    def replayed(self) -> None:
        """The call's launches ran in a replayed graph (`backend.place_graph`), whose first
        encode cleared the call's verdict and whose checks set it: nothing is left to clear."""
        self._verdict_unset = False

    def foreign(self) -> torch.Tensor | None:
        """Calls on a device: a 0-dim bool device tensor (a view of the call's verdict), set
        where a message of this call did not belong to it (another rank deviated, or it
        arrived corrupt; its values decoded as NaN); None for calls on the CPU."""
        verdict = self._verdict
        if verdict is None:
            return None
        if self._verdict_unset:
            self._device_verdict(verdict.device)
        flags = self._foreign_flags  # (a plan hands its runs two words in turn)
        if flags[0] is not None and flags[0][0] is verdict:
            return flags[0][1]
        if flags[1] is not None and flags[1][0] is verdict:
            return flags[1][1]
        flag = framing.verdict_flag(verdict, framing.VERDICT_FOREIGN)
        self._foreign_flags = (flags[1], (verdict, flag))
        return flag

    def scratch(self, n: int, device: torch.device) -> torch.Tensor:
        """fp32 ``[n]`` to decode into, valid until the next `scratch` call of this group."""
        if self._buffers is None:
            return torch.empty(n, dtype=torch.float32, device=device)
        return self._buffers.fp32(n, device)

    def kept(self, name: str, numel: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        """``dtype [numel]`` for a schedule's own step ``name`` (its exact phases: values in
        fp32, sums, staging; not a codec's), any content: kept for the place's later runs where
        the compressor keeps buffers (a call plan's, `Buffers.get`), else new. Valid until the
        next request of ``name``."""
        if self._buffers is None:
            return torch.empty(numel, dtype=dtype, device=device)
        return self._buffers.get(name, numel, dtype, device)

    def received(self, name: str, numel: int, device: torch.device) -> torch.Tensor | None:
        """The uint8 ``[numel]`` buffer transfer ``name`` (a stage's) receives into, where the
        compressor's buffers keep messages (`Buffers.received`); else None (the transport
        makes one)."""
        if self._buffers is None:
            return None
        return self._buffers.received(name, numel, device)

    def decode_sum(self, messages: torch.Tensor, m: int, shard: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 ``[m]`` sum of the messages of ``shard``, in ``out`` when given (``messages``:
        rows contiguous, at any distance, e.g. a column of gathered messages)."""
        start = time.perf_counter()
        device = messages.device
        try:
            total, nonfinite = self.codec.decode_sum(
                messages, m, shard, out, None if device.type == "cpu" else
                self._device_verdict(device))
        except wire.WireFormatError as exc:
            total = out if out is not None else torch.empty(m, device=device)
            nonfinite = self._deferred(exc, total)
        self._flag(nonfinite)
        self._codec_s += time.perf_counter() - start
        return total

    def decode_rows(self, gathered: torch.Tensor, senders: int, m: int,
                    out: torch.Tensor) -> bool:
        """Every row's sum in rank order of the ``senders``' messages in ``gathered`` (uint8
        ``[senders * n, P]``, sender by sender), cast into flat ``out`` (row ``r`` at ``r * m``),
        in one launch where the codec's kernels can (`ShardCodec.decode_rows`): True; False
        where they cannot, nothing done (`decode_sum` row by row, which also defers a size
        that does not fit)."""
        if gathered.device.type == "cpu":  # (no verdict: the CPU checks every row on the host)
            return False
        start = time.perf_counter()
        verdict = self._device_verdict(gathered.device)
        if verdict is None:
            return False
        try:
            nonfinite = self.codec.decode_rows(gathered, senders, m, out, verdict)
        except wire.WireFormatError:
            return False
        if nonfinite is None:
            return False
        self._flag(nonfinite)
        self._codec_s += time.perf_counter() - start
        return True

    def decode_into(
        self, messages: torch.Tensor, m: int, shard_ids: list[int], out: torch.Tensor
    ) -> None:
        start = time.perf_counter()
        try:
            self._flag(self.codec.decode_into(messages, m, shard_ids, out,
                                              self._device_verdict(messages.device)))
        except wire.WireFormatError as exc:
            self._flag(self._deferred(exc, out))
        self._codec_s += time.perf_counter() - start

    def _deferred(self, exc: wire.WireFormatError, out: torch.Tensor) -> bool:
        """Keep the first ``exc`` for `raise_deferred`, fill ``out`` with NaN (the call's error
        states are then dropped); returns the non-finite flag."""
        if self.wire_error is None or (isinstance(self.wire_error, wire.PeerWireFormatError)
                                       and not isinstance(exc, wire.PeerWireFormatError)):
            self.wire_error = exc
        if not self.final:
            self.tainted = True
        out.fill_(float("nan"))
        return True

    def raise_deferred(self, mismatch: type[Exception] | None = None) -> None:
        """Raise the `wire.WireFormatError` a decode of this call met, naming this rank; a
        message of another rank's different call as ``mismatch`` where given (from the
        `wire.DeviatedCallError`)."""
        exc = self.wire_error
        if exc is None:
            return
        if isinstance(exc, wire.DeviatedCallError):
            deviated = wire.DeviatedCallError(f"lowbitcc: rank {self.rank}: {exc}", exc.signatures)
            if mismatch is None:
                raise deviated
            raise mismatch(f"{deviated}: another rank issued a different call here; every rank "
                           "raises") from deviated
        if isinstance(exc, wire.PeerWireFormatError):
            raise wire.PeerWireFormatError(
                f"lowbitcc: rank {self.rank}: another rank received a corrupt or foreign message "
                f"in this call, so this rank's result is incomplete ({exc}); the group stays "
                "usable") from exc
        raise wire.WireFormatError(
            f"lowbitcc: rank {self.rank} received a corrupt or foreign message in this call "
            f"({exc}); every rank that depends on it raises too, and the group stays usable"
        ) from exc

    def finish(self) -> None:
        """Store the new error states, or drop them all if the call saw a non-finite value or
        a foreign message (on a device, unless the host knows already: each state keeps the
        call's verdict as its ``poison`` word, which voids it where a byte is set; no work is
        queued); and add the call's codec time to the statistics."""
        if self._codec_s:
            self.stats.add_codec("compressed", self._codec_s)
            self._codec_s = 0.0
        bad = self.nonfinite
        for key, (state, uses) in self._new_states.items():
            if not bad and self._verdict is not None and state is not None:
                state.poison = self._verdict
            self.store.put(key, state, uses, bad)
        self._new_states.clear()


@functools.lru_cache(maxsize=256)
def _random_stream(stage: str, rank: int) -> int:
    """The random stream of ``rank``'s encodes of ``stage``: under stochastic rounding each rank
    and stage of a call draws its own random bits."""
    return zlib.crc32(f"{stage}|{rank}".encode())
