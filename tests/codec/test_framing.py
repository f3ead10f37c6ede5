"""Framing and verifying shard messages in the kernels (`interface.Kernels.frame` / ``verify``):
the C++ kernels write and accept exactly the bytes the pure-torch reference does, and ``verify``
refuses every message that the field-by-field check (`ShardCodec.check_on_host`) would refuse."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowbitcc.codec import cpu, wire
from lowbitcc.codec.framing import header_rows
from lowbitcc.codec.kernels import REFERENCE
from lowbitcc.codec.shard_codec import ShardCodec

pytestmark = pytest.mark.skipif(cpu.load() is None, reason="the C++ codec does not build here")
IMPLS = {"reference": REFERENCE, "cpu": cpu.KERNELS}
CODEC = dict(bits=4, group_size=32, dtype_code=0, seq=7, world=3, signature=0xC0FFEE,
             fmt="mxfp4")


def _encoded(rows: int, m: int, seed: int, kernels, nan_rows=()) -> tuple[ShardCodec, torch.Tensor]:
    codec = ShardCodec(kernels=kernels, **CODEC)
    x = torch.randn(rows * m, generator=torch.Generator().manual_seed(seed))
    for r in nan_rows:
        x[r * m] = float("nan")
    result = codec.encode(x, rows, m, 1.0, None, 0.0, list(range(rows)), None)
    return codec, result.messages


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 4), m=st.integers(1, 300), seed=st.integers(0, 2**31),
       flags=st.sampled_from([0, wire.FLAG_PEER_ERROR]), checksum=st.booleans(),
       data=st.data())
def test_the_cpu_kernels_frame_messages_as_the_reference_does(rows, m, seed, flags, checksum,
                                                             data):
    """Header with each row's shard, non-finite flags, zeroed padding (whatever was there) and
    the trailer: the same bytes, and the same answer whether a row is non-finite."""
    codec = ShardCodec(kernels=cpu.KERNELS, **CODEC)
    used = wire.used_bytes(m, codec.bits, codec.group_size, codec.fmt)
    ng = wire.ngroups(m, codec.group_size)
    shards = data.draw(st.lists(st.integers(0, 2**16 - 1), min_size=rows, max_size=rows))
    nonfinite = torch.tensor(data.draw(st.lists(st.integers(0, 1), min_size=rows * ng,
                                                max_size=rows * ng)), dtype=torch.uint8)
    garbage = torch.randint(0, 256, (rows, codec.message_bytes(m)), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(seed))
    framed = {}
    for name, kernels in IMPLS.items():
        messages = garbage.clone()
        any_bad = kernels.frame(messages, codec.header(m), shards, nonfinite, used, flags,
                                checksum)
        framed[name] = messages
        assert bool(any_bad) == bool(nonfinite.any())
    assert torch.equal(framed["cpu"], framed["reference"])
    messages = framed["cpu"]
    assert torch.equal(messages[:, used:-wire.TRAILER_BYTES].to(torch.int64).sum(dim=1),
                       torch.zeros(rows, dtype=torch.int64))
    assert torch.equal(messages[:, wire.HEADER_BYTES:used], garbage[:, wire.HEADER_BYTES:used])
    for r in range(rows):
        header = wire.ShardHeader.unpack(messages[r, :wire.HEADER_BYTES].numpy().tobytes())
        row_bad = bool(nonfinite.view(rows, ng)[r].any())
        assert header.shard == shards[r] and header.seq == CODEC["seq"]
        assert header.flags == flags | (wire.FLAG_NONFINITE if row_bad else 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_verify_accepts_the_calls_messages_and_reports_non_finite_rows(impl):
    kernels = IMPLS[impl]
    codec, messages = _encoded(3, 100, 1, kernels)
    header = codec.header(100)
    assert kernels.verify(messages, header, [0, 1, 2], True) == 0
    _, flagged = _encoded(3, 100, 1, kernels, nan_rows=[1])
    assert kernels.verify(flagged, header, [0, 1, 2], True) == 1
    assert codec.check_on_host(flagged, 100, [0, 1, 2]) is True


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("offset", [o for o in range(wire.HEADER_BYTES)])
def test_verify_refuses_any_changed_header_byte_and_the_full_check_names_it(impl, offset):
    """A changed byte of the header (a flag other than non-finite, for the flags byte) is
    refused by the kernels; the field-by-field check then raises (or, for a flag it does not
    know, accepts: the kernels are the stricter of the two)."""
    kernels = IMPLS[impl]
    codec, messages = _encoded(2, 64, 2, kernels)
    bad = messages.clone()
    bad[1, offset] ^= 0x10 if offset == wire.FLAGS_OFFSET else 0x01
    assert kernels.verify(bad, codec.header(64), [0, 1], True) == -1
    if offset == wire.FLAGS_OFFSET:
        assert codec.check_on_host(bad, 64, [0, 1]) is False
    else:
        with pytest.raises(wire.WireFormatError):
            codec.check_on_host(bad, 64, [0, 1])
    assert kernels.verify(messages, codec.header(64), [0, 2], True) == -1  # another shard


@pytest.mark.parametrize("impl", IMPLS)
def test_verify_refuses_a_changed_body_byte_only_with_checksums_on(impl):
    kernels = IMPLS[impl]
    codec, messages = _encoded(2, 64, 3, kernels)
    messages[0, wire.HEADER_BYTES + 5] ^= 0x04
    assert kernels.verify(messages, codec.header(64), [0, 1], True) == -1
    assert kernels.verify(messages, codec.header(64), [0, 1], False) == 0
    with pytest.raises(wire.WireFormatError, match="checksum"):
        codec.check_on_host(messages, 64, [0, 1])


def test_a_column_of_gathered_messages_is_verified_and_decoded_where_it_lies():
    """Rows ``rows * P`` bytes apart (each rank's row ``r`` of an all-gather): the C++ kernels
    read them in place, with the results of a contiguous copy."""
    ranks, rows, m = 3, 2, 200
    gathered = torch.stack([_encoded(rows, m, seed, cpu.KERNELS)[1] for seed in range(ranks)])
    codec = ShardCodec(kernels=cpu.KERNELS, **CODEC)
    for r in range(rows):
        column = gathered[:, r]
        assert not column.is_contiguous()
        assert cpu.KERNELS.verify(column, codec.header(m), [r] * ranks, True) == 0
        in_place, _ = codec.decode_sum(column, m, r)
        copied, _ = codec.decode_sum(column.contiguous(), m, r)
        assert torch.equal(in_place, copied)
    assert torch.equal(header_rows(codec.header(m), [0, 1], torch.device("cpu")),
                       gathered[0, :, :wire.HEADER_BYTES])
