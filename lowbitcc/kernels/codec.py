"""Shard codec: LoCo-compensated quantization of shards into wire messages, and back.

A *shard source* is a flat tensor of ``numel`` elements (fp32, bf16 or fp16) seen as ``rows``
rows of ``m`` elements: row ``r`` holds elements ``r*m .. r*m+m-1``, indices past ``numel`` read
as zero, and every element is multiplied by ``factor`` (fp32) first. Row ``j`` is destined for
rank ``j`` in a reduce-scatter; an all-gather stage encodes a single row. Each row is quantized
on its own in groups of ``G`` (its last group zero-padded), so no group straddles rows. The
error state of a source is an `ErrorState` of ``rows * mp`` elements, ``mp = ceil(m / G) * G``.

Messages are ``uint8 [rows, P]`` with ``P = wire.payload_bytes(m, bits, G)``; the caller owns
every returned tensor. Two implementations produce identical bytes: ``reference`` (pure torch,
the specification) and ``cpu`` (the fused C++ kernels of `cpu_codec.cpp`); ``auto`` picks the
kernels when they could be built.
"""

from __future__ import annotations

import dataclasses

import torch

from lowbitcc.kernels import reference, wire
from lowbitcc.kernels.error_state import ERROR_MODES, ErrorState


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
    """Encode and decode shard messages for one call: ``bits``, group size, header fields."""

    bits: int
    group_size: int
    dtype_code: int
    seq: int
    world: int
    signature: int
    impl: str = "reference"
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

    def impl_for(self, tensor: torch.Tensor) -> str:
        """The implementation that runs for ``tensor``'s device: CUDA tensors use the CUDA
        kernels when CuPy sees a GPU and the group fits a warp, else the reference; CPU tensors
        use ``impl``."""
        if tensor.device.type == "cuda":
            from lowbitcc.kernels import cuda

            usable = cuda.available() and self.group_size <= cuda.MAX_GROUP
            return "cuda" if usable and self.impl != "reference" else "reference"
        return self.impl

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
        if error is not None and (error.dtype != error_dtype or error.numel != rows * self.padded(m)
                                  or error.device != source.device):
            error = None
        impl = self.impl_for(source)
        shape = (rows, self.message_bytes(m))
        if out is None:
            # the CPU paths write every byte; the CUDA kernels leave the bytes of idle lanes
            alloc = torch.zeros if impl == "cuda" else torch.empty
            messages = alloc(shape, dtype=torch.uint8, device=source.device)
        elif (tuple(out.shape) != shape or out.dtype != torch.uint8 or not out.is_contiguous()
              or out.device != source.device):
            raise ValueError(f"ShardCodec.encode: out must be a contiguous uint8 tensor of shape "
                             f"{shape} on {source.device}, got {out.dtype} {tuple(out.shape)} on "
                             f"{out.device}")
        else:
            messages = out if impl != "cuda" else out.zero_()
        messages[:, wire.used_bytes(m, self.bits, self.group_size):] = 0  # the row's padding
        keys = self.keys(stream)
        if impl == "cuda":
            result = self._encode_cuda(source, rows, m, factor, error, beta, error_dtype, messages,
                                       keys)
        elif impl == "cpu":
            result = self._encode_cpu(source, rows, m, factor, error, beta, error_dtype, messages,
                                      keys)
        else:
            result = self._encode_reference(source, rows, m, factor, error, beta, error_dtype,
                                            messages, keys)
        self._write_headers(result.messages, m, shard_ids, result.nonfinite)
        return result

    def _encode_reference(self, source, rows, m, factor, error, beta, error_dtype, messages, keys):
        mp = self.padded(m)
        g = torch.zeros(rows * m, dtype=torch.float32, device=source.device)
        n = min(source.numel(), rows * m)
        g[:n] = source[:n].to(torch.float32)
        if factor != 1.0:
            g = g * factor
        y = torch.zeros(rows, mp, dtype=torch.float32, device=source.device)
        y[:, :m] = g.view(rows, m)
        groups = y.view(-1, self.group_size)
        e = None if error is None else error.decode().view(-1, self.group_size)
        codes, scales, new_e, residual = reference.compensate_quantize(
            groups, e, self.bits, beta if error_dtype else 0.0, keys
        )
        ng = mp // self.group_size
        start = wire.HEADER_BYTES + 4 * ng
        messages[:, wire.HEADER_BYTES:start] = scales.view(rows, ng).view(torch.uint8)
        code_bytes = mp * self.bits // 8
        messages[:, start:start + code_bytes] = reference.pack(codes, self.bits).view(rows, -1)
        group_finite = torch.isfinite(scales)
        compensated = groups if e is None else groups + e
        return EncodeResult(
            messages=messages,
            error=None if not error_dtype else ErrorState.encode(
                new_e.reshape(-1), error_dtype, self.group_size),
            nonfinite=(~group_finite.view(rows, ng).all(dim=1)).tolist(),
            residual_sq=float(residual[group_finite].double().square().sum()),
            input_sq=float(compensated[group_finite].double().square().sum()),
        )

    def _kernel_state(self, error, error_dtype, rows, m, device) -> ErrorState | None:
        """The state the kernels update in place: ``error``, or zeros when feedback starts."""
        if error is not None or not error_dtype:
            return error
        return ErrorState.zeros(rows * self.padded(m), error_dtype, self.group_size, device)

    def _encode_cpu(self, source, rows, m, factor, error, beta, error_dtype, messages, keys):
        from lowbitcc.kernels import cpu

        kernels = cpu.load()
        state = self._kernel_state(error, error_dtype, rows, m, source.device)
        empty = torch.empty(0)
        nonfinite = torch.zeros(rows, dtype=torch.uint8)
        residual_sq, input_sq = kernels.encode(
            source, rows, m, float(factor), messages, nonfinite, ERROR_MODES[error_dtype],
            error is not None,
            state.data if state is not None and error_dtype == "int8" else empty,
            state.scales if state is not None and error_dtype == "int8" else empty,
            state.data if state is not None and error_dtype != "int8" else empty,
            float(beta), self.bits, self.group_size, 0 if keys is None else 1,
            *(keys or (0, 0)), torch.get_num_threads(),
        )
        return EncodeResult(messages, state, [bool(v) for v in nonfinite.tolist()],
                            residual_sq, input_sq)

    def _encode_cuda(self, source, rows, m, factor, error, beta, error_dtype, messages, keys):
        from lowbitcc.kernels import cuda

        state = self._kernel_state(error, error_dtype, rows, m, source.device)
        int8 = state is not None and error_dtype == "int8"
        nonfinite, residual_sq, input_sq = cuda.encode(
            source, rows, m, factor, messages, ERROR_MODES[error_dtype], error is not None,
            state.data if int8 else None, state.scales if int8 else None,
            state.data if state is not None and not int8 else None,
            beta, self.bits, self.group_size, keys,
        )
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
        if out is not None and (out.numel() != m or out.dtype != torch.float32
                                or not out.is_contiguous() or out.device != messages.device):
            raise ValueError(f"decode_sum: out must be a contiguous float32 tensor of {m} elements "
                             f"on {messages.device}, got {out.dtype} {tuple(out.shape)} on "
                             f"{out.device}")
        impl = self.impl_for(messages)
        if impl == "cuda":
            from lowbitcc.kernels import cuda

            return cuda.decode_sum(messages, m, self.bits, self.group_size, out), nonfinite
        if impl == "cpu":
            from lowbitcc.kernels import cpu

            total = cpu.load().decode_sum(messages, m, self.bits, self.group_size,
                                          torch.get_num_threads(),
                                          torch.empty(0) if out is None else out.view(-1))
            return total, nonfinite
        values = self._decode_reference(messages, m)
        total = values[0].clone() if out is None else out.view(-1).copy_(values[0])
        for row in values[1:]:
            total += row
        return total, nonfinite

    def decode_into(self, messages: torch.Tensor, m: int, shard_ids: list[int],
                    out: torch.Tensor) -> bool:
        """Decode rows into flat ``out`` (row ``r`` -> ``out[r*m ...]``, cast); returns nonfinite."""
        nonfinite = self.check(messages, m, shard_ids)
        if out.numel() > messages.shape[0] * m or not out.is_contiguous():
            raise ValueError("decode_into: out must be contiguous and hold at most rows * m elements")
        if out.device != messages.device:
            raise ValueError(f"decode_into: out is on {out.device}, the messages on {messages.device}")
        impl = self.impl_for(messages)
        if impl == "cuda":
            from lowbitcc.kernels import cuda

            cuda.decode_into(messages, m, self.bits, self.group_size, out)
        elif impl == "cpu":
            from lowbitcc.kernels import cpu

            cpu.load().decode_into(messages, m, self.bits, self.group_size, out,
                                   torch.get_num_threads())
        else:
            out.copy_(self._decode_reference(messages, m).reshape(-1)[:out.numel()])
        return nonfinite

    def _decode_reference(self, messages: torch.Tensor, m: int) -> torch.Tensor:
        k = messages.shape[0]
        mp = self.padded(m)
        ng = mp // self.group_size
        start = wire.HEADER_BYTES + 4 * ng
        scales = messages[:, wire.HEADER_BYTES:start].contiguous().view(torch.float32)
        codes = reference.unpack(
            messages[:, start:start + mp * self.bits // 8].reshape(-1), self.bits, k * mp
        )
        values = reference.dequantize(codes.view(-1, self.group_size), scales.reshape(-1))
        return values.view(k, mp)[:, :m]

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
