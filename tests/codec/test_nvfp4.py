"""The NVFP4 format's arithmetic in the reference (docs/wire-format.md): block bytes, E4M3 group
scales rounded up, error bounds, non-finite groups, sizes (its ties to even: test_codec.py).
The C++ and CUDA kernels are held to the reference's bytes in test_kernels.py and
test_cuda_kernels.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowbitcc.codec import formats, reference, wire
from lowbitcc.codec.shard_codec import ShardCodec

E4M3 = sorted({m * 2.0**-9 for m in range(1, 8)}
              | {(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8)} - {480.0})
"""Every positive finite FP8 E4M3 value (480 is the NaN pattern 0x7F)."""


def _amaxes() -> torch.Tensor:
    """Group maxima on and around the block rule's steps (1.3125 * 2**e), and random ones."""
    steps = torch.tensor([1.3125 * 2.0**e for e in range(-120, 110, 7)], dtype=torch.float32)
    up = torch.nextafter(steps, torch.tensor(float("inf")))
    down = torch.nextafter(steps, torch.tensor(0.0))
    gen = torch.Generator().manual_seed(3)
    rand = torch.rand(200, generator=gen) * 2.0 ** torch.randint(-120, 120, (200,), generator=gen)
    return torch.cat([steps, up, down, rand.float(), torch.tensor([0.0, 2.0**-149])])


def _scales(y: torch.Tensor, row_groups: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(block byte, E4M3 byte) of each group of ``y``."""
    _, codes = reference.quantize(y, 4, fmt="nvfp4", row_groups=row_groups)
    return codes >> 8, codes & 0xFF


def test_block_byte_is_the_least_that_keeps_every_group_scale_within_448():
    """K - 127 is the least k >= -126 with A <= 2688 * 2**k (A the block's largest group max),
    checked in float64, one group per block."""
    amax = _amaxes()
    y = torch.zeros(amax.numel(), 16)
    y[:, 5] = -amax
    block, _ = _scales(y, row_groups=1)
    for a, k in zip(amax.double().tolist(), block.tolist()):
        least = -126
        while a > 2688 * 2.0**least:
            least += 1
        assert k - 127 == least, (a, k)


@given(seed=st.integers(0, 2**31 - 1), spread=st.integers(0, 60))
@settings(max_examples=60, deadline=None)
def test_group_scale_is_its_sixth_rounded_up_to_e4m3_under_the_block_byte(seed, spread):
    """S / 2**(K - 127) is the least E4M3 value >= (amax / 6 in fp32) * 2**(127 - K), and at
    least 2**-9; groups of one block share K and span 2**spread in magnitude."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(32, 16, generator=gen) * torch.exp2(
        -torch.randint(0, spread + 1, (32, 1), generator=gen).float())
    block, byte = _scales(y)
    assert torch.equal(block[:16], block[:1].expand(16)) and torch.equal(block[16:],
                                                                         block[16:17].expand(16))
    sixth = (y.abs().amax(dim=1) / torch.full((32,), 6.0)).double()
    values = reference.e4m3_value(byte).double()
    for t, v in zip((sixth * torch.exp2(127.0 - block.double())).tolist(), values.tolist()):
        assert v in E4M3 and v >= t and v <= 448
        below = [e for e in E4M3 if e < v]
        assert not below or below[-1] < t or v == 2.0**-9, (t, v)


@given(groups=st.integers(1, 40), scale=st.floats(1e-30, 1e30), seed=st.integers(0, 999))
@settings(max_examples=60, deadline=None)
def test_error_is_at_most_half_the_local_step(groups, scale, seed):
    """Rounding errs by at most half the gap between the two E2M1 neighbours of |y| / S."""
    y = torch.randn(groups, 16, generator=torch.Generator().manual_seed(seed)) * scale
    codes, scales = reference.quantize(y, 4, fmt="nvfp4")
    s = reference.scale_values(scales, "nvfp4")[:, None].double()
    x = reference.dequantize(codes, scales, "nvfp4").double()
    a = y.double().abs() / s
    assert bool((a <= 6).all())
    half_gap = torch.where(a <= 2, 0.25, torch.where(a <= 4, 0.5, 1.0)) * s
    assert bool(((y.double() - x).abs() <= half_gap).all())


def test_a_non_finite_group_decodes_to_nan_and_leaves_its_block_as_it_was():
    y = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    clean = y.clone()
    clean[1] = 0.0
    y[1, 7] = float("inf")
    codes, scales = reference.quantize(y, 4, fmt="nvfp4")
    assert int(scales[1]) & 0xFF == reference.E4M3_NAN and int(codes[1].abs().sum()) == 0
    out = reference.dequantize(codes, scales, "nvfp4")
    ref_codes, ref_scales = reference.quantize(clean, 4, fmt="nvfp4")
    expected = reference.dequantize(ref_codes, ref_scales, "nvfp4")
    assert torch.isnan(out[1]).all()
    assert torch.equal(out[[0, 2]], expected[[0, 2]])


def test_scale_field_holds_e4m3_bytes_then_block_bytes_per_row():
    y = torch.randn(2 * 20, 16, generator=torch.Generator().manual_seed(1))
    _, scales = reference.quantize(y, 4, fmt="nvfp4", row_groups=20)
    field = reference.scale_field(scales, "nvfp4", 20).view(2, -1)
    assert field.shape[1] == wire.scale_field_bytes(20, "nvfp4") == 32  # 20 + 2, padded to 16
    assert torch.equal(field[:, :20].reshape(-1).int(), scales & 0xFF)
    assert torch.equal(field[:, 20:22].int(), (scales.view(2, 20)[:, ::16] >> 8))
    assert not field[:, 22:].any()
    assert torch.equal(reference.scales_from_field(field, "nvfp4", 20), scales)


def test_message_is_4_53_bits_per_element_names_its_format_and_takes_groups_of_16():
    m = 16 * 16 * 100
    pad = wire.scale_field_bytes(1600, "nvfp4") - wire.scale_bytes_used(1600, "nvfp4")
    assert 0 <= pad < wire.CODES_ALIGN and wire.codes_offset(m, 16, "nvfp4") % wire.CODES_ALIGN == 0
    assert wire.used_bytes(m, 4, 16, "nvfp4") - wire.HEADER_BYTES - pad == m * 4.53125 / 8
    assert formats.FORMATS["nvfp4"].bits_per_element == 4.53125
    nv = ShardCodec(bits=4, group_size=16, dtype_code=0, seq=1, world=1, signature=5, fmt="nvfp4")
    x = torch.randn(m)
    messages = nv.encode(x, 1, m, 1.0, None, 0.0, [0], None).messages
    out, _ = nv.decode_sum(messages, m, 0)
    assert float((out - x).norm() / x.norm()) < 0.12
    header = wire.ShardHeader.unpack(messages[0, :wire.HEADER_BYTES].numpy().tobytes())
    assert header.fmt == "nvfp4" and header.bits == 4
    forged = messages.clone()
    forged[0, 5] = wire.width_byte(4, "mxfp4")
    with pytest.raises(wire.WireFormatError, match="format mxfp4 != nvfp4"):
        nv.decode_sum(forged, m, 0)
    with pytest.raises(ValueError, match="nvfp4 groups are 16 elements, not 32"):
        ShardCodec(bits=4, group_size=32, dtype_code=0, seq=1, world=1, signature=5, fmt="nvfp4")
    with pytest.raises(ValueError, match="nvfp4 codes are 4 bits"):
        ShardCodec(bits=8, group_size=16, dtype_code=0, seq=1, world=1, signature=5, fmt="nvfp4")


def test_the_cuda_encode_takes_a_warp_per_block_of_16_groups_of_16():
    """One warp task per block of a row (its grid), and no other group size: the kernel's
    lanes are laid out for 16."""
    from lowbitcc.codec import cuda_build

    assert cuda_build.encode_warps(3, 40, 16, "nvfp4") == 3 * 3
    with pytest.raises(ValueError, match="nvfp4 groups of 16, not 32"):
        cuda_build.encode_warps(1, 4, 32, "nvfp4")
