"""The codec's kernels: one interface, three implementations, chosen once per group and device.

`interface.Kernels` is what `ShardCodec` calls to fill message payloads and to decode them;
`interface.EncodeArgs` is one encode's arguments, the Python face of ``loco::EncodeArgs``
(``csrc/loco_codec.cuh``), with tensors where the struct has pointers. The implementations
produce the same bytes:

- `REFERENCE` (this module): the pure-torch specification (`reference`), any device;
- ``cpu.CpuKernels``: the fused C++/OpenMP kernels (``csrc/cpu_codec.cpp``), CPU tensors;
- ``cuda.CudaKernels``: the CUDA kernels (``csrc/cuda_codec.cu``) through CuPy, CUDA tensors.

`select` picks one from the config's ``codec`` choice and the tensors' device; a process group
calls it once per device, never per call.
"""

from __future__ import annotations

import torch

from lowbitcc.codec import reference, wire
from lowbitcc.codec.error_state import ErrorState
from lowbitcc.codec.framing import VERDICT_FOREIGN, TorchFraming, verdict_flag
from lowbitcc.codec.interface import EncodeArgs, Kernels

CHOICES = ("auto", "reference", "cpu")
"""Values of ``LocoConfig.codec``: the kernels for CPU tensors ("auto": C++ if it builds)."""


class ReferenceKernels(TorchFraming):
    """The pure-torch implementation, built from `reference` (any device)."""

    name = "reference"
    writes_every_byte = True
    reads_poison = False

    def encode(self, args: EncodeArgs) -> None:
        if args.summed is not None:  # the sum is not in args.source: `fuses_sum` kernels only
            raise ValueError("lowbitcc: the reference kernels do not decode a sum inside the encode")
        rows, m, G = args.rows, args.m, args.group_size
        mp = args.ng * G
        device = args.source.device
        if args.clear is not None:
            args.clear.zero_()
        g = torch.zeros(rows * m, dtype=torch.float32, device=device)
        n = min(args.source.numel(), rows * m)
        g[:n] = args.source[:n].to(torch.float32)
        if args.factor != 1.0:
            g = g * args.factor
        y = torch.zeros(rows, mp, dtype=torch.float32, device=device)
        y[:, :m] = g.view(rows, m)
        groups = y.view(-1, G)
        e = args.state.decode().view(-1, G) if args.state is not None and args.has_error else None
        beta = args.beta if args.state is not None else 0.0
        codes, scales, new_e, residual = reference.compensate_quantize(
            groups, e, args.bits, beta, args.keys, args.fmt, args.ng)
        start = wire.codes_offset(m, G, args.fmt)
        args.messages[:, wire.HEADER_BYTES:start] = reference.scale_field(
            scales, args.fmt, args.ng).view(rows, -1)
        packed = reference.pack(codes, args.bits, args.fmt).view(rows, -1)
        args.messages[:, start:start + mp * args.bits // 8] = packed
        finite = torch.isfinite(reference.scale_values(scales, args.fmt))
        args.nonfinite.copy_((~finite).to(torch.uint8))
        compensated = groups if e is None else groups + e
        args.sums[0] += residual[finite].double().square().sum()
        args.sums[1] += compensated[finite].double().square().sum()
        if args.state is not None:
            new = ErrorState.encode(new_e.reshape(-1), args.state.dtype, G)
            args.state.data.copy_(new.data)
            if new.scales is not None:
                args.state.scales.copy_(new.scales)

    def decode_sum(self, messages: torch.Tensor, m: int, bits: int, group_size: int, fmt: str,
                   out: torch.Tensor, verdict: torch.Tensor | None = None) -> None:
        values = _decode_rows(messages, m, bits, group_size, fmt)
        out.copy_(values[0])
        for row in values[1:]:
            out += row
        _foreign_nan(out, verdict)

    def decode_into(self, messages: torch.Tensor, m: int, bits: int, group_size: int, fmt: str,
                    out: torch.Tensor, verdict: torch.Tensor | None = None) -> None:
        out.copy_(_decode_rows(messages, m, bits, group_size, fmt).reshape(-1)[:out.numel()])
        _foreign_nan(out, verdict)

    def checksum(self, messages: torch.Tensor) -> torch.Tensor:
        return reference.checksum(messages)


def _foreign_nan(out: torch.Tensor, verdict: torch.Tensor | None) -> None:
    """NaN into ``out`` where the call's ``verdict`` says a message was foreign (on its device)."""
    if verdict is not None:
        out.masked_fill_(verdict_flag(verdict, VERDICT_FOREIGN), float("nan"))


def _decode_rows(messages: torch.Tensor, m: int, bits: int, group_size: int,
                 fmt: str) -> torch.Tensor:
    """fp32 ``[k, m]``: every message decoded."""
    k = messages.shape[0]
    ng = wire.ngroups(m, group_size)
    mp = ng * group_size
    start = wire.codes_offset(m, group_size, fmt)
    scales = reference.scales_from_field(messages[:, wire.HEADER_BYTES:start].contiguous(), fmt,
                                         ng)
    codes = reference.unpack(messages[:, start:start + mp * bits // 8].reshape(-1), bits, k * mp,
                             fmt)
    values = reference.dequantize(codes.view(-1, group_size), scales, fmt)
    return values.view(k, mp)[:, :m]


REFERENCE = ReferenceKernels()


def select(choice: str = "auto", device: torch.device | str = "cpu",
           group_size: int = 128) -> Kernels:
    """The kernels for tensors on ``device`` under ``LocoConfig.codec == choice``.

    CPU: "reference", or the C++ kernels ("cpu": they must build; "auto": the reference when
    they cannot). CUDA: the CUDA kernels when CuPy sees a GPU and ``group_size`` fits a warp's
    share (`cuda.MAX_GROUP`), else the reference ("reference" forces it).
    """
    if choice not in CHOICES:
        raise ValueError(f"lowbitcc: codec must be one of {', '.join(CHOICES)}, got {choice!r}")
    device_type = torch.device(device).type
    if choice == "reference":
        return REFERENCE
    if device_type == "cuda":
        from lowbitcc.codec import cuda

        return cuda.KERNELS if cuda.available() and group_size <= cuda.MAX_GROUP else REFERENCE
    from lowbitcc.codec import cpu

    if cpu.load() is not None:
        return cpu.KERNELS
    if choice == "cpu":
        raise RuntimeError("lowbitcc: LOCO_CODEC=cpu but the C++ CPU codec could not be built")
    return REFERENCE
