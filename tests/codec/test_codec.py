"""The reference codec and the wire format, without processes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowbitcc.codec import exchange_frame, formats, reference, wire
from lowbitcc.codec.kernels import select
from lowbitcc.codec.shard_codec import ShardCodec

BITS = st.sampled_from([2, 4, 8])


def _codec(bits=4, group=128, seq=7, world=3, signature=99) -> ShardCodec:
    return ShardCodec(bits=bits, group_size=group, dtype_code=0, seq=seq, world=world,
                      signature=signature)


@given(bits=BITS, groups=st.integers(1, 20), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=60, deadline=None)
def test_pack_unpack_round_trip(bits, groups, seed):
    q = reference.qmax(bits)
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-q, q + 1, (groups, 16), generator=g, dtype=torch.int8)
    packed = reference.pack(codes, bits)
    assert packed.numel() == codes.numel() * bits // 8
    assert torch.equal(reference.unpack(packed, bits, codes.numel()).view_as(codes), codes)


@given(bits=BITS, groups=st.integers(1, 10), scale=st.floats(1e-6, 1e6), seed=st.integers(0, 999))
@settings(max_examples=60, deadline=None)
def test_quantize_error_is_at_most_half_a_step(bits, groups, scale, seed):
    y = torch.randn(groups, 64, generator=torch.Generator().manual_seed(seed)) * scale
    codes, scales = reference.quantize(y, bits)
    assert int(codes.abs().max()) <= reference.qmax(bits)
    err = (y - reference.dequantize(codes, scales)).abs()
    assert bool((err <= scales[:, None] / 2 * (1 + 1e-5)).all())


def test_zero_and_non_finite_groups():
    y = torch.zeros(3, 8)
    y[1, 2] = float("nan")
    y[2, 0] = float("inf")
    codes, scales = reference.quantize(y, 4)
    assert scales[0] == 0 and torch.isnan(scales[1:]).all()
    assert int(codes.abs().sum()) == 0
    out = reference.dequantize(codes, scales)
    assert torch.equal(out[0], torch.zeros(8)) and torch.isnan(out[1:]).all()


def test_loco_update_matches_formula():
    g = torch.randn(4, 32)
    e = torch.randn(4, 32) * 0.1
    codes, scales, new_e, r = reference.compensate_quantize(g, e, 4, 0.8)
    y = g + e
    assert torch.equal(r, y - reference.dequantize(codes, scales))
    assert torch.allclose(new_e, 0.8 * e + 0.2 * r)
    _, _, ef, r0 = reference.compensate_quantize(g, e, 4, 0.0)
    assert torch.equal(ef, r0)


@given(m=st.integers(1, 3000), bits=BITS, rows=st.integers(1, 4))
@settings(max_examples=40, deadline=None)
def test_codec_round_trip_and_sizes(m, bits, rows):
    codec = _codec(bits=bits, group=64)
    x = torch.randn(rows * m)
    res = codec.encode(x, rows, m, 1.0, None, 0.8, list(range(rows)), None)
    assert res.messages.shape == (rows, wire.payload_bytes(m, bits, 64))
    decoded = torch.empty(rows * m)
    codec.decode_into(res.messages, m, list(range(rows)), decoded)
    codes, scales = reference.quantize(
        torch.nn.functional.pad(x.view(rows, m), (0, codec.padded(m) - m)).reshape(-1, 64), bits
    )
    expected = reference.dequantize(codes, scales).view(rows, -1)[:, :m]
    assert torch.equal(decoded.view(rows, m), expected)
    total, nonfinite = codec.decode_sum(res.messages[:1].repeat(3, 1), m, 0)
    assert torch.equal(total, expected[0] * 3) and not nonfinite


def test_decoder_rejects_messages_of_another_call():
    codec = _codec()
    msgs = codec.encode(torch.randn(1000), 2, 500, 1.0, None, 0.8, [0, 1], None).messages
    out = torch.empty(1000)
    with pytest.raises(wire.WireFormatError, match="shard 1 != 0"):
        codec.decode_into(msgs[1:], 500, [0], out[:500])
    with pytest.raises(wire.WireFormatError, match="sequence"):
        _codec(seq=8).decode_into(msgs, 500, [0, 1], out)
    with pytest.raises(wire.WireFormatError, match="expected 2 messages"):
        codec.decode_into(msgs[:, :-4].contiguous(), 500, [0, 1], out)
    corrupt = msgs.clone()
    corrupt[0, :4] = 0
    with pytest.raises(wire.WireFormatError, match="bad magic"):
        codec.decode_into(corrupt, 500, [0, 1], out)
    with pytest.raises(wire.WireFormatError, match="numel"):
        codec.decode_sum(msgs, 499, 0)


def test_call_descriptor_round_trip():
    d = wire.CallDescriptor("all_reduce", torch.bfloat16, 0, 123456, 9, 4, 128, True)
    assert wire.CallDescriptor.unpack(d.pack()) == d
    assert len(d.pack()) == wire.DESCRIPTOR_BYTES == 40
    assert "numel=123456" in d.describe() and "bfloat16" in d.describe()
    child = dataclasses.replace(d, parent=(7 << 32) | 3)
    assert wire.CallDescriptor.unpack(child.pack()) == child and child.call() != d.call()
    assert "issued by a callback of the call tagged 0x700000003" in child.describe()


@pytest.mark.parametrize("dtype", wire.DESCRIPTOR_DTYPES)
def test_call_descriptors_name_every_dtype_and_whether_the_frame_carries_the_input(dtype):
    d = wire.CallDescriptor("reduce_scatter", dtype, 2, 24, 7, 8, 128, False, framed=True)
    back = wire.CallDescriptor.unpack(d.pack())
    assert back == d and back.call().framed
    others = [wire.CallDescriptor.unpack(dataclasses.replace(d, dtype=o).pack())
              for o in wire.DESCRIPTOR_DTYPES if o != dtype]
    assert all(o.call() != d.call() for o in others)  # int32 and int64 differ, and so on
    assert wire.CallDescriptor.unpack(dataclasses.replace(d, framed=False).pack()).call() != d
    assert wire.CallDescriptor.unpack(dataclasses.replace(d, invalid=True).pack()).invalid
    assert (wire.DESCRIPTOR_BYTES + exchange_frame.FRAME_PAYLOAD + exchange_frame.FRAME_CHECK_BYTES
            == exchange_frame.FRAME_BYTES)


@given(seed=st.integers(0, 2**31), offset=st.integers(0, exchange_frame.FRAME_BYTES - 9),
       flip=st.integers(1, 255))
@settings(max_examples=200, deadline=None)
def test_any_changed_byte_of_a_descriptor_frame_changes_its_check(seed, offset, flip):
    frames = np.random.default_rng(seed).integers(0, 256, (3, exchange_frame.FRAME_BYTES),
                                                  dtype=np.uint8)
    changed = frames.copy()
    changed[1, offset] ^= flip
    before, after = exchange_frame.frame_checks(frames), exchange_frame.frame_checks(changed)
    assert before[1] != after[1] and before[0] == after[0] and before[2] == after[2]



@given(seed=st.integers(0, 2**31), row=st.integers(0, 2),
       spans=st.lists(st.tuples(st.integers(0, exchange_frame.EXCHANGE_BYTES - 1), st.integers(1, 255)),
                      min_size=1, max_size=4, unique_by=lambda span: span[0]))
@settings(max_examples=200, deadline=None)
def test_pick_frames_takes_a_copy_that_passes_and_flags_rows_where_none_does(seed, row, spans):
    frames = np.random.default_rng(seed).integers(0, 256, (3, exchange_frame.FRAME_BYTES),
                                                  dtype=np.uint8)
    frames[:, -exchange_frame.FRAME_CHECK_BYTES:] = (
        exchange_frame.frame_checks(frames).view(np.uint8).reshape(3, -1))
    rows = np.tile(frames, exchange_frame.FRAME_COPIES)
    for offset, flip in spans:
        rows[row, offset] ^= flip
    copies_hit = {offset // exchange_frame.FRAME_BYTES for offset, _ in spans}
    picked, intact, corrected = exchange_frame.pick_frames(rows)
    others = [r for r in range(3) if r != row]
    assert intact[others].all() and not corrected[others].any()
    assert np.array_equal(picked[others], frames[others])
    assert intact[row] == (len(copies_hit) < exchange_frame.FRAME_COPIES)
    assert corrected[row] == (intact[row] and 0 in copies_hit)
    if intact[row]:
        assert np.array_equal(picked[row], frames[row])

@given(data=st.binary(min_size=0, max_size=600), rows=st.integers(1, 3), m=st.integers(1, 300),
       impl=st.sampled_from(["reference", "cpu"]))
@settings(max_examples=200, deadline=None)
def test_decoder_fuzz_random_bytes_raise_cleanly(data, rows, m, impl):
    codec = ShardCodec(4, 64, 0, 7, 3, 99, select(impl))
    size = codec.message_bytes(m)
    raw = (data * (rows * size // max(len(data), 1) + 1))[: rows * size] if data else b""
    messages = torch.frombuffer(bytearray(raw.ljust(rows * size, b"\0")), dtype=torch.uint8)
    messages = messages.view(rows, size)
    with pytest.raises(wire.WireFormatError):
        codec.decode_into(messages, m, list(range(rows)), torch.empty(rows * m))
    with pytest.raises(wire.WireFormatError):
        codec.decode_sum(messages[:, : max(size - 4 * (len(data) % 3), 1)].contiguous(), m, 0)


@given(position=st.integers(0, wire.HEADER_BYTES - 1), value=st.integers(0, 255),
       impl=st.sampled_from(["reference", "cpu"]))
@settings(max_examples=200, deadline=None)
def test_decoder_fuzz_header_mutations_are_caught_or_harmless(position, value, impl):
    codec = ShardCodec(4, 64, 0, 7, 3, 99, select(impl))
    msgs = codec.encode(torch.randn(2 * 300), 2, 300, 1.0, None, 0.8, [0, 1], None).messages
    expected = torch.empty(600)
    codec.decode_into(msgs, 300, [0, 1], expected)
    mutated = msgs.clone()
    mutated[0, position] = value
    out = torch.empty(600)
    try:
        codec.decode_into(mutated, 300, [0, 1], out)
    except wire.WireFormatError:
        return
    # accepted only if the byte was unchanged or is the flags byte (non-finite marker)
    assert value == int(msgs[0, position]) or position == 7
    assert torch.equal(out, expected)


# -- MXFP4 ------------------------------------------------------------------------------------
def _mx_amaxes() -> torch.Tensor:
    """Group maxima at and around every kind of edge of the scale rule."""
    edges = [0.0, 1e-45, 1e-40, 2.0**-126, 2.0**-125, 1e-30, 0.1, 1.0, 3.0, 4.0, 5.0, 6.0,
             7.0, 12.0, 1e20, 3.0e38]
    a = torch.tensor(edges, dtype=torch.float32)
    up = torch.nextafter(a, torch.tensor(float("inf")))
    down = torch.nextafter(a, torch.tensor(0.0))
    rand = torch.rand(200, generator=torch.Generator().manual_seed(1)) * 2.0 ** torch.randint(
        -60, 60, (200,), generator=torch.Generator().manual_seed(2))
    return torch.cat([a, up, down, rand.float()])


def test_mxfp4_scale_is_the_least_power_of_two_that_fits_six_codes():
    """scale = 2**k with k the least integer such that amax <= 6 * 2**k (no code clips), and
    k >= -126; checked against exact float64 arithmetic."""
    amax = _mx_amaxes()
    y = torch.zeros(amax.numel(), 32)
    y[:, 0] = amax
    _, scales = reference.quantize(y, 4, fmt="mxfp4")
    for a, s in zip(amax.double().tolist(), scales.double().tolist()):
        k = -126
        while a > 6 * 2.0**k:
            k += 1
        assert s == 2.0**k, (a, s, k)


@pytest.mark.parametrize("fmt", reference.FP4_FORMATS)
def test_fp4_codes_are_nearest_e2m1_with_ties_to_even(fmt):
    """A group of max 6 has scale 1 in both FP4 formats (NVFP4's alone in its block: block
    byte 119, E4M3 256)."""
    y = torch.tensor([[6.0, -6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.2, 0.3,
                       -5.0, 4.9, 5.1, 0.0]])
    codes, scales = reference.quantize(y, 4, fmt=fmt)
    assert float(reference.scale_values(scales, fmt)[0]) == 1.0
    out = reference.dequantize(codes, scales, fmt)[0].tolist()
    assert out == [6.0, -6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, 0.0, 0.5, -4.0, 4.0,
                   6.0, 0.0]
    # the sign bit is set only on a negative non-zero code
    assert [int(c) for c in codes[0, [1, 9, 10, 12]]] == [15, 0, 0, 14]


@given(groups=st.integers(1, 10), scale=st.floats(1e-30, 1e30), seed=st.integers(0, 999))
@settings(max_examples=60, deadline=None)
def test_mxfp4_error_is_at_most_half_the_local_step(groups, scale, seed):
    """Every value of E2M1 times the scale is exact, and rounding errs by at most half the gap
    between the two E2M1 neighbours of a value (0.25, 0.5 or 1 times the scale)."""
    y = torch.randn(groups, 32, generator=torch.Generator().manual_seed(seed)) * scale
    codes, scales = reference.quantize(y, 4, fmt="mxfp4")
    x = reference.dequantize(codes, scales, "mxfp4")
    a = (y / scales[:, None]).abs()
    half_gap = torch.where(a <= 2, 0.25, torch.where(a <= 4, 0.5, 1.0)) * scales[:, None]
    assert bool(((y - x).abs() <= half_gap).all())
    grid = torch.tensor(reference.E2M1)
    exact = (grid[None, :].repeat(groups, 4)[:, :32] * scales[:, None])
    codes2, _ = reference.quantize(exact, 4, fmt="mxfp4")
    assert torch.equal(reference.dequantize(codes2, scales, "mxfp4"), exact)


def test_mxfp4_non_finite_group_decodes_to_nan():
    y = torch.zeros(2, 32)
    y[1, 3] = float("inf")
    codes, scales = reference.quantize(y, 4, fmt="mxfp4")
    assert list(reference.scale_field(scales, "mxfp4")) == [1, 255] + [0] * 14  # padded to 16
    assert int(codes.abs().sum()) == 0
    out = reference.dequantize(codes, scales, "mxfp4")
    assert torch.equal(out[0], torch.zeros(32)) and torch.isnan(out[1]).all()


def test_mxfp4_message_is_4_25_bits_per_element_and_names_its_format():
    m = 32 * 1000
    pad = wire.scale_field_bytes(1000, "mxfp4") - wire.scale_bytes_used(1000, "mxfp4")
    assert 0 <= pad < wire.CODES_ALIGN and wire.codes_offset(m, 32, "mxfp4") % wire.CODES_ALIGN == 0
    assert wire.used_bytes(m, 4, 32, "mxfp4") - wire.HEADER_BYTES - pad == m * 4.25 / 8
    mx = ShardCodec(bits=4, group_size=32, dtype_code=0, seq=1, world=1, signature=5, fmt="mxfp4")
    plain = ShardCodec(bits=4, group_size=32, dtype_code=0, seq=1, world=1, signature=5)
    x = torch.randn(m)
    messages = mx.encode(x, 1, m, 1.0, None, 0.0, [0], None).messages
    out, _ = mx.decode_sum(messages, m, 0)
    assert float((out - x).norm() / x.norm()) < 0.15
    header = wire.ShardHeader.unpack(messages[0, :wire.HEADER_BYTES].numpy().tobytes())
    assert header.fmt == "mxfp4" and header.bits == 4
    with pytest.raises(wire.WireFormatError):  # int4 decoder: other size, or other format
        plain.decode_sum(messages, m, 0)
    same_size = ShardCodec(bits=4, group_size=32, dtype_code=0, seq=1, world=1, signature=5,
                           fmt="mxfp4")
    assert same_size.check_on_host(messages, m, [0]) is False
    forged = messages.clone()
    forged[0, 5] = wire.width_byte(4, "int")
    with pytest.raises(wire.WireFormatError, match="format int != mxfp4"):
        mx.decode_sum(forged, m, 0)


def test_mxfp4_needs_4_bit_nearest_codes():
    with pytest.raises(ValueError, match="mxfp4"):
        ShardCodec(bits=8, group_size=32, dtype_code=0, seq=1, world=1, signature=5, fmt="mxfp4")
    with pytest.raises(ValueError, match="mxfp4"):
        ShardCodec(bits=4, group_size=32, dtype_code=0, seq=1, world=1, signature=5,
                   fmt="mxfp4", rounding="stochastic")


def test_descriptor_carries_the_format():
    desc = wire.CallDescriptor("all_reduce", torch.float32, 0, 100, 3, 4, 32, True, fmt="mxfp4")
    back = wire.CallDescriptor.unpack(desc.pack())
    assert back == desc and back.call() != dataclasses.replace(desc, fmt="int").call()


@pytest.mark.parametrize("fmt", wire.FORMATS)
def test_codes_and_messages_start_16_byte_aligned_at_every_size(fmt):
    """Wire format 6: the scale field is padded (`wire.CODES_ALIGN`), so the codes start
    16-byte aligned in every message, and every message's size is a multiple of 16, so every
    row of a buffer of messages starts as aligned as the buffer."""
    spec = formats.FORMATS[fmt]
    groups = [spec.default_group] if fmt != "int" else [32, 64, 128]
    for group in groups:
        for m in (*range(1, 300), 98_324, 2**20 + 3, 2**24, 6_563 * 16 + 5):
            assert wire.codes_offset(m, group, fmt) % wire.CODES_ALIGN == 0, (m, group)
            for bits in spec.bits:
                assert wire.payload_bytes(m, bits, group, fmt) % wire.CODES_ALIGN == 0, (m, bits)
