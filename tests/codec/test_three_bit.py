"""The 3-bit formats with NVFP4's scales, "nvint3" (magnitudes 0..3) and "nvfp3" (FP3 E2M0: 0, 1,
2, 4), in the reference (docs/wire-format.md, `two_level`): ties to the even index at every
midpoint, the block byte at its rule's boundary, E4M3 group scales rounded up, non-finite and
zero groups, the 3-bit packing, message sizes, and the encode with error feedback against
`reference.compensate_quantize`. The C++ and CUDA kernels are held to the reference's bytes in
test_kernels.py and test_cuda_on_host.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowbitcc.codec import formats, reference, two_level, wire
from lowbitcc.codec.error_state import ErrorState
from lowbitcc.codec.kernels import select
from lowbitcc.codec.shard_codec import ShardCodec

FORMATS = ("nvint3", "nvfp3")
TOP = {"nvint3": 3.0, "nvfp3": 4.0}
E4M3 = sorted({m * 2.0**-9 for m in range(1, 8)}
              | {(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8)} - {480.0})
"""Every positive finite FP8 E4M3 value (480 is the NaN pattern 0x7F)."""


def _quantize(y: torch.Tensor, fmt: str, row_groups: int | None = None):
    """(fields, block bytes, E4M3 bytes, decoded values) of ``y`` ``[groups, 16]``."""
    fields, codes = reference.quantize(y, 3, fmt=fmt, row_groups=row_groups)
    return fields, codes >> 8, codes & 0xFF, reference.dequantize(fields, codes, fmt)


# (|y| / S, magnitude index): the midpoints of each grid, just below and above them, the top
CASES = {
    "nvint3": [(0.0, 0), (0.49, 0), (0.5, 0), (0.51, 1), (1.0, 1), (1.49, 1), (1.5, 2),
               (1.51, 2), (2.0, 2), (2.49, 2), (2.5, 2), (2.51, 3), (3.0, 3)],
    "nvfp3": [(0.0, 0), (0.49, 0), (0.5, 0), (0.51, 1), (1.0, 1), (1.49, 1), (1.5, 2),
              (1.51, 2), (2.0, 2), (2.99, 2), (3.0, 2), (3.01, 3), (4.0, 3)],
}
"""Ties: 0.5 S and 2.5 S (int3) or 3 S (E2M0) go down to the even index, 1.5 S up to it."""


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("unit", [1.0, 2.0**-20, 2.0**30])
def test_codes_are_the_nearest_magnitude_with_ties_to_the_even_index(fmt, unit):
    """A group whose max is ``top * unit`` has scale ``S = unit`` exactly (the block byte puts
    ``top / top`` at E4M3's 256, times a power of two), so each ``|y| / S`` above is exact: the
    index, the sign bit (bit 2, on a negative non-zero code only) and the decoded value."""
    grid = two_level.GRIDS[fmt]
    values = [v for v, _ in CASES[fmt]]
    y = torch.tensor([values + [-v for v in values[:3]]], dtype=torch.float32) * unit
    fields, _, _, out = _quantize(y, fmt)
    assert float(reference.scale_values(reference.quantize(y, 3, fmt=fmt)[1], fmt)[0]) == unit
    want = [i for _, i in CASES[fmt]] + [0, 0, 0]  # -0, -0.49 and -0.5 round to 0: no sign
    assert fields[0].tolist() == want
    assert out[0].tolist() == [grid.magnitudes[i] * unit for i in want[:-3]] + [0.0] * 3
    neg = torch.tensor([[-0.51, -1.5, 0.4 - TOP[fmt], -TOP[fmt]] + [0.0] * 12]) * unit
    fields, _, _, out = _quantize(neg, fmt)
    assert fields[0, :4].tolist() == [4 | 1, 4 | 2, 4 | 3, 4 | 3]
    assert out[0, :4].tolist() == [-grid.magnitudes[i] * unit for i in (1, 2, 3, 3)]


@pytest.mark.parametrize("fmt,step", [("nvint3", 1344.0), ("nvfp3", 1792.0)])
def test_block_byte_at_its_rule_s_boundary(fmt, step):
    """K - 127 is the least k with A <= top * 448 * 2**k (1344 = 1.3125 * 2**10, 1792 = 1.75 *
    2**10): A exactly on the boundary keeps k, the next float up takes k + 1; K is at least 1
    (tiny and all-zero blocks)."""
    on = torch.tensor([step * 2.0**k for k in (-20, -10, 0, 30)])
    above = torch.nextafter(on, torch.tensor(float("inf")))
    y = torch.zeros(10, 16)
    y[:4, 3] = on
    y[4:8, 3] = -above
    y[8, 0] = 2.0**-149  # the least subnormal
    _, block, byte, _ = _quantize(y, fmt, row_groups=1)
    assert block[:4].tolist() == [127 - 20, 127 - 10, 127, 127 + 30]
    assert block[4:8].tolist() == [128 - 20, 128 - 10, 128, 128 + 30]
    assert block[8:].tolist() == [1, 1]
    # on the boundary the group's scale is E4M3's largest, 448, times 2**k; just above it
    # (amax / top) * 2**-(k + 1) = 224.0000x rounds up to 240
    assert reference.e4m3_value(byte[:8]).tolist() == [448.0] * 4 + [240.0] * 4
    assert byte[9].item() == 1  # an all-zero group: the least E4M3 scale, 2**-9


@pytest.mark.parametrize("fmt", FORMATS)
def test_block_byte_is_the_least_that_keeps_every_group_scale_within_448(fmt):
    """Against float64 arithmetic, on and around every step of the rule and at random."""
    top = TOP[fmt]
    steps = torch.tensor([top * 448 * 2.0**e for e in range(-130, 100, 7)], dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    rand = torch.rand(200, generator=gen) * 2.0 ** torch.randint(-120, 120, (200,), generator=gen)
    amax = torch.cat([steps, torch.nextafter(steps, torch.tensor(float("inf"))),
                      torch.nextafter(steps, torch.tensor(0.0)), rand.float()])
    y = torch.zeros(amax.numel(), 16)
    y[:, 9] = amax
    _, block, _, _ = _quantize(y, fmt, row_groups=1)
    for a, k in zip(amax.double().tolist(), block.tolist()):
        least = -126
        while a > top * 448 * 2.0**least:
            least += 1
        assert k - 127 == least, (a, k)


@given(fmt=st.sampled_from(FORMATS), seed=st.integers(0, 2**31 - 1), spread=st.integers(0, 60))
@settings(max_examples=60, deadline=None)
def test_group_scale_is_amax_over_top_rounded_up_to_e4m3_under_the_block_byte(fmt, seed, spread):
    """S / 2**(K - 127) is the least E4M3 value >= (amax / top in fp32) * 2**(127 - K), at least
    2**-9; the groups of a block share K and span 2**spread in magnitude."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(32, 16, generator=gen) * torch.exp2(
        -torch.randint(0, spread + 1, (32, 1), generator=gen).float())
    _, block, byte, _ = _quantize(y, fmt)
    assert torch.equal(block[:16], block[:1].expand(16))
    part = (y.abs().amax(dim=1) / torch.full((32,), TOP[fmt])).double()
    values = reference.e4m3_value(byte).double()
    for t, v in zip((part * torch.exp2(127.0 - block.double())).tolist(), values.tolist()):
        assert v in E4M3 and v >= t and v <= 448
        below = [e for e in E4M3 if e < v]
        assert not below or below[-1] < t or v == 2.0**-9, (t, v)


@given(fmt=st.sampled_from(FORMATS), groups=st.integers(1, 40), scale=st.floats(1e-30, 1e30),
       seed=st.integers(0, 999))
@settings(max_examples=60, deadline=None)
def test_error_is_at_most_half_the_local_step(fmt, groups, scale, seed):
    """|y| / S <= top, and rounding errs by at most half the gap between the two grid
    neighbours of |y| / S (int3: 1/2 everywhere; E2M0: 1/2 up to 2, 1 above)."""
    y = torch.randn(groups, 16, generator=torch.Generator().manual_seed(seed)) * scale
    fields, codes = reference.quantize(y, 3, fmt=fmt)
    s = reference.scale_values(codes, fmt)[:, None].double()
    x = reference.dequantize(fields, codes, fmt).double()
    a = y.double().abs() / s
    assert bool((a <= TOP[fmt]).all())
    half_gap = (torch.where(a <= 2, 0.5, 1.0) if fmt == "nvfp3" else torch.full_like(a, 0.5)) * s
    assert bool(((y.double() - x).abs() <= half_gap).all())


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_non_finite_group_decodes_to_nan_and_a_zero_group_to_zeros(fmt):
    """The non-finite group: E4M3 byte 0x7F, codes 0, NaN; its block encoded as if it held
    zeros. The zero group: the least scale (byte 1), codes 0, zeros."""
    y = torch.randn(4, 16, generator=torch.Generator().manual_seed(0)) * 100
    y[2] = 0.0
    clean = y.clone()
    clean[1] = 0.0
    y[1, 7] = float("nan")
    fields, block, byte, out = _quantize(y, fmt)
    assert byte[1].item() == reference.E4M3_NAN and not fields[1].any()
    assert byte[2].item() == 1 and not fields[2].any()
    assert torch.isnan(out[1]).all() and torch.equal(out[2], torch.zeros(16))
    _, clean_block, clean_byte, expected = _quantize(clean, fmt)
    assert torch.equal(block, clean_block)
    assert torch.equal(out[[0, 2, 3]], expected[[0, 2, 3]])


@pytest.mark.parametrize("fmt", FORMATS)
def test_fields_pack_three_bits_little_end_first(fmt):
    """Element 16g + i at bit 3i of group g's 48-bit little-endian word of 6 bytes (every 8
    elements 3 bytes); unpack inverts it."""
    gen = torch.Generator().manual_seed(2)
    fields = torch.randint(0, 8, (5, 16), generator=gen, dtype=torch.int8)
    packed = reference.pack(fields, 3, fmt)
    assert packed.numel() == 5 * 6
    for g in range(5):
        word = int.from_bytes(bytes(packed[6 * g:6 * g + 6].tolist()), "little")
        assert [(word >> (3 * i)) & 7 for i in range(16)] == fields[g].tolist()
    assert torch.equal(reference.unpack(packed, 3, 80, fmt).view(5, 16), fields)
    with pytest.raises(ValueError, match="cannot hold"):
        reference.unpack(packed[:29], 3, 80, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_message_is_3_53_bits_per_element_6_bytes_per_group_of_codes(fmt):
    """3 + 8/16 + 8/256 bits per element; a row's codes are 6 bytes per group (16-byte aligned
    after the padded scale field); the message names its format and width, and other widths,
    groups and roundings are refused."""
    m = 16 * 16 * 100
    ng = m // 16
    pad = wire.scale_field_bytes(ng, fmt) - wire.scale_bytes_used(ng, fmt)
    assert wire.scale_bytes_used(ng, fmt) == ng + ng // 16
    assert wire.used_bytes(m, 3, 16, fmt) - wire.codes_offset(m, 16, fmt) == 6 * ng
    assert wire.used_bytes(m, 3, 16, fmt) - wire.HEADER_BYTES - pad == m * 3.53125 / 8
    assert formats.FORMATS[fmt].bits_per_element == 3.53125
    codec = ShardCodec(bits=3, group_size=16, dtype_code=0, seq=1, world=1, signature=5, fmt=fmt)
    for n in (1, 17, 1000):
        assert codec.message_bytes(n) == wire.payload_bytes(n, 3, 16, fmt)
        assert (wire.used_bytes(n, 3, 16, fmt) - wire.codes_offset(n, 16, fmt)
                == 6 * wire.ngroups(n, 16))
    x = torch.randn(m)
    messages = codec.encode(x, 1, m, 1.0, None, 0.0, [0], None).messages
    out, _ = codec.decode_sum(messages, m, 0)
    assert float((out - x).norm() / x.norm()) < 0.25
    header = wire.ShardHeader.unpack(messages[0, :wire.HEADER_BYTES].numpy().tobytes())
    assert (header.fmt, header.bits) == (fmt, 3)
    forged = messages.clone()
    forged[0, 5] = wire.width_byte(3, "nvfp3" if fmt == "nvint3" else "nvint3")
    with pytest.raises(wire.WireFormatError, match="format"):
        codec.decode_sum(forged, m, 0)
    with pytest.raises(ValueError, match=f"{fmt} codes are 3 bits"):
        ShardCodec(bits=4, group_size=16, dtype_code=0, seq=1, world=1, signature=5, fmt=fmt)
    with pytest.raises(ValueError, match=f"{fmt} groups are 16 elements, not 32"):
        ShardCodec(bits=3, group_size=32, dtype_code=0, seq=1, world=1, signature=5, fmt=fmt)
    with pytest.raises(ValueError, match="rounded to nearest"):
        ShardCodec(bits=3, group_size=16, dtype_code=0, seq=1, world=1, signature=5, fmt=fmt,
                   rounding="stochastic")


def test_formats_auto_takes_no_3_bit_codes():
    """``LOCO_FORMAT=auto`` keeps its preference (NVFP4, MXFP4, int) and names the 3-bit
    formats where 3 bits are asked for."""
    assert "nvint3" not in formats.AUTO and "nvfp3" not in formats.AUTO
    assert formats.taking(3) == ("nvint3", "nvfp3") and not formats.auto_takes(3)
    with pytest.raises(ValueError, match="'nvint3' or 'nvfp3'"):
        formats.auto(3, "nearest")


@pytest.mark.parametrize("impl", ["reference", "cpu"])
@pytest.mark.parametrize("error_dtype", ["fp32", "int8"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_encode_with_feedback_is_compensate_quantize(fmt, error_dtype, impl):
    """Three chained encodes with error feedback (beta 0.8, a state from the start): each
    message's scales and codes are those of `reference.compensate_quantize` of the input and the
    state, and the new state is its new error (stored as ``error_dtype``)."""
    if impl == "cpu":
        from lowbitcc.codec import cpu

        if cpu.load() is None:
            pytest.skip("the C++ CPU codec could not be built")
    rows, m = 2, 1000
    codec = ShardCodec(bits=3, group_size=16, dtype_code=0, seq=3, world=2, signature=5, fmt=fmt,
                       kernels=select(impl))
    mp, ng = codec.padded(m), wire.ngroups(m, 16)
    gen = torch.Generator().manual_seed(4)
    state = ErrorState.encode(torch.randn(rows * mp, generator=gen) * 0.3, error_dtype, 16)
    start = wire.codes_offset(m, 16, fmt)
    for _ in range(3):
        x = torch.randn(rows * m, generator=gen) * 2
        g = torch.nn.functional.pad(x.view(rows, m), (0, mp - m)).reshape(-1, 16)
        codes, scales, new_e, _ = reference.compensate_quantize(
            g, state.decode().view(-1, 16), 3, 0.8, None, fmt, ng)
        result = codec.encode(x, rows, m, 1.0, state, 0.8, [0, 1], error_dtype)
        messages = result.messages
        assert torch.equal(messages[:, wire.HEADER_BYTES:start].reshape(-1),
                           reference.scale_field(scales, fmt, ng))
        assert torch.equal(messages[:, start:start + 6 * ng].reshape(-1),
                           reference.pack(codes, 3, fmt))
        want = ErrorState.encode(new_e.reshape(-1), error_dtype, 16)
        assert torch.equal(result.error.data.view(torch.uint8), want.data.view(torch.uint8))
        assert (result.error.scales is None) == (want.scales is None)
        state = result.error
