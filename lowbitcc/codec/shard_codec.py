"""Shard codec: LoCo-compensated quantization of shards into wire messages, and back.

A *shard source* is a flat tensor of ``numel`` elements (fp32, bf16 or fp16) seen as ``rows``
rows of ``m`` elements: row ``r`` holds elements ``r*m .. r*m+m-1``, indices past ``numel`` read
as zero, and every element is multiplied by ``factor`` (fp32) first. Row ``j`` is destined for
rank ``j`` in a reduce-scatter; an all-gather stage encodes a single row. Each row is quantized
on its own in groups of ``G`` (its last group zero-padded), so no group straddles rows. The
error state of a source is an `ErrorState` of ``rows * mp`` elements, ``mp = ceil(m / G) * G``.

Messages are ``uint8 [rows, P]`` with ``P = wire.payload_bytes(m, bits, G, fmt)``; the caller owns
every returned tensor. `ShardCodec` frames and validates messages (headers, sizes, padding) and
leaves the arithmetic to its `kernels.Kernels` (reference, C++ or CUDA, chosen once by the
caller with `kernels.select`); every implementation produces the same bytes.

Host synchronisation: on CPU tensors everything is read on the host. On CUDA tensors nothing
is: the non-finite flags and the residual sums stay on the device (`EncodeResult` holds them as
tensors; its host properties synchronise), headers go up through pinned memory, and `check`
compares received headers with the expected ones on the device: a message that does not
belong to the call turns the decoded values into NaN and flags the call non-finite instead of
raising (`check_on_host` gives the exception, at the cost of a synchronisation).
"""

from __future__ import annotations

import dataclasses

import torch

from lowbitcc.codec import framing, reference, wire
from lowbitcc.codec.error_state import ErrorState
from lowbitcc.codec.interface import (
    CallCount,
    EncodeArgs,
    Flag,
    FrameSpec,
    Kernels,
    SumSpec,
    unfused,
)
from lowbitcc.codec.kernels import REFERENCE
from lowbitcc.codec.shard_decode import ShardDecodes

__all__ = ["EncodeResult", "Flag", "ShardCodec"]


@dataclasses.dataclass
class EncodeResult:
    """What one `ShardCodec.encode` produced.

    ``messages`` is ``uint8 [rows, P]``; ``error`` the new error state (None when feedback is
    off); ``any_nonfinite`` whether a row is flagged non-finite (a 0-dim bool tensor on a GPU)
    and ``sums`` float64 ``[2]`` (the squared L2 norms of the quantization residual and of the
    compensated input over finite groups, for statistics) stay on the source's device. The
    properties read them on the host.
    """

    messages: torch.Tensor
    error: ErrorState | None
    any_nonfinite: Flag
    sums: torch.Tensor

    @property
    def nonfinite(self) -> list[bool]:
        """Each row's non-finite flag, as its header carries it."""
        return ((self.messages[:, wire.FLAGS_OFFSET] & wire.FLAG_NONFINITE) != 0).tolist()

    @property
    def residual_sq(self) -> float:
        return float(self.sums[0])

    @property
    def input_sq(self) -> float:
        return float(self.sums[1])


@dataclasses.dataclass(frozen=True)
class ShardCodec(ShardDecodes):
    """Encode and decode shard messages for one call: ``bits``, group size, code format, header
    fields, and the ``kernels`` that do the arithmetic (for tensors on their device)."""

    bits: int
    group_size: int
    dtype_code: int
    seq: int
    world: int
    signature: int
    kernels: Kernels = REFERENCE
    rounding: str = "nearest"
    seed: int = 0
    checksum: bool = True
    """Write each message's checksum trailer and verify it on receipt (`wire`); False writes
    zeros there and checks nothing (every rank of a call must agree)."""
    fmt: str = "int"
    """The code format (`wire.FORMATS`): "int" codes with fp32 scales, "mxfp4", "nvfp4", or the
    3-bit "nvint3" and "nvfp3"."""
    host_check: bool = False
    """Check CUDA messages on the host too (`check_on_host`: a synchronisation, and errors
    raised rather than turned into NaN), as CPU messages always are."""
    count: CallCount | None = None
    """The call place's counter on the device (`interface.CallCount`), handed to the kernels'
    fused launches (the decode into the output is the call's last); None: none kept."""

    def __post_init__(self) -> None:
        if self.rounding not in reference.ROUNDINGS:
            raise ValueError(f"rounding must be one of {reference.ROUNDINGS}, got {self.rounding!r}")
        reference.check_format(self.fmt, self.bits, self.rounding == "stochastic", self.group_size)

    def with_seq(self, seq: int, count: CallCount | None = None) -> ShardCodec:
        """This codec for another call number and ``count`` (its fields are already checked)."""
        other = object.__new__(ShardCodec)
        other.__dict__.update(self.__dict__)
        other.__dict__["seq"] = seq
        other.__dict__["count"] = count
        return other

    def renumber(self, seq: int) -> None:
        """Give this codec call number ``seq`` in place: only for a copy its holder owns and
        lends to one call at a time (a CPU call place's, `backend.call_plan.CallPlan`), where
        `with_seq` would make a new one per call."""
        self.__dict__["seq"] = seq

    def keys(self, stream: int) -> tuple[int, int] | None:
        """Random-stream keys of an encode by ``stream`` in this call (None: nearest rounding)."""
        if self.rounding == "nearest":
            return None
        return reference.stream_keys(self.seed, self.seq, stream)

    def padded(self, m: int) -> int:
        return wire.ngroups(m, self.group_size) * self.group_size

    def message_bytes(self, m: int) -> int:
        return wire.payload_bytes(m, self.bits, self.group_size, self.fmt)

    # -- encode ---------------------------------------------------------------------------------
    def encode(
        self,
        source: torch.Tensor,
        rows: int,
        m: int,
        factor: float,
        error: ErrorState | None,
        beta: float,
        shard_ids: list[int],
        error_dtype: str | None,
        stream: int = 0,
        out: torch.Tensor | None = None,
        sums: torch.Tensor | None = None,
        verdict: torch.Tensor | None = None,
        clear_verdict: bool = False,
        nonfinite: torch.Tensor | None = None,
        summed: SumSpec | None = None,
    ) -> EncodeResult:
        """Compensate, quantize and frame ``rows`` rows of ``m`` elements of flat ``source``.

        ``error`` is the state to apply (None: zero); ``error_dtype`` the storage of the new
        state (None: feedback off, no state kept). ``error`` is consumed: the kernels update it
        in place. ``shard_ids[i]`` is the shard index written into row ``i``'s header. ``stream``
        selects the random bits of stochastic rounding: encodes of one call that must draw
        independent bits (other ranks, other stages) pass different streams. ``out`` (uint8
        ``[rows, message_bytes(m)]``, contiguous, on the source's device), when given, receives
        the messages: every byte of it is written. ``sums`` (float64 ``[2]`` on the source's
        device), when given, receives this encode's residual and input squares added to what it
        holds (and is the result's ``sums``); otherwise a new zeroed one does. ``verdict``:
        the call's, on a device (`interface.Kernels.frame`); ``clear_verdict``: this encode
        zeroes it first (the call's first encode, its verdict made with ``cleared_by_encode``).
        ``nonfinite`` (uint8 ``[rows * ngroups(m)]``, contiguous, on the source's device), when
        given, receives the groups' non-finite bytes instead of a new buffer. ``summed``
        (from `sum_spec`; ``rows`` 1, ``factor`` 1, not ``clear_verdict``: the check of the
        received rows sets the verdict the first encode would clear): the one row is the sum of
        received messages, decoded by the encode itself; ``source`` (fp32 ``[m]``) is then not
        read.
        """
        if source.dim() != 1 or not source.is_contiguous():
            raise ValueError("ShardCodec.encode needs a flat contiguous source")
        if summed is not None and (rows != 1 or factor != 1.0 or source.numel() != m
                                   or source.dtype != torch.float32 or clear_verdict):
            raise ValueError("ShardCodec.encode: a sum is encoded as one fp32 row of m elements, "
                             f"not as the call's first encode; got {rows} rows, factor "
                             f"{factor}, {source.dtype} [{source.numel()}], clear_verdict "
                             f"{clear_verdict}")
        device = source.device
        if error is not None and (error.dtype != error_dtype or error.numel != rows * self.padded(m)
                                  or error.device != device):
            error = None
        shape = (rows, self.message_bytes(m))
        if out is None:
            alloc = torch.empty if self.kernels.writes_every_byte else torch.zeros
            messages = alloc(shape, dtype=torch.uint8, device=device)
        elif (tuple(out.shape) != shape or out.dtype != torch.uint8 or not out.is_contiguous()
              or out.device != device):
            raise ValueError(f"ShardCodec.encode: out must be a contiguous uint8 tensor of shape "
                             f"{shape} on {device}, got {out.dtype} {tuple(out.shape)} on "
                             f"{out.device}")
        else:
            messages = out if self.kernels.writes_every_byte else out.zero_()
        reads_poison = getattr(self.kernels, "reads_poison", False)
        if error is not None and not reads_poison:
            error.settle()
        state = error
        if error is not None and device.type == "cuda":
            # the kernel reads and updates it on this stream; it may come from another's call
            error.record_stream(torch.cuda.current_stream(device))
        if state is None and error_dtype:
            state = ErrorState.zeros(rows * self.padded(m), error_dtype, self.group_size, device)
        ng = wire.ngroups(m, self.group_size)
        args = EncodeArgs(
            source=source, rows=rows, m=m, factor=float(factor), messages=messages, state=state,
            has_error=error is not None, beta=float(beta), bits=self.bits,
            group_size=self.group_size,
            keys=None if self.rounding == "nearest" else self.keys(stream),
            nonfinite=self._flags(nonfinite, rows * ng, device),
            sums=torch.zeros(2, dtype=torch.float64, device=device) if sums is None else sums,
            threads=torch.get_num_threads(), fmt=self.fmt,
            clear=verdict if clear_verdict else None,
            frame=self._fused_frame(m, shard_ids, verdict, device), summed=summed,
        )
        self.kernels.encode(args)
        if state is not None:
            state.poison = None  # the encode read it (or it was settled); the values are new
        if args.frame is not None:
            nonfinite = framing.verdict_flag(verdict, framing.VERDICT_NONFINITE)
        else:
            nonfinite = self.kernels.frame(
                messages, self.header(m), shard_ids, args.nonfinite,
                wire.used_bytes(m, self.bits, self.group_size, self.fmt), 0, self.checksum,
                verdict)
        return EncodeResult(messages, state, nonfinite, args.sums)

    @staticmethod
    def _flags(given: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
        if given is not None and (given.numel() != n or given.dtype != torch.uint8
                                  or not given.is_contiguous() or given.device != device):
            raise ValueError(f"ShardCodec.encode: nonfinite must be {n} contiguous uint8 on "
                             f"{device}, got {given.dtype} {tuple(given.shape)} on {given.device}")
        return torch.empty(n, dtype=torch.uint8, device=device) if given is None else given.view(-1)

    def _fused_frame(self, m: int, shard_ids: list[int], verdict: torch.Tensor | None,
                     device: torch.device) -> FrameSpec | None:
        """What the encode frames itself where the kernels can (``fuses_frame``: a device, the
        call's ``verdict``, checksums off), else None (`Kernels.frame` after the encode)."""
        if (verdict is None or self.checksum or device.type == "cpu"
                or not getattr(self.kernels, "fuses_frame", False)):
            if self.count is not None:
                unfused(self.count, "frame")
            return None
        return FrameSpec(self.header(m), shard_ids,
                         wire.used_bytes(m, self.bits, self.group_size, self.fmt), 0, verdict,
                         self.count)

    def header(self, m: int) -> bytes:
        """The header of this call's messages of ``m`` elements, with shard 0 and flags 0 (the
        kernels write each row's own: `interface.Kernels.frame`); the last one made is kept
        (a call frames and checks the same header several times)."""
        seq, kept = self.seq, self.__dict__.get("_header")
        if kept is not None and kept[0] == seq and kept[1] == m:
            return kept[2]
        header = framing.call_header(self.bits, self.dtype_code, self.group_size, m, seq,
                                     self.world, self.signature, self.fmt)
        self.__dict__["_header"] = (seq, m, header)
        return header

    def sum_spec(self, messages: torch.Tensor, m: int, shard: int,
                 verdict: torch.Tensor | None) -> SumSpec | None:
        """Where the kernels can encode the fp32 sum of received ``messages`` (uint8
        ``[k, P]`` of ``shard``, rows contiguous) decoding them in the encode (``fuses_sum``;
        ``m`` > 0; the call's ``verdict``, and the rows checked by the decode as `decode_sum`
        would: `_fused_check`, which checks their sizes, raising `wire.WireFormatError`): what
        `encode` takes as ``summed``; else None (`decode_sum`, then `encode`)."""
        if m == 0 or not getattr(self.kernels, "fuses_sum", False):
            if self.count is not None:
                unfused(self.count, "sum")
            return None
        fused = self._fused_check(messages, m, [shard] * messages.shape[0], verdict)
        if fused is None or verdict is None:
            if self.count is not None:
                unfused(self.count, "sum")
            return None
        return SumSpec(messages, fused[0], verdict, self.count)
