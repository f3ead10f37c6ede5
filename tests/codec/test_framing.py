"""Framing and verifying shard messages in the kernels (`interface.Kernels.frame` / ``verify``):
the C++ kernels write and accept exactly the bytes the pure-torch reference does, and ``verify``
refuses every message that the field-by-field check (`ShardCodec.check_on_host`) would refuse."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowbitcc.codec import cpu, cuda, wire
from lowbitcc.codec.framing import check_with_torch, header_rows
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


def _memory(address: int, n: int, dtype) -> np.ndarray:
    """``n`` elements of ``dtype`` at a host address (what a kernel argument points to)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * (n * np.dtype(dtype).itemsize)).from_address(
        int(address))).view(dtype)


def _rows(address: int, rows: int, P: int, stride: int) -> np.ndarray:
    """uint8 ``[rows, P]`` at a host address, rows ``stride`` bytes apart."""
    return np.lib.stride_tricks.as_strided(_memory(address, (rows - 1) * stride + P, np.uint8),
                                           (rows, P), (stride, 1))


def _run_frame_body(grid, args) -> None:
    """``loco_cuda::frame_body``'s contract (cuda_codec.cu), one row per ``grid[1]``."""
    msgs, P, used, nonfinite, ng, step, with_checksum, acc = (int(a) for a in args)
    rows = grid[1]
    rows_bytes = _memory(msgs, rows * P, np.uint8).reshape(rows, P)
    flags = _memory(nonfinite, rows * ng, np.uint8).reshape(rows, ng)
    sums = _memory(acc, 3 * rows, np.uint64).reshape(rows, 3)
    for r in range(rows):
        body = rows_bytes[r, wire.HEADER_BYTES:P - wire.TRAILER_BYTES]
        body[max(0, used - wire.HEADER_BYTES):] = 0
        if not with_checksum:  # the sums are not read: the kernel skips the words before
            sums[r, 2] = int(flags[r].any())
            continue
        words = [int(w) for w in body.view("<u8")]
        n = sum(((w + (i + 1) * step) % 2**64 & 0xFFFFFFFF) * ((w + (i + 1) * step) % 2**64 >> 32)
                for i, w in enumerate(words))
        s = sum((w & 0xFFFFFFFF) + (w >> 32) for w in words)
        sums[r] = (n % 2**64, s % 2**64, int(flags[r].any()))


def _run_frame_fold(grid, args) -> None:
    """``loco_cuda::frame_fold``'s contract: headers, trailers and the answer byte; ``acc``
    (the stream's words, shared by every later frame on that stream) left zero again."""
    msgs, P, rows, acc = (int(a) for a in args[:4])
    header, shard0, flags, with_checksum, answer = args[4:]
    rows_bytes = _memory(msgs, rows * P, np.uint8).reshape(rows, P)
    sums = _memory(acc, 3 * rows, np.uint64).reshape(rows, 3)
    for r in range(rows):
        n, s, bad = (int(v) for v in sums[r])
        head = bytearray(header.tobytes())
        head[wire.FLAGS_OFFSET] = int(flags) | (wire.FLAG_NONFINITE if bad else 0)
        head[wire.SHARD_OFFSET:wire.SHARD_OFFSET + 2] = (int(shard0) + r).to_bytes(2, "little")
        rows_bytes[r, :wire.HEADER_BYTES] = np.frombuffer(bytes(head), np.uint8)
        trailer = (s & 0xFFFFFFFF) | ((n ^ (n >> 32)) & 0xFFFFFFFF) << 32 if with_checksum else 0
        rows_bytes[r, P - wire.TRAILER_BYTES:] = np.frombuffer(trailer.to_bytes(8, "little"),
                                                               np.uint8)
        if bad:
            _memory(answer, 1, np.uint8)[0] = 1
    sums[:] = 0


@pytest.mark.parametrize("checksum", [True, False])
@pytest.mark.parametrize("rows", [1, 3])
def test_the_cuda_frame_launches_two_kernels_that_write_the_reference_bytes(monkeypatch, rows,
                                                                           checksum):
    """The CUDA launcher's side of `Kernels.frame`, on CPU memory: two launches whose arguments
    (pointers, sizes, the header passed by value, the answer's byte), run through the kernels'
    contracts, give the reference's messages and answer; shards that are not consecutive take
    the torch operations (and the checksum kernels, no frame kernel)."""
    launches = []
    monkeypatch.setattr(cuda, "_launch", lambda name, device, grid, args: launches.append(
        (name, grid if isinstance(grid, tuple) else (grid,), args)))
    codec = ShardCodec(kernels=cpu.KERNELS, **CODEC)
    m = 100
    used, ng = wire.used_bytes(m, 4, 32, "mxfp4"), wire.ngroups(m, 32)
    garbage = torch.randint(0, 256, (rows, codec.message_bytes(m)), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(rows))
    nonfinite = torch.zeros(rows * ng, dtype=torch.uint8)
    nonfinite[-1] = 1
    messages, expected = garbage.clone(), garbage.clone()
    shards = list(range(5, 5 + rows))
    answer = cuda.KERNELS.frame(messages, codec.header(m), shards, nonfinite, used,
                                wire.FLAG_PEER_ERROR, checksum)
    assert [name for name, _, _ in launches] == [cuda.FRAME_BODY, cuda.FRAME_FOLD]
    assert launches[0][1][1] == rows and launches[1][1] == (1,)
    _run_frame_body(*launches[0][1:])
    _run_frame_fold(*launches[1][1:])
    want = REFERENCE.frame(expected, codec.header(m), shards, nonfinite, used,
                           wire.FLAG_PEER_ERROR, checksum)
    assert torch.equal(messages, expected)
    assert answer.dtype == torch.bool and answer.dim() == 0 and bool(answer) == want
    launches.clear()
    cuda.KERNELS.frame(garbage.clone(), codec.header(m), shards[::-1], nonfinite, used, 0, True)
    assert cuda.FRAME_BODY not in [name for name, _, _ in launches] or rows == 1


def _run_checksum(grid, args) -> None:
    """``loco_cuda::checksum``'s contract: each row's sums N and S added into ``sums``."""
    msgs, P, stride, step, sums = (int(a) for a in args)
    rows = grid[1]
    rows_bytes = _rows(msgs, rows, P, stride)
    out = _memory(sums, 2 * rows, np.uint64).reshape(rows, 2)
    for r in range(rows):
        words = [int(w) for w in rows_bytes[r, wire.HEADER_BYTES:P - wire.TRAILER_BYTES].view("<u8")]
        ys = [(w + (i + 1) * step) % 2**64 for i, w in enumerate(words)]
        out[r] = (sum((y & 0xFFFFFFFF) * (y >> 32) for y in ys) % 2**64,
                  sum((w & 0xFFFFFFFF) + (w >> 32) for w in words) % 2**64)


def _run_check_fold(grid, args) -> None:
    """``loco_cuda::check_fold``'s contract: the verdict's foreign and non-finite bytes."""
    msgs, P, stride, rows, sums = (int(a) for a in args[:5])
    header, shard0, shard_step, with_checksum, verdict = args[5:]
    rows_bytes = _rows(msgs, rows, P, stride)
    folded = _memory(sums, 2 * rows, np.uint64).reshape(rows, 2)
    out = _memory(verdict, 2, np.uint8)
    for r in range(rows):
        flags = int(rows_bytes[r, wire.FLAGS_OFFSET])
        want = bytearray(header.tobytes())
        want[wire.FLAGS_OFFSET] = flags & wire.FLAG_NONFINITE
        want[wire.SHARD_OFFSET:wire.SHARD_OFFSET + 2] = (int(shard0) + r * int(shard_step)).to_bytes(
            2, "little")
        foreign = rows_bytes[r, :wire.HEADER_BYTES].tobytes() != bytes(want)
        if with_checksum:
            n, s = (int(v) for v in folded[r])
            trailer = (s & 0xFFFFFFFF) | ((n ^ (n >> 32)) & 0xFFFFFFFF) << 32
            foreign |= rows_bytes[r, P - wire.TRAILER_BYTES:].tobytes() != trailer.to_bytes(8, "little")
        if foreign:
            out[0] = 1
        if flags & wire.FLAG_NONFINITE:
            out[1] = 1


_CORRUPTIONS = {
    "none": lambda b: None,
    "magic": lambda b: b[1].__setitem__(0, b[1, 0] ^ 1),
    "seq": lambda b: b[0].__setitem__(20, b[0, 20] ^ 1),
    "shard": lambda b: b[1].__setitem__(wire.SHARD_OFFSET, b[1, wire.SHARD_OFFSET] ^ 1),
    "peer flag": lambda b: b[0].__setitem__(wire.FLAGS_OFFSET, wire.FLAG_PEER_ERROR),
    "non-finite flag": lambda b: b[1].__setitem__(wire.FLAGS_OFFSET, wire.FLAG_NONFINITE),
    "body": lambda b: b[1].__setitem__(wire.HEADER_BYTES + 3, b[1, wire.HEADER_BYTES + 3] ^ 8),
    "trailer": lambda b: b[0].__setitem__(-1, b[0, -1] ^ 1),
}


@pytest.mark.parametrize("checksum", [True, False])
@pytest.mark.parametrize("same_shard", [True, False])
@pytest.mark.parametrize("corruption", _CORRUPTIONS)
def test_the_cuda_check_launches_kernels_that_give_the_torch_verdict(monkeypatch, corruption,
                                                                    same_shard, checksum):
    """The CUDA launcher's side of `Kernels.check`, on CPU memory: the checksum and check_fold
    launches, run through their contracts, give `framing.check_with_torch`'s (non-finite,
    foreign) for received rows of one shard (a decode-sum: a column of gathered messages,
    rows apart) or of consecutive shards (a decode-into), whatever is corrupted."""
    launches = []
    monkeypatch.setattr(cuda, "_launch", lambda name, device, grid, args: launches.append(
        (name, grid if isinstance(grid, tuple) else (grid,), args)))
    codec, messages = _encoded(2, 100, 4, cpu.KERNELS)
    shards = [1, 1] if same_shard else [0, 1]
    if same_shard:
        messages[:, wire.SHARD_OFFSET:wire.SHARD_OFFSET + 2] = torch.tensor([1, 0],
                                                                            dtype=torch.uint8)
        gathered = torch.stack([messages, messages.flip(0)], dim=1)  # [ranks, rows, P]
        messages = gathered[:, 0]
        assert messages.stride(0) == 2 * messages.shape[1]
    _CORRUPTIONS[corruption](messages)
    want = check_with_torch(cpu.KERNELS, messages, codec.header(100), shards, checksum)
    nonfinite, foreign = cuda.KERNELS.check(messages, codec.header(100), shards, checksum)
    names = [name for name, _, _ in launches]
    assert names == ([cuda.CHECKSUM] if checksum else []) + [cuda.CHECK_FOLD]
    for name, grid, args in launches:
        (_run_checksum if name == cuda.CHECKSUM else _run_check_fold)(grid, args)
    assert (bool(nonfinite), bool(foreign)) == (bool(want[0]), bool(want[1]))
    if corruption in ("none", "non-finite flag") or (corruption in ("body", "trailer")
                                                   and not checksum):
        assert not bool(foreign)
    else:
        assert bool(foreign)


def test_a_calls_verdict_gathers_what_its_frames_and_checks_saw(monkeypatch):
    """With the call's verdict (`framing.new_verdict`), the CUDA frame and checks write into
    it, allocate no answer of their own, and what they return are views of it; the torch
    forms (the reference's) set the same bytes. Bytes are only ever set, never cleared."""
    from lowbitcc.codec import framing

    runs = {cuda.FRAME_BODY: _run_frame_body, cuda.FRAME_FOLD: _run_frame_fold,
            cuda.CHECKSUM: _run_checksum, cuda.CHECK_FOLD: _run_check_fold}
    launched = []

    def launch(name, device, grid, args):  # run at once: the kernel's buffers live until then
        launched.append(name)
        runs[name](grid if isinstance(grid, tuple) else (grid,), args)

    monkeypatch.setattr(cuda, "_launch", launch)
    codec, clean = _encoded(2, 64, 5, cpu.KERNELS)
    _, flagged = _encoded(2, 64, 5, cpu.KERNELS, nan_rows=[0])
    foreign = clean.clone()
    foreign[1, 20] ^= 1
    used, ng = wire.used_bytes(64, 4, 32, "mxfp4"), wire.ngroups(64, 32)
    verdicts = {}
    for name, kernels in (("cuda", cuda.KERNELS), ("reference", REFERENCE)):
        verdict = framing.new_verdict(torch.device("cpu"))
        answers = [kernels.check(clean, codec.header(64), [0, 1], True, verdict)]
        assert verdict.tolist() == [0] * 8
        answers.append(kernels.check(flagged, codec.header(64), [0, 1], True, verdict))
        answers.append(kernels.check(foreign, codec.header(64), [0, 1], True, verdict))
        answers.append(kernels.check(clean, codec.header(64), [0, 1], True, verdict))
        nonfinite = torch.zeros(2 * ng, dtype=torch.uint8)
        framed = kernels.frame(torch.zeros(2, codec.message_bytes(64), dtype=torch.uint8),
                               codec.header(64), [0, 1], nonfinite, used, 0, True, verdict)
        verdicts[name] = verdict.tolist()
        assert verdicts[name][:2] == [1, 1] and verdicts[name][2:] == [0] * 6
        for got in [framed, *(flag for pair in answers for flag in pair)]:
            assert got.dtype == torch.bool and got.dim() == 0 and bool(got)
        if name == "cuda":
            assert all(got.untyped_storage().data_ptr() == verdict.untyped_storage().data_ptr()
                       for got in [framed, *answers[0]])
    assert verdicts["cuda"] == verdicts["reference"]
    assert launched == [cuda.CHECKSUM, cuda.CHECK_FOLD] * 4 + [cuda.FRAME_BODY, cuda.FRAME_FOLD]
    # the stream's words, shared by every later frame on the stream, are left zero
    assert not bool(cuda.KERNELS.stream_words._words[("cpu", None, 0)].any())
