"""The reference arithmetic of the formats with NVFP4's two-level scales, and their element grids.

"nvfp4", "nvint3" and "nvfp3" (the formats with a ``block`` in `formats.TABLE`) share NVFP4's
scale machinery: an FP8 E4M3 scale byte per group of 16 elements under one power-of-two E8M0
byte per block of 16 groups of a row (the row's last block may be shorter). They differ only in
their element grid, the magnitudes a code stands for: `GRIDS`, one row per format, the table
this module's arithmetic reads. ``loco::grid`` in ``csrc/loco_codec.cuh`` is the same table for
the C++ and CUDA kernels (`abi` checks the two agree). A grid of ``n = 2**(b-1)`` magnitudes
``g[0] = 0 < g[1] < ... < g[n-1] = top`` gives ``b``-bit codes:

1. ``amax = max(|y|)`` per group; the block's byte ``K`` is the least ``k + 127`` with
   ``A <= top * 448 * 2**k``, at least 1, where ``A`` is the largest finite ``amax`` of the block
   (0 if none): no group's E4M3 scale then exceeds E4M3's largest value, 448. Computed exactly
   from A's bits (`Grid.block_rule`, ``loco::nv_block_byte``): with ``top * 448 = (1 + f0) *
   2**p`` and ``A = (1 + f) * 2**(e - 127)``, ``K = e - p`` where ``f <= f0``, else ``e - p + 1``.
2. The group's scale ``S = E4M3(t) * 2**(K - 127)``, with ``t = (amax / top) * 2**(127 - K)``
   (one correctly rounded fp32 division, then an exact product but for subnormal results)
   rounded up to the next FP8 E4M3 value, at least ``2**-9``. ``S`` is exact in fp32. A
   non-finite group gets E4M3 byte 0x7F (NaN) and all codes 0; the other groups of its block
   are encoded as if it held zeros.
3. The magnitude index of ``y`` is the count of midpoints ``(g[k] + g[k+1]) / 2`` times ``S``
   below ``|y|``, with ties to the even index (``>`` on the midpoints ``k`` even, ``>=`` on the
   odd ones): the nearest magnitude of ``|y| / S`` in exact arithmetic, since every product of a
   midpoint (at most 3 significant bits) and ``S`` (at most 4) is exact and no division rounds.
4. The field: the index in bits ``0 .. b-2``, the sign in bit ``b-1``, set only for a negative
   non-zero code. Decode: ``x = (-1)**sign * g[index] * S``.

The grids: "nvfp4" FP4 E2M1 {0, 0.5, 1, 1.5, 2, 3, 4, 6} (4 bits; its block constant 2688 =
1.3125 * 2**11), "nvint3" the integers {0, 1, 2, 3} (3 bits; 1344 = 1.3125 * 2**10), "nvfp3"
FP3 E2M0 {0, 1, 2, 4} (3 bits; 1792 = 1.75 * 2**10). `quantize` returns the fields and the
scale codes ``K << 8 | E4M3 byte`` (int32), which `scale_values` reads.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from lowbitcc.codec import formats

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""FP4 E2M1 magnitudes, by 3-bit index (NVFP4's grid, and MXFP4's elements)."""
E4M3_MAX = 448.0
"""The largest finite FP8 E4M3 value."""
E4M3_NAN = 0x7F


@dataclasses.dataclass(frozen=True)
class Grid:
    """The element grid of one format with two-level scales: its magnitudes by index (a power of
    two of them, the first 0)."""

    magnitudes: tuple[float, ...]

    @property
    def bits(self) -> int:
        """The field width: the index's bits and a sign bit."""
        return len(self.magnitudes).bit_length()

    @property
    def sign(self) -> int:
        """The field's sign bit (``2**(bits - 1)``)."""
        return len(self.magnitudes)

    @property
    def top(self) -> float:
        """The largest magnitude: a group's scale is its ``amax / top`` rounded up to E4M3."""
        return self.magnitudes[-1]

    @property
    def midpoints(self) -> tuple[float, ...]:
        """``(g[k] + g[k+1]) / 2``, the bounds of rounding to nearest (exact in fp32)."""
        g = self.magnitudes
        return tuple((g[k] + g[k + 1]) / 2 for k in range(len(g) - 1))

    @property
    def block_rule(self) -> tuple[int, int]:
        """``(p, f0)`` with ``top * 448 = (1 + f0 * 2**-23) * 2**p``: the block byte of a block
        whose largest group max has biased exponent ``e`` and mantissa bits ``f`` is ``e - p``
        where ``f <= f0``, else ``e - p + 1`` (module docstring, step 1)."""
        fraction, exponent = math.frexp(self.top * E4M3_MAX)  # fraction in [0.5, 1)
        return exponent - 1, int((2 * fraction - 1) * 2**23)


GRIDS = {"nvfp4": Grid(E2M1), "nvint3": Grid((0.0, 1.0, 2.0, 3.0)),
         "nvfp3": Grid((0.0, 1.0, 2.0, 4.0))}
"""The element grid of each format with two-level scales (``loco::grid``)."""
if set(GRIDS) != {f.name for f in formats.TABLE if f.block} or any(
        (g.bits,) != formats.FORMATS[name].bits for name, g in GRIDS.items()):
    raise RuntimeError("lowbitcc: the grids of two_level.py and the formats with blocks of "
                       "formats.py differ")
NV_BLOCK = formats.FORMATS["nvfp4"].block
"""Groups per block byte (``loco::kNvBlock``, which `abi` checks; every such format's)."""


def block_bytes(amax: torch.Tensor, finite: torch.Tensor, row_groups: int,
                grid: Grid) -> torch.Tensor:
    """int32 ``[groups]``: each group's block byte ``K`` (module docstring, step 1), from the
    groups' maxima ``amax`` (rows of ``row_groups``) and which of them are ``finite``."""
    groups = amax.numel()
    blocks = -(-row_groups // NV_BLOCK)
    tops = torch.zeros(groups // row_groups, blocks * NV_BLOCK, device=amax.device)
    tops[:, :row_groups] = torch.where(finite, amax, 0.0).view(-1, row_groups)
    top = tops.view(-1, blocks, NV_BLOCK).amax(dim=2).view(torch.int32)
    p, f0 = grid.block_rule
    block = ((top >> 23) - torch.where((top & 0x7FFFFF) <= f0, p, p - 1)).clamp(min=1)
    return block.to(torch.int32).repeat_interleave(NV_BLOCK, dim=1)[:, :row_groups].reshape(-1)


def e4m3_up(t: torch.Tensor) -> torch.Tensor:
    """int32: the E4M3 byte of the least E4M3 value ``>= t``, at least ``2**-9`` (byte 1), for
    fp32 ``t`` in ``[0, 448]``."""
    sub = torch.ceil(t * 512.0).clamp(min=1).to(torch.int32)
    up = (t.view(torch.int32) + 0xFFFFF) & ~0xFFFFF
    normal = (((up >> 23) - 120) << 3) | ((up >> 20) & 7)
    return torch.where(t < 2.0 ** -6, sub, normal)


def quantize(y: torch.Tensor, row_groups: int, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The fields (int8 ``[groups, 16]``) and scale codes (int32 ``[groups]``, ``K << 8 | E4M3
    byte``) of ``y`` (fp32 ``[groups, 16]``, rows of ``row_groups`` groups) in format ``fmt``,
    one of `GRIDS` (the module docstring's rules)."""
    grid = GRIDS[fmt]
    groups = y.shape[0]
    if groups % row_groups:
        raise ValueError(f"quantize: {groups} groups are not rows of {row_groups}")
    amax = y.abs().amax(dim=1)
    finite = torch.isfinite(amax)
    block = block_bytes(amax, finite, row_groups, grid)
    # tensor / tensor: one correctly rounded division (`scalar / tensor` rounds twice)
    part = torch.where(finite, amax, 0.0) / torch.full_like(amax, grid.top)
    t = part * ((254 - block) << 23).view(torch.float32)
    byte = torch.where(finite, e4m3_up(t), E4M3_NAN)
    codes = block << 8 | byte
    s = torch.where(finite, scale_values(codes), 1.0)[:, None]
    index = grid_index(y.abs(), s, grid)
    sign = ((y < 0) & (index > 0)).int() * grid.sign
    fields = torch.where(finite[:, None], index | sign, 0)
    return fields.to(torch.int8), codes


def grid_index(a: torch.Tensor, s: torch.Tensor | float, grid: Grid) -> torch.Tensor:
    """int32: the index of ``grid``'s magnitude nearest to ``a / s`` (``a >= 0``, ``s > 0``, any
    shapes that broadcast), ties to the even index: the count of midpoints times ``s`` below
    ``a``, ``>`` on the even midpoints and ``>=`` on the odd ones (module docstring, step 3;
    MXFP4 passes ``s = 1`` and ``a = |y * 2**-k|``)."""
    index = torch.zeros(torch.broadcast_shapes(a.shape, torch.as_tensor(s).shape),
                        dtype=torch.int32, device=a.device)
    for k, mid in enumerate(grid.midpoints):
        index += (a >= mid * s if k % 2 else a > mid * s).int()
    return index


def e4m3_value(byte: torch.Tensor) -> torch.Tensor:
    """fp32 values of FP8 E4M3 bytes (any integer dtype; bias 7, subnormals ``m * 2**-9``), NaN
    for 0x7F and above (`loco::e4m3_value`)."""
    byte = byte.to(torch.int32)
    exp, man = byte >> 3, byte & 7
    normal = ((exp + 120) << 23 | man << 20).view(torch.float32)
    value = torch.where(exp == 0, man.float() * 2.0 ** -9, normal)
    return torch.where(byte >= E4M3_NAN, float("nan"), value)


def scale_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 ``[groups]``: the scales ``S = E4M3 * 2**(K - 127)`` of scale codes ``K << 8 |
    E4M3 byte`` (NaN for a non-finite group)."""
    return e4m3_value(codes & 0xFF) * ((codes >> 8) << 23).view(torch.float32)


def field_values(fields: torch.Tensor, grid: Grid) -> torch.Tensor:
    """fp32: the signed magnitudes of ``grid``'s fields (any integer dtype, any shape)."""
    fields = fields.to(torch.int64)
    values = torch.tensor(grid.magnitudes, device=fields.device)[fields & (grid.sign - 1)]
    return torch.where((fields & grid.sign) != 0, -values, values)
