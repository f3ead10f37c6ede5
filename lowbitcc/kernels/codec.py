"""Shard codec: LoCo-compensated quantization of shards into wire messages, and back.

The codec works on a *shard matrix* ``x`` of shape ``[n, m]`` fp32: ``n`` shards of ``m``
elements each (row ``j`` is destined for rank ``j`` in a reduce-scatter, or a single row for an
all-gather stage). Each row is quantized on its own in groups of ``G`` (the row's last group
zero-padded), so group boundaries never straddle shards. The error state of a shard matrix is an
fp32 tensor ``[n, mp]`` with ``mp = ceil(m / G) * G`` (the padding lanes stay zero).

Message rows are ``uint8 [n, P]`` with ``P = wire.payload_bytes(m, bits, G)``; the caller owns
every returned tensor. The arithmetic is `reference`'s; faster kernels replace the bodies of
`encode_rows` and `decode_rows` and must produce identical bytes.
"""

from __future__ import annotations

import dataclasses

import torch

from lowbitcc.kernels import reference, wire


@dataclasses.dataclass
class EncodeResult:
    """What one `ShardCodec.encode` produced.

    ``messages`` is ``uint8 [n, P]``; ``new_error`` fp32 ``[n, mp]`` (None when feedback is off);
    ``nonfinite`` a bool per row; ``residual_sq`` / ``input_sq`` the squared L2 norms of the
    quantization residual and of the compensated input over finite rows (for statistics).
    """

    messages: torch.Tensor
    new_error: torch.Tensor | None
    nonfinite: torch.Tensor
    residual_sq: float
    input_sq: float


@dataclasses.dataclass(frozen=True)
class ShardCodec:
    """Encode and decode shard matrices for one call: ``bits``, group size, header fields."""

    bits: int
    group_size: int
    dtype_code: int
    seq: int
    world: int
    signature: int

    def padded(self, m: int) -> int:
        return wire.ngroups(m, self.group_size) * self.group_size

    def message_bytes(self, m: int) -> int:
        return wire.payload_bytes(m, self.bits, self.group_size)

    def encode(
        self,
        x: torch.Tensor,
        error: torch.Tensor | None,
        beta: float,
        shard_ids: list[int],
        feedback: bool = True,
    ) -> EncodeResult:
        """Compensate ``x`` ``[n, m]`` with ``error`` ``[n, mp]``, quantize and frame each row.

        ``shard_ids[i]`` is the shard index written into row ``i``'s header.
        """
        n, m = x.shape
        mp = self.padded(m)
        g = torch.zeros(n, mp, dtype=torch.float32)
        g[:, :m] = x
        groups = g.view(-1, self.group_size)
        e = None if error is None else error.view(-1, self.group_size)
        codes, scales, new_e, residual = reference.compensate_quantize(
            groups, e, self.bits, beta if feedback else 0.0
        )
        scales = scales.view(n, -1)
        nonfinite = ~torch.isfinite(scales).all(dim=1)
        messages = torch.zeros(n, self.message_bytes(m), dtype=torch.uint8)
        ng = mp // self.group_size
        code_bytes = mp * self.bits // 8
        messages[:, wire.HEADER_BYTES:wire.HEADER_BYTES + 4 * ng] = scales.view(torch.uint8)
        start = wire.HEADER_BYTES + 4 * ng
        messages[:, start:start + code_bytes] = reference.pack(codes, self.bits).view(n, code_bytes)
        for i, shard in enumerate(shard_ids):
            header = wire.ShardHeader(
                bits=self.bits, dtype_code=self.dtype_code,
                flags=wire.FLAG_NONFINITE if bool(nonfinite[i]) else 0,
                group_size=self.group_size, numel=m, seq=self.seq, shard=shard,
                world=self.world, signature=self.signature,
            )
            messages[i, :wire.HEADER_BYTES] = torch.frombuffer(
                bytearray(header.pack()), dtype=torch.uint8
            )
        finite_rows = ~nonfinite
        residual_rows = residual.view(n, mp)[finite_rows]
        input_rows = (groups if e is None else groups + e).view(n, mp)[finite_rows]
        return EncodeResult(
            messages=messages,
            new_error=new_e.view(n, mp) if feedback else None,
            nonfinite=nonfinite,
            residual_sq=float(residual_rows.square().sum()),
            input_sq=float(input_rows.square().sum()),
        )

    def decode(self, messages: torch.Tensor, m: int, shard_ids: list[int]) -> torch.Tensor:
        """Decode ``uint8 [k, P]`` messages of ``m`` elements into fp32 ``[k, m]``.

        Row ``i`` must carry shard ``shard_ids[i]`` of this call; anything else raises
        `wire.WireFormatError` before a byte of the body is read.
        """
        k = messages.shape[0]
        self.check(messages, m, shard_ids)
        mp = self.padded(m)
        ng = mp // self.group_size
        start = wire.HEADER_BYTES + 4 * ng
        scales = messages[:, wire.HEADER_BYTES:start].contiguous().view(torch.float32)
        codes = reference.unpack(
            messages[:, start:start + mp * self.bits // 8].reshape(-1), self.bits, k * mp
        )
        values = reference.dequantize(codes.view(-1, self.group_size), scales.reshape(-1))
        return values.view(k, mp)[:, :m]

    def decode_sum(self, messages: torch.Tensor, m: int, shard: int) -> torch.Tensor:
        """Decode ``k`` messages of the same shard and sum them in fp32, in row order: ``[m]``."""
        values = self.decode(messages, m, [shard] * messages.shape[0])
        total = values[0].clone()
        for row in values[1:]:
            total += row
        return total

    def check(self, messages: torch.Tensor, m: int, shard_ids: list[int]) -> None:
        """Validate the size and header of each message row against what this call expects."""
        expected_bytes = self.message_bytes(m)
        if messages.dtype != torch.uint8 or messages.dim() != 2:
            raise wire.WireFormatError("messages must be a 2-D uint8 tensor")
        if messages.shape[1] != expected_bytes or messages.shape[0] != len(shard_ids):
            raise wire.WireFormatError(
                f"expected {len(shard_ids)} messages of {expected_bytes} bytes, "
                f"got {tuple(messages.shape)}"
            )
        for i, shard in enumerate(shard_ids):
            h = wire.ShardHeader.unpack(messages[i, :wire.HEADER_BYTES].numpy().tobytes())
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
