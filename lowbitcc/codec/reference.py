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

NVFP4 quantizer (format "nvfp4": NVIDIA's NVFP4 element and scale types, FP4 E2M1 codes with an
FP8 E4M3 scale per group of 16, whose one fp32 scale per tensor is here a power-of-two E8M0
byte per block of 16 groups of a row, the last block of a row possibly shorter), and the 3-bit
formats with its scales, "nvint3" (integer magnitudes {0, 1, 2, 3}) and "nvfp3" (FP3 E2M0
magnitudes {0, 1, 2, 4}); `two_level` holds their rules and their grids (`two_level.GRIDS`,
whose largest magnitude ``top`` is 6 for E2M1, 3 and 4):

1. ``amax`` per group; the block's byte ``K`` is the least ``k + 127`` with ``A <= top * 448 *
   2**k`` (2688, 1344 or 1792 times ``2**k``), at least 1, where ``A`` is the largest finite
   ``amax`` of the block (0 if none), computed exactly from A's bits (`loco::nv_block_byte`).
2. The group's scale ``S = E4M3(t) * 2**(K - 127)``, with ``t = (amax / top) * 2**(127 - K)``
   (one correctly rounded division, an exact product but for subnormal results) rounded up to
   the next FP8 E4M3 value, at least ``2**-9`` (``t <= 448`` by K's rule). A non-finite group
   gets E4M3 byte 0x7F (NaN), all codes 0.
3. The code of ``y`` is the grid's magnitude nearest to ``|y| / S`` in exact arithmetic, ties to
   the even index (``|y|`` compared with each midpoint times ``S``, products that are exact),
   with a sign bit for a negative non-zero code: NVFP4's fields as MXFP4's, the 3-bit formats'
   the index in bits 0..1 and the sign in bit 2.
4. Decode: ``x = (-1)**sign * grid[index] * S``. For these formats `quantize` returns scale
   codes (int32 ``K << 8 | E4M3 byte``) instead of fp32 scales; `scale_values` reads them.

Packing: ``u = code + 2**(b-1)`` (int codes; the other formats' fields as they are) is stored in
``b`` bits, little-end first: element ``j`` of a row's codes at bit ``b * j`` of the row's code
bytes read as one little-endian number. For 4 bits element ``2i`` is the low nibble of byte
``i``; for 2 bits element ``4i + k`` sits at bits ``2k..2k+1``; for 3 bits every 8 elements fill
3 bytes, element ``8i + k`` at bit ``3k`` of the 24-bit little-endian word of bytes ``3i ..
3i + 2`` (a group of 16 is 6 bytes).

LoCo error feedback (`compensate_quantize`), per element of one tensor:
``y = g + e``; ``q = Q(y)``; ``r = y - deQ(q)``; ``e' = beta * e + (1 - beta) * r``.

All tensors here are 2-D ``[groups, G]`` fp32 on any device unless stated otherwise.
"""

from __future__ import annotations

import torch

from lowbitcc.codec import formats, two_level, wire

CODE_DTYPE = torch.int8
E2M1 = two_level.E2M1
"""FP4 E2M1 magnitudes, by 3-bit index (`two_level.E2M1`)."""
E4M3_NAN = two_level.E4M3_NAN
"""The E4M3 byte of a non-finite group (NaN)."""
NV_BLOCK = two_level.NV_BLOCK
"""Groups per block byte of the `TWO_LEVEL` formats (``loco::kNvBlock``)."""
e4m3_value = two_level.e4m3_value
FP4_FORMATS = ("mxfp4", "nvfp4")
"""The formats whose codes are 4-bit E2M1 fields (E2M1 magnitudes `E2M1`, ``loco::grid``'s
row for both)."""
TWO_LEVEL = tuple(two_level.GRIDS)
"""The formats with NVFP4's two-level scales (``loco::is_nv``): their scales are scale codes."""


def check_format(fmt: str, bits: int, stochastic: bool = False,
                 group_size: int | None = None) -> None:
    """Raise ValueError unless ``fmt`` is a format that can carry ``bits``-bit codes (rounded
    stochastically where ``stochastic``; in groups of ``group_size``, where given)."""
    if fmt not in wire.FORMATS:
        raise ValueError(f"lowbitcc: unknown code format {fmt!r} "
                         f"(expected one of {wire.FORMATS})")
    spec = formats.FORMATS[fmt]
    if bits not in spec.bits or (stochastic and "stochastic" not in spec.roundings):
        nearest = "" if "stochastic" in spec.roundings else ", rounded to nearest"
        raise ValueError(f"lowbitcc: {fmt} codes are {'/'.join(map(str, spec.bits))} bits "
                         f"wide{nearest}")
    if spec.fixed_group and group_size is not None and group_size != spec.default_group:
        raise ValueError(f"lowbitcc: {fmt} groups are {spec.default_group} elements, "
                         f"not {group_size}")


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
    row_groups: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``y`` ``[groups, G]`` fp32 to int8 codes ``[groups, G]`` and fp32 scales
    ``[groups]`` in format ``fmt`` (for every format but "int" the codes are the fields, sign
    and magnitude index; for the `TWO_LEVEL` formats the scales are int32 scale codes:
    `scale_values`).

    ``keys`` None rounds to nearest (half to even); ``(k0, k1)`` rounds stochastically with the
    random stream those keys select. ``row_groups``: groups per message row, whose blocks the
    `TWO_LEVEL` formats scale together (None: all the groups are one row)."""
    if y.dtype != torch.float32 or y.dim() != 2:
        raise ValueError(f"quantize expects a 2-D fp32 tensor, got {y.dtype} {tuple(y.shape)}")
    check_format(fmt, bits, keys is not None)
    if fmt == "mxfp4":
        return _quantize_mxfp4(y)
    if fmt in TWO_LEVEL:
        return two_level.quantize(y, row_groups or y.shape[0], fmt)
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
    index = two_level.grid_index((y * inv[:, None]).abs(), 1.0, two_level.GRIDS["nvfp4"])
    sign = ((y < 0) & (index > 0)).int() << 3
    fields = torch.where(finite[:, None], index | sign, 0)
    return fields.to(CODE_DTYPE), scale


def scale_values(scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 ``[groups]``: what each group's codes are multiplied by (NaN for a non-finite group),
    from `quantize`'s scales (for the `TWO_LEVEL` formats its scale codes ``K << 8 | E4M3``)."""
    return two_level.scale_values(scales) if fmt in TWO_LEVEL else scales


def e8m0_scale(byte: torch.Tensor) -> torch.Tensor:
    """fp32 scales of E8M0 bytes (any integer dtype): ``2**(byte - 127)``, NaN for 0xFF."""
    byte = byte.to(torch.int32)
    return torch.where(byte == 0xFF, float("nan"), (byte << 23).view(torch.float32))


def scale_field(scales: torch.Tensor, fmt: str, row_groups: int | None = None) -> torch.Tensor:
    """The wire bytes (uint8 ``[rows * wire.scale_field_bytes(row_groups, fmt)]``) of the scales
    from `quantize`, row after row (``row_groups`` None: one row), each row's field padded with
    zeros (`wire.CODES_ALIGN`)."""
    ng = row_groups or scales.numel()
    rows = scales.reshape(-1, ng)
    if fmt in TWO_LEVEL:
        blocks = rows[:, ::NV_BLOCK] >> 8
        raw = torch.cat([rows & 0xFF, blocks], dim=1).to(torch.uint8)
    elif fmt == "mxfp4":
        raw = ((rows.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    else:
        raw = rows.contiguous().view(torch.uint8)
    pad = wire.scale_field_bytes(ng, fmt) - raw.shape[1]
    return torch.nn.functional.pad(raw, (0, pad)).reshape(-1)


def scales_from_field(raw: torch.Tensor, fmt: str, row_groups: int) -> torch.Tensor:
    """Inverse of `scale_field`: the scales from contiguous uint8 wire bytes, a row's field
    (padding included) per row of ``raw``, whose rows hold ``row_groups`` groups."""
    ng = row_groups
    rows = raw.reshape(-1, wire.scale_field_bytes(ng, fmt))
    if fmt in TWO_LEVEL:
        rows = rows.to(torch.int32)
        blocks = rows[:, ng:].repeat_interleave(NV_BLOCK, dim=1)[:, :ng]
        return (blocks << 8 | rows[:, :ng]).reshape(-1)
    if fmt == "mxfp4":
        return e8m0_scale(rows[:, :ng].reshape(-1))
    return rows[:, :4 * ng].contiguous().view(torch.float32).reshape(-1)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, fmt: str = "int") -> torch.Tensor:
    """Inverse of `quantize`: ``codes * scales[:, None]`` in fp32, ``[groups, G]`` (for every
    format but "int" each field's signed magnitude of the format's grid times the scale)."""
    if fmt == "int":
        return codes.to(torch.float32) * scales[:, None]
    grid = two_level.GRIDS.get(fmt, two_level.GRIDS["nvfp4"])  # MXFP4's elements are E2M1
    return two_level.field_values(codes, grid) * scale_values(scales, fmt)[:, None]


def pack(codes: torch.Tensor, bits: int, fmt: str = "int") -> torch.Tensor:
    """Pack int8 codes (any shape; numel a multiple of ``8 // bits``, of 8 for 3 bits) into a
    flat uint8 tensor (integer codes as ``code + 2**(bits-1)``, the other formats' codes as they
    are: they are fields), little-end first (the module docstring's packing)."""
    offset = 0 if fmt != "int" else 1 << (bits - 1)
    u = (codes.reshape(-1).to(torch.int16) + offset).to(torch.uint8)
    if bits == 8:
        return u
    if 8 % bits:  # 8 codes in `bits` bytes: their fields in one word, then its bytes
        fields = u.view(-1, 8).to(torch.int32)
        word = fields[:, 0].clone()
        for k in range(1, 8):
            word |= fields[:, k] << (bits * k)
        shifts = torch.arange(0, 8 * bits, 8, dtype=torch.int32, device=codes.device)
        return ((word[:, None] >> shifts) & 0xFF).to(torch.uint8).reshape(-1)
    per_byte = 8 // bits
    u = u.view(-1, per_byte)
    out = u[:, 0].clone()
    for k in range(1, per_byte):
        out |= u[:, k] << (bits * k)
    return out


def unpack(packed: torch.Tensor, bits: int, numel: int, fmt: str = "int") -> torch.Tensor:
    """Inverse of `pack`: ``numel`` int8 codes from a flat uint8 tensor (for 3 bits, of a whole
    number of 3-byte words)."""
    if packed.numel() * 8 < numel * bits:
        raise ValueError(f"unpack: {packed.numel()} bytes cannot hold {numel} {bits}-bit codes")
    mask = (1 << bits) - 1
    if bits == 8:
        u = packed[:numel]
    elif 8 % bits:  # each `bits` bytes a word of 8 fields
        raw = packed[:packed.numel() // bits * bits].view(-1, bits).to(torch.int32)
        word = raw[:, 0].clone()
        for b in range(1, bits):
            word |= raw[:, b] << (8 * b)
        shifts = torch.arange(0, 8 * bits, bits, dtype=torch.int32, device=packed.device)
        u = ((word[:, None] >> shifts) & mask).reshape(-1)[:numel]
    else:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        u = ((packed[:, None] >> shifts) & mask).reshape(-1)[:numel]
    offset = 0 if fmt != "int" else 1 << (bits - 1)
    return (u.to(torch.int16) - offset).to(CODE_DTYPE)


def compensate_quantize(
    g: torch.Tensor, e: torch.Tensor | None, bits: int, beta: float,
    keys: tuple[int, int] | None = None, fmt: str = "int", row_groups: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One LoCo step on ``[groups, G]`` fp32 input ``g`` with error state ``e`` (or None: zeros);
    ``keys``, ``fmt`` and ``row_groups`` as in `quantize` (None: nearest rounding).

    Returns ``(codes, scales, new_error, residual)``; ``new_error`` is
    ``beta * e + (1 - beta) * r`` with ``r = y - deQ(Q(y))`` and ``y = g + e``.
    """
    y = g if e is None else g + e
    codes, scales = quantize(y, bits, keys, fmt, row_groups)
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
