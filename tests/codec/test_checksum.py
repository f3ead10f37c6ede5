"""The checksum trailer of shard messages: its definition, its implementations, and that a
message corrupted anywhere in its scales, codes or padding is refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowbitcc.codec import cpu, reference, wire
from lowbitcc.codec.kernels import select
from lowbitcc.codec.shard_codec import ShardCodec


def _spec(messages: torch.Tensor) -> list[int]:
    """The wire module's definition, written again with Python integers."""
    sums = []
    for row in messages.numpy()[:, wire.HEADER_BYTES:-wire.TRAILER_BYTES]:
        body = row.tobytes()
        n = s = 0
        for i in range(len(body) // 8):
            w = int.from_bytes(body[8 * i:8 * i + 8], "little")
            y = (w + (i + 1) * wire.CHECKSUM_STEP) % 2**64
            n = (n + (y & 0xFFFFFFFF) * (y >> 32)) % 2**64
            s = (s + (w & 0xFFFFFFFF) + (w >> 32)) % 2**32
        sums.append(s | ((n & 0xFFFFFFFF) ^ (n >> 32)) << 32)
    return sums


def _unsigned(t: torch.Tensor) -> list[int]:
    return [int(v) & (2**64 - 1) for v in t.tolist()]


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 4), words=st.integers(0, 3000), seed=st.integers(0, 2**31),
       misaligned=st.booleans())
def test_every_implementation_computes_the_defined_checksum(rows, words, seed, misaligned):
    """Also on messages that start 4 bytes into their storage (a received row of a larger
    buffer): torch cannot view such bytes as int64 words in place."""
    gen = torch.Generator().manual_seed(seed)
    width = wire.HEADER_BYTES + 8 * words + wire.TRAILER_BYTES
    skip = 4 if misaligned else 0
    storage = torch.randint(0, 256, (skip + rows * width,), dtype=torch.uint8, generator=gen)
    messages = storage[skip:].view(rows, width)
    want = _spec(messages)
    assert _unsigned(reference.checksum(messages)) == want
    if cpu.load() is not None:
        assert _unsigned(cpu.KERNELS.checksum(messages)) == want


@settings(max_examples=200, deadline=None)
@given(words=st.integers(1, 40), seed=st.integers(0, 2**31), data=st.data())
def test_any_flipped_bit_or_byte_of_the_body_changes_the_checksum(words, seed, data):
    """The 32-bit sum moves with any change confined to one 32-bit word (`wire`)."""
    gen = torch.Generator().manual_seed(seed)
    width = wire.HEADER_BYTES + 8 * words + wire.TRAILER_BYTES
    messages = torch.randint(0, 256, (1, width), dtype=torch.uint8, generator=gen)
    offset = data.draw(st.integers(wire.HEADER_BYTES, width - wire.TRAILER_BYTES - 1))
    new = data.draw(st.integers(0, 255).filter(lambda v: v != int(messages[0, offset])))
    changed = messages.clone()
    changed[0, offset] = new
    assert _spec(changed) != _spec(messages)
    assert not torch.equal(reference.checksum(changed), reference.checksum(messages))


@pytest.mark.skipif(cpu.load() is None, reason="the C++ CPU codec could not be built")
def test_the_cpu_checksum_of_large_messages_sums_its_chunks_in_parallel_alike():
    """Past 4 chunks of 2**15 words the C++ checksum splits rows into chunks across threads."""
    gen = torch.Generator().manual_seed(3)
    width = wire.HEADER_BYTES + 8 * (5 * 2**15 + 17) + wire.TRAILER_BYTES
    messages = torch.randint(0, 256, (2, width), dtype=torch.uint8, generator=gen)
    assert _unsigned(cpu.KERNELS.checksum(messages)) == _spec(messages)


def _codec(impl: str, checksum: bool = True) -> ShardCodec:
    return ShardCodec(bits=4, group_size=64, dtype_code=0, seq=5, world=2, signature=77,
                      kernels=select(impl), checksum=checksum)


IMPLS = ["reference"] + (["cpu"] if cpu.load() is not None else [])


@pytest.mark.parametrize("impl", IMPLS)
def test_a_message_carries_its_checksum_and_decodes(impl):
    m = 1000
    codec = _codec(impl)
    messages = codec.encode(torch.randn(2 * m), 2, m, 1.0, None, 0.0, [0, 0], None).messages
    assert messages.shape[1] == wire.payload_bytes(m, 4, 64)
    assert (messages.shape[1] - wire.HEADER_BYTES - wire.TRAILER_BYTES) % 8 == 0
    carried = messages[:, -wire.TRAILER_BYTES:].contiguous().view(torch.int64).view(-1)
    assert _unsigned(carried) == _spec(messages)
    codec.decode_sum(messages, m, 0)  # intact: no exception


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("where", ["first scale", "scale padding", "a code", "last code",
                                   "padding", "trailer"])
def test_one_flipped_bit_anywhere_after_the_header_is_refused(impl, where):
    # 15 groups of 64: scales at 32..92, their field's zero padding to 96 (the codes 16-byte
    # aligned), codes at 96..576, padding to 584, the trailer to 592 (a multiple of 16)
    m = 960
    codec = _codec(impl)
    messages = codec.encode(torch.randn(2 * m), 2, m, 1.0, None, 0.0, [0, 1], None).messages
    used = wire.used_bytes(m, 4, 64)
    assert (wire.codes_offset(m, 64), used, messages.shape[1]) == (96, 576, 592)
    assert not messages[:, 92:96].any()  # the scale field's padding is zeros
    offset = {"first scale": wire.HEADER_BYTES, "scale padding": 93, "a code": 300,
              "last code": used - 1, "padding": messages.shape[1] - wire.TRAILER_BYTES - 1,
              "trailer": messages.shape[1] - 1}[where]
    assert where != "padding" or offset >= used
    messages[1, offset] ^= 0x10
    with pytest.raises(wire.WireFormatError, match=r"message 1 \(shard 1\) fails its checksum"):
        codec.decode_into(messages, m, [0, 1], torch.empty(2 * m))


def test_checksums_off_write_zeros_and_check_nothing():
    m = 1000
    codec = _codec("reference", checksum=False)
    messages = codec.encode(torch.randn(m), 1, m, 1.0, None, 0.0, [0], None).messages
    assert not messages[:, -wire.TRAILER_BYTES:].any()
    messages[0, 300] ^= 0x10
    codec.decode_sum(messages, m, 0)  # not verified: decodes what it got
