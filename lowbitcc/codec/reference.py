"""Pure-torch reference codec: the executable specification of lowbitcc's arithmetic.

Every other implementation of the codec must produce the same bytes as these functions.

Quantizer (symmetric, one fp32 scale per group of ``G`` consecutive elements, ``b`` bits):

1. ``amax = max(|y|)`` over the group (fp32).
2. ``qmax = 2**(b-1) - 1`` (1, 7 or 127); ``scale = amax / qmax``; ``inv = qmax / amax``
   (``inv = 0`` when ``amax == 0`` or when the division overflows, i.e. ``amax`` below about
   ``qmax / 3.4e38``: such a group's codes are all 0). Both are single fp32 divisions,
   correctly rounded.
3. ``code = clamp(round_half_even(y * inv), -qmax, qmax)`` (one fp32 multiply, no FMA); with
   stochastic rounding ``code = clamp(floor(y * inv + u), -qmax, qmax)``, the product and the sum
   each rounded to fp32, ``u = uniform24(i, k0, k1)`` for element ``i`` of the ``[groups, G]``
   tensor in row-major order (see `uniform24` and `stream_keys`).
4. A group whose ``amax`` is not finite (it holds a NaN or an Inf) gets ``scale = NaN`` and all
   codes 0, so that it decodes to NaN on every rank: non-finite inputs stay visible to AMP.
5. Decode: ``x = code * scale`` (fp32).

MXFP4 quantizer (format "mxfp4": 4-bit FP4 E2M1 codes, one power-of-two scale per group sent as
an E8M0 byte, as the OCP microscaling formats define the element and scale types):

1. ``amax = max(|y|)`` over the group; ``scale = 2**k`` with ``k`` the least integer such that
   ``amax <= 6 * 2**k``, so that no code clips, computed exactly from amax's bits (E8M0 byte
   ``k + 127``, at least 1); ``inv = 2**-k``. A non-finite group gets byte 0xFF (NaN), all
   codes 0.
2. ``v = y * inv`` (exact but for subnormal results; ``|v| <= 6``); the code is the E2M1 value
   {0, 0.5, 1, 1.5, 2, 3, 4, 6} nearest to ``|v|``, ties to the even index (round half to even
   on E2M1's mantissa bit), and ``v``'s sign. Its 4-bit field is the index (bits 0..2) and a
   sign bit 3, set only for a negative non-zero code. Nearest rounding only.
3. Decode: ``x = (-1)**sign * E2M1[index] * 2**(byte - 127)``.

Packing: ``u = code + 2**(b-1)`` is stored in ``b`` bits, little-end first: for 4 bits element
``2i`` is the low nibble of byte ``i``; for 2 bits element ``4i + k`` sits at bits ``2k..2k+1``.

LoCo error feedback (`compensate_quantize`), per element of one tensor:
``y = g + e``; ``q = Q(y)``; ``r = y - deQ(q)``; ``e' = beta * e + (1 - beta) * r``.

All tensors here are 2-D ``[groups, G]`` fp32 on any device unless stated otherwise.
"""

from __future__ import annotations

import torch

from lowbitcc.codec import wire

CODE_DTYPE = torch.int8
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""FP4 E2M1 magnitudes, by 3-bit index."""


def check_format(fmt: str, bits: int, stochastic: bool = False) -> None:
    """Raise ValueError unless ``fmt`` is a format that can carry ``bits``-bit codes."""
    if fmt not in wire.FORMATS:
        raise ValueError(f"lowbitcc: unknown code format {fmt!r} "
                         f"(expected one of {wire.FORMATS})")
    if fmt == "mxfp4" and (bits != 4 or stochastic):
        raise ValueError("lowbitcc: mxfp4 codes are 4 bits wide, rounded to nearest")


def qmax(bits: int) -> int:
    """Largest code magnitude of the symmetric ``bits``-bit quantizer."""
    return (1 << (bits - 1)) - 1


MASK32 = 0xFFFFFFFF
ROUNDINGS = ("nearest", "stochastic")


def mix32(x):
    """The 32-bit integer hash of loco_codec.cuh ``mix32``, on a Python int or an int64 tensor of
    values in ``[0, 2**32)``. Multipliers are below 2**31, so no int64 product overflows."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x1B873593) & MASK32
    return x ^ (x >> 16)


def stream_keys(seed: int, seq: int, stream: int) -> tuple[int, int]:
    """Keys ``(k0, k1)`` of the random stream of one encode: from the config's seed, the call's
    sequence number and a stream id (which rank encodes which stage)."""
    k0 = mix32((seed & MASK32) ^ mix32(seq & MASK32))
    k1 = mix32(k0 ^ mix32((stream & MASK32) ^ 0x9E3779B9))
    return k0, k1


def uniform24(numel: int, k0: int, k1: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 ``[numel]``: ``u_i = (mix32(mix32(i ^ k0) ^ k1) >> 8) * 2**-24``, uniform in [0, 1)."""
    i = torch.arange(numel, dtype=torch.int64, device=device) & MASK32
    h = mix32(mix32(i ^ k0) ^ k1)
    return (h >> 8).to(torch.float32) * (2.0 ** -24)


def quantize(
    y: torch.Tensor, bits: int, keys: tuple[int, int] | None = None, fmt: str = "int",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``y`` ``[groups, G]`` fp32 to int8 codes ``[groups, G]`` and fp32 scales
    ``[groups]`` in format ``fmt`` (for "mxfp4" the codes are the 4-bit fields).

    ``keys`` None rounds to nearest (half to even); ``(k0, k1)`` rounds stochastically with the
    random stream those keys select."""
    if y.dtype != torch.float32 or y.dim() != 2:
        raise ValueError(f"quantize expects a 2-D fp32 tensor, got {y.dtype} {tuple(y.shape)}")
    check_format(fmt, bits, keys is not None)
    if fmt == "mxfp4":
        return _quantize_mxfp4(y)
    q = float(qmax(bits))
    amax = y.abs().amax(dim=1)
    finite = torch.isfinite(amax)
    nonzero = amax > 0
    # tensor / tensor: one correctly rounded division each (torch turns `scalar / tensor` into
    # reciprocal-then-multiply, which rounds twice)
    qt = torch.full_like(amax, q)
    scale = torch.where(finite, amax / qt, torch.full_like(amax, float("nan")))
    inv = qt / torch.where(nonzero, amax, 1.0)
    inv = torch.where(finite & nonzero & torch.isfinite(inv), inv, 0.0)
    t = y * inv[:, None]
    if keys is None:
        codes = torch.round(t)
    else:
        codes = torch.floor(t + uniform24(y.numel(), *keys, device=y.device).view_as(y))
    codes = codes.clamp_(-q, q)
    codes = torch.where(finite[:, None], codes, 0.0)
    # NaN in a finite group is impossible (amax would be NaN, and inv is finite, so y * inv is
    # never 0 * inf), so the cast is well defined.
    return codes.to(CODE_DTYPE), scale


def _quantize_mxfp4(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize` for format "mxfp4" (the module docstring's rules)."""
    amax = y.abs().amax(dim=1)
    finite = torch.isfinite(amax)
    bits = torch.where(finite, amax, 0.0).view(torch.int32)
    k = (bits >> 23) - torch.where((bits & 0x7FFFFF) <= 0x400000, 2, 1)
    byte = torch.where(finite, k.clamp(min=1), 0xFF).to(torch.int32)
    scale = e8m0_scale(byte)
    inv = torch.where(finite, ((254 - byte) << 23).view(torch.float32), 0.0)
    a = (y * inv[:, None]).abs()
    index = ((a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int()
             + (a > 2.5).int() + (a >= 3.5).int() + (a > 5.0).int())
    sign = ((y < 0) & (index > 0)).int() << 3
    fields = torch.where(finite[:, None], index | sign, 0)
    return fields.to(CODE_DTYPE), scale


def e8m0_scale(byte: torch.Tensor) -> torch.Tensor:
    """fp32 scales of E8M0 bytes (any integer dtype): ``2**(byte - 127)``, NaN for 0xFF."""
    byte = byte.to(torch.int32)
    return torch.where(byte == 0xFF, float("nan"), (byte << 23).view(torch.float32))


def scale_field(scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """The wire bytes (uint8 ``[groups * scale_bytes(fmt)]``) of fp32 scales from `quantize`."""
    if fmt == "mxfp4":
        return ((scales.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    return scales.contiguous().view(torch.uint8).reshape(-1)


def scales_from_field(raw: torch.Tensor, fmt: str) -> torch.Tensor:
    """Inverse of `scale_field`: fp32 scales from contiguous uint8 wire bytes."""
    if fmt == "mxfp4":
        return e8m0_scale(raw.reshape(-1))
    return raw.contiguous().view(torch.float32).reshape(-1)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, fmt: str = "int") -> torch.Tensor:
    """Inverse of `quantize`: ``codes * scales[:, None]`` in fp32, ``[groups, G]`` (for "mxfp4"
    each code's signed E2M1 value times the scale)."""
    if fmt == "mxfp4":
        fields = codes.to(torch.int64)
        values = torch.tensor(E2M1, device=codes.device)[fields & 7]
        return torch.where((fields & 8) != 0, -values, values) * scales[:, None]
    return codes.to(torch.float32) * scales[:, None]


def pack(codes: torch.Tensor, bits: int, fmt: str = "int") -> torch.Tensor:
    """Pack int8 codes (any shape, numel a multiple of ``8 // bits``) into a flat uint8 tensor
    (integer codes as ``code + 2**(bits-1)``, mxfp4 codes as they are: they are fields)."""
    offset = 0 if fmt == "mxfp4" else 1 << (bits - 1)
    u = (codes.reshape(-1).to(torch.int16) + offset).to(torch.uint8)
    if bits == 8:
        return u
    per_byte = 8 // bits
    u = u.view(-1, per_byte)
    out = u[:, 0].clone()
    for k in range(1, per_byte):
        out |= u[:, k] << (bits * k)
    return out


def unpack(packed: torch.Tensor, bits: int, numel: int, fmt: str = "int") -> torch.Tensor:
    """Inverse of `pack`: ``numel`` int8 codes from a flat uint8 tensor."""
    per_byte = 8 // bits
    if packed.numel() * per_byte < numel:
        raise ValueError(f"unpack: {packed.numel()} bytes cannot hold {numel} {bits}-bit codes")
    if bits == 8:
        u = packed[:numel]
    else:
        mask = (1 << bits) - 1
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        u = ((packed[:, None] >> shifts) & mask).reshape(-1)[:numel]
    offset = 0 if fmt == "mxfp4" else 1 << (bits - 1)
    return (u.to(torch.int16) - offset).to(CODE_DTYPE)


def compensate_quantize(
    g: torch.Tensor, e: torch.Tensor | None, bits: int, beta: float,
    keys: tuple[int, int] | None = None, fmt: str = "int",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One LoCo step on ``[groups, G]`` fp32 input ``g`` with error state ``e`` (or None: zeros);
    ``keys`` and ``fmt`` as in `quantize` (None: nearest rounding).

    Returns ``(codes, scales, new_error, residual)``; ``new_error`` is
    ``beta * e + (1 - beta) * r`` with ``r = y - deQ(Q(y))`` and ``y = g + e``.
    """
    y = g if e is None else g + e
    codes, scales = quantize(y, bits, keys, fmt)
    residual = y - dequantize(codes, scales, fmt)
    if e is None or beta == 0.0:
        new_e = residual * (1.0 - beta) if beta else residual
    else:
        new_e = e * beta + residual * (1.0 - beta)
    return codes, scales, new_e, residual


def as_int64(u: int) -> int:
    """The int64 with the bits of uint64 ``u`` (torch's integer products wrap modulo 2**64)."""
    return u - (1 << 64) if u >= 1 << 63 else u


def _shift_right(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` seen as uint64."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def checksum(messages: torch.Tensor) -> torch.Tensor:
    """int64 ``[rows]``: the checksum (`wire` module docstring) of each row of ``uint8 [rows, P]``
    messages, over bytes ``HEADER_BYTES .. P - TRAILER_BYTES``, as the bits of a uint64. Any
    device; allocates a few temporaries of the body's size."""
    rows, width = messages.shape
    body = messages[:, wire.HEADER_BYTES:width - wire.TRAILER_BYTES]
    if body.shape[1] % 8:
        raise ValueError(f"checksum: message bodies of {body.shape[1]} bytes, not whole words")
    body = body.contiguous()
    if body.storage_offset() % 8:  # a view of int64 words must start on one
        body = body.clone()
    words = body.view(torch.int64)
    low = (1 << 32) - 1
    position = torch.arange(1, words.shape[1] + 1, dtype=torch.int64, device=messages.device)
    y = words + position * as_int64(wire.CHECKSUM_STEP)
    n = ((y & low) * _shift_right(y, 32)).sum(dim=1, dtype=torch.int64)
    s = words.view(torch.int32).sum(dim=1, dtype=torch.int64) & low  # signed or not, mod 2**32
    folded = (n ^ _shift_right(n, 32)) & low
    return (s | folded << 32).view(rows)
