"""The reference codec and the wire format, without processes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowbitcc.codec import reference, wire
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
    assert len(d.pack()) == wire.HEADER_BYTES
    assert "numel=123456" in d.describe() and "bfloat16" in d.describe()


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
