"""Shard codec: LoCo-compensated quantization of shards into wire messages, and back.

A *shard source* is a flat tensor of ``numel`` elements (fp32, bf16 or fp16) seen as ``rows``
rows of ``m`` elements: row ``r`` holds elements ``r*m .. r*m+m-1``, indices past ``numel`` read
as zero, and every element is multiplied by ``factor`` (fp32) first. Row ``j`` is destined for
rank ``j`` in a reduce-scatter; an all-gather stage encodes a single row. Each row is quantized
on its own in groups of ``G`` (its last group zero-padded), so no group straddles rows. The
error state of a source is an `ErrorState` of ``rows * mp`` elements, ``mp = ceil(m / G) * G``.

Messages are ``uint8 [rows, P]`` with ``P = wire.payload_bytes(m, bits, G)``; the caller owns
every returned tensor. `ShardCodec` frames and validates messages (headers, sizes, padding) and
leaves the arithmetic to its `kernels.Kernels` (reference, C++ or CUDA, chosen once by the
caller with `kernels.select`); every implementation produces the same bytes.
"""

from __future__ import annotations

import dataclasses

import torch

from lowbitcc.codec import reference, wire
from lowbitcc.codec.error_state import ErrorState
from lowbitcc.codec.interface import EncodeArgs, Kernels
from lowbitcc.codec.kernels import REFERENCE


@dataclasses.dataclass
class EncodeResult:
    """What one `ShardCodec.encode` produced.

    ``messages`` is ``uint8 [rows, P]``; ``error`` the new error state (None when feedback is
    off); ``nonfinite`` a bool per row; ``residual_sq`` / ``input_sq`` the squared L2 norms of the
    quantization residual and of the compensated input over finite groups (for statistics).
    """

    messages: torch.Tensor
    error: ErrorState | None
    nonfinite: list[bool]
    residual_sq: float
    input_sq: float


@dataclasses.dataclass(frozen=True)
class ShardCodec:
    """Encode and decode shard messages for one call: ``bits``, group size, header fields, and
    the ``kernels`` that do the arithmetic (for tensors on their device)."""

    bits: int
    group_size: int
    dtype_code: int
    seq: int
    world: int
    signature: int
    kernels: Kernels = REFERENCE
    rounding: str = "nearest"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rounding not in reference.ROUNDINGS:
            raise ValueError(f"rounding must be one of {reference.ROUNDINGS}, got {self.rounding!r}")

    def keys(self, stream: int) -> tuple[int, int] | None:
        """Random-stream keys of an encode by ``stream`` in this call (None: nearest rounding)."""
        if self.rounding == "nearest":
            return None
        return reference.stream_keys(self.seed, self.seq, stream)

    def padded(self, m: int) -> int:
        return wire.ngroups(m, self.group_size) * self.group_size

    def message_bytes(self, m: int) -> int:
        return wire.payload_bytes(m, self.bits, self.group_size)

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
    ) -> EncodeResult:
        """Compensate, quantize and frame ``rows`` rows of ``m`` elements of flat ``source``.

        ``error`` is the state to apply (None: zero); ``error_dtype`` the storage of the new
        state (None: feedback off, no state kept). ``error`` is consumed: the kernels update it
        in place. ``shard_ids[i]`` is the shard index written into row ``i``'s header. ``stream``
        selects the random bits of stochastic rounding: encodes of one call that must draw
        independent bits (other ranks, other stages) pass different streams. ``out`` (uint8
        ``[rows, message_bytes(m)]``, contiguous, on the source's device), when given, receives
        the messages: every byte of it is written.
        """
        if source.dim() != 1 or not source.is_contiguous():
            raise ValueError("ShardCodec.encode needs a flat contiguous source")
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
        messages[:, wire.used_bytes(m, self.bits, self.group_size):] = 0  # the row's padding
        state = error
        if state is None and error_dtype:
            state = ErrorState.zeros(rows * self.padded(m), error_dtype, self.group_size, device)
        ng = wire.ngroups(m, self.group_size)
        args = EncodeArgs(
            source=source, rows=rows, m=m, factor=float(factor), messages=messages, state=state,
            has_error=error is not None, beta=float(beta), bits=self.bits,
            group_size=self.group_size, keys=self.keys(stream),
            nonfinite=torch.zeros(rows * ng, dtype=torch.uint8, device=device),
            sums=torch.zeros(2, dtype=torch.float64, device=device),
            threads=torch.get_num_threads(),
        )
        self.kernels.encode(args)
        nonfinite = args.nonfinite.view(rows, ng).any(dim=1).tolist()
        residual_sq, input_sq = args.sums.tolist()
        self._write_headers(messages, m, shard_ids, nonfinite)
        return EncodeResult(messages, state, nonfinite, residual_sq, input_sq)

    def _write_headers(self, messages, m, shard_ids, nonfinite) -> None:
        raw = b"".join(
            wire.ShardHeader(
                bits=self.bits, dtype_code=self.dtype_code,
                flags=wire.FLAG_NONFINITE if nonfinite[i] else 0,
                group_size=self.group_size, numel=m, seq=self.seq, shard=shard,
                world=self.world, signature=self.signature,
            ).pack()
            for i, shard in enumerate(shard_ids)
        )
        headers = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(len(shard_ids), -1)
        messages[:, :wire.HEADER_BYTES] = headers.to(messages.device)

    # -- decode ---------------------------------------------------------------------------------
    def decode_sum(self, messages: torch.Tensor, m: int, shard: int,
                   out: torch.Tensor | None = None) -> tuple[torch.Tensor, bool]:
        """Sum in fp32, in row order, of ``k`` messages of the same shard: ``([m], nonfinite)``.

        ``out`` (fp32 ``[m]``, contiguous, on the messages' device), when given, receives the
        sum and is returned; otherwise a new tensor is allocated."""
        nonfinite = self.check(messages, m, [shard] * messages.shape[0])
        if out is None:
            out = torch.empty(m, dtype=torch.float32, device=messages.device)
        elif (out.numel() != m or out.dtype != torch.float32 or not out.is_contiguous()
              or out.device != messages.device):
            raise ValueError(f"decode_sum: out must be a contiguous float32 tensor of {m} elements "
                             f"on {messages.device}, got {out.dtype} {tuple(out.shape)} on "
                             f"{out.device}")
        self.kernels.decode_sum(messages, m, self.bits, self.group_size, out.view(-1))
        return out, nonfinite

    def decode_into(self, messages: torch.Tensor, m: int, shard_ids: list[int],
                    out: torch.Tensor) -> bool:
        """Decode rows into flat ``out`` (row ``r`` -> ``out[r*m ...]``, cast); returns nonfinite."""
        nonfinite = self.check(messages, m, shard_ids)
        if out.numel() > messages.shape[0] * m or not out.is_contiguous():
            raise ValueError("decode_into: out must be contiguous and hold at most rows * m elements")
        if out.device != messages.device:
            raise ValueError(f"decode_into: out is on {out.device}, the messages on {messages.device}")
        self.kernels.decode_into(messages, m, self.bits, self.group_size, out)
        return nonfinite

    def check(self, messages: torch.Tensor, m: int, shard_ids: list[int]) -> bool:
        """Validate size and header of each row against this call; True if any row is flagged
        non-finite. Raises `wire.WireFormatError` naming the first difference."""
        expected_bytes = self.message_bytes(m)
        if messages.dtype != torch.uint8 or messages.dim() != 2 or not messages.is_contiguous():
            raise wire.WireFormatError("messages must be a contiguous 2-D uint8 tensor")
        if messages.shape[1] != expected_bytes or messages.shape[0] != len(shard_ids):
            raise wire.WireFormatError(
                f"expected {len(shard_ids)} messages of {expected_bytes} bytes, "
                f"got {tuple(messages.shape)}"
            )
        nonfinite = False
        raw = messages[:, :wire.HEADER_BYTES].cpu().numpy().tobytes()
        for i, shard in enumerate(shard_ids):
            h = wire.ShardHeader.unpack(raw[i * wire.HEADER_BYTES:(i + 1) * wire.HEADER_BYTES])
            problems = [
                f"{name} {got} != {want}"
                for name, got, want in (
                    ("bits", h.bits, self.bits),
                    ("group size", h.group_size, self.group_size),
                    ("numel", h.numel, m),
                    ("dtype", h.dtype_code, self.dtype_code),
                    ("sequence", h.seq, self.seq & 0xFFFFFFFF),
                    ("shard", h.shard, shard),
                    ("world", h.world, self.world),
                    ("signature", h.signature, self.signature),
                )
                if got != want
            ]
            if problems:
                raise wire.WireFormatError(
                    f"message {i} does not belong to this call: " + ", ".join(problems)
                )
            nonfinite |= bool(h.flags & wire.FLAG_NONFINITE)
        return nonfinite
