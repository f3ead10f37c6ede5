"""A place's call counter on the device (`interface.CallCount`), as the CUDA kernels use it,
run on the host (`tests.support.cuda_host`, through `cuda.CudaKernels` and its packed
arguments) and, with ``-m gpu``, on a GPU: a launch that reads the call number from the
counter writes and expects the bytes of a call of that number, the C++ codec's; the call's
last launch writes the next call number (an eager run) or adds the place's stride once every
block has read it (a replay), leaving the block count at zero; a path whose launches cannot
read it refuses a reading counter."""

from __future__ import annotations

import pytest
import torch

from lowbitcc.codec import cuda, wire
from lowbitcc.codec.interface import CallCount, EncodeArgs, FrameSpec, SumSpec
from tests.codec.test_cuda_kernels import _cupy_or_skip
from tests.codec.test_cuda_on_host import WIRES, _codec, _input, _received

NEAREST = [w for w in WIRES if w[3] == "nearest"][:2]  # NVFP4 and MXFP4: what a graph replays


@pytest.fixture(params=["host", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> torch.device:
    """Where the kernels run: on the host harness (CPU tensors), or on a GPU."""
    if request.param == "host":
        request.getfixturevalue("on_host")
        return torch.device("cpu")
    _cupy_or_skip()
    return torch.device("cuda")


def _counter(word0: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([word0, 0], dtype=torch.int32, device=device)


def _zeros(n: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.uint8, device=device)


def _encode_args(codec, x, rows, m, verdict, count) -> EncodeArgs:
    ng = wire.ngroups(m, codec.group_size)
    messages = torch.full((rows, codec.message_bytes(m)), 0xAB, dtype=torch.uint8,
                          device=x.device)
    return EncodeArgs(
        source=x, rows=rows, m=m, factor=1.0, messages=messages, state=None, has_error=False,
        beta=0.0, bits=codec.bits, group_size=codec.group_size, keys=None,
        nonfinite=torch.empty(rows * ng, dtype=torch.uint8, device=x.device),
        sums=torch.zeros(2, dtype=torch.float64, device=x.device), fmt=codec.fmt, clear=verdict,
        frame=FrameSpec(codec.header(m), list(range(rows)),
                        wire.used_bytes(m, codec.bits, codec.group_size, codec.fmt), 0, verdict,
                        count))


@pytest.mark.parametrize("fmt,bits,group,rounding", NEAREST)
def test_an_encode_reading_the_counter_frames_the_call_of_that_number(device, fmt, bits, group,
                                                                      rounding):
    rows, m = 2, 1000
    x = _input(rows * m, 4)
    want = _codec(fmt, bits, group, rounding, rows).with_seq(77).encode(
        x, rows, m, 1.0, None, 0.0, [0, 1], None).messages
    codec = _codec(fmt, bits, group, rounding, rows)  # call #9 on the host
    for count, seq in ((CallCount(_counter(77, device), True, 5), 77), (None, 9),
                       (CallCount(_counter(77, device), False, 80), 9)):
        args = _encode_args(codec, x.to(device), rows, m, _zeros(8, device), count)
        cuda.KERNELS.encode(args)
        got = args.messages.cpu()
        if seq == 77:
            assert torch.equal(got, want)
        else:
            assert wire.ShardHeader.unpack(got[0, :32].numpy().tobytes()).seq == 9
        if count is not None:
            assert count.word.tolist() == [77, 0]  # an encode never advances it


@pytest.mark.parametrize("fmt,bits,group,rounding", NEAREST)
@pytest.mark.parametrize("world,m,numel,blocks", [
    (2, 1000, 1999, 1),
    (2, 2 * cuda.DECODE_SPAN, 4 * cuda.DECODE_SPAN, 4),
    (2, 2 * cuda.DECODE_SPAN, 3 * cuda.DECODE_SPAN + 5, 4),  # the last block partly used
], ids=["one block", "four blocks", "four blocks, the last partial"])
def test_the_last_launch_advances_the_counter_by_the_stride_once_every_block_read_it(
        device, fmt, bits, group, rounding, world, m, numel, blocks):
    """decode_rows (the two-rank call's last launch) of messages of call #77: reading 77 from
    the counter, every row is the call's and the counter becomes 77 + stride (one add for the
    whole grid, of one block or of several, each reading 77 before it); reading 76, every row is
    foreign (NaN) and the counter still advances; writing (an eager run) puts the next call
    number there."""
    reference = _codec(fmt, bits, group, rounding, world).with_seq(77)
    gathered = torch.cat([torch.stack([_received(reference, 1, m, r, 10 * s + r + m)[0]
                                       for r in range(world)]) for s in range(world)]).to(device)
    header9 = _codec(fmt, bits, group, rounding, world).header(m)  # the header's own seq: 9
    assert -(-numel // cuda.DECODE_SPAN) == blocks  # the launch's grid (`CudaKernels.decode_rows`)
    results = {}
    for name, count in (("read", CallCount(_counter(77, device), True, 3)),
                        ("stale", CallCount(_counter(76, device), True, 3)),
                        ("eager", CallCount(_counter(5, device), False, 80))):
        out = torch.full((numel,), 3.0, device=device)
        verdict = _zeros(8, device)
        header = reference.header(m) if name == "eager" else header9
        cuda.KERNELS.decode_rows(gathered, world, m, bits, reference.group_size, fmt, out,
                                 verdict, header, count)
        results[name] = (out.cpu(), verdict[0].item(), count.word.tolist())
    assert results["read"][1] == 0 and not bool(results["read"][0].isnan().any())
    assert results["read"][2] == [80, 0]
    assert results["stale"][1] == 1 and bool(results["stale"][0].isnan().all())
    assert results["stale"][2] == [79, 0]
    assert results["eager"][1] == 0 and results["eager"][2] == [80, 0]
    assert torch.equal(results["read"][0], results["eager"][0])


@pytest.mark.parametrize("fmt,bits,group,rounding", NEAREST[:1])
def test_decode_into_decode_sum_and_encode_sum_read_and_count_as_decode_rows(device, fmt, bits,
                                                                            group, rounding):
    """More ranks' launches: encode_sum reads the counter (never advances it), decode_into and
    decode_sum, each a call's last launch, advance it; the same values as by the header."""
    senders, m = 3, 4099
    reference = _codec(fmt, bits, group, rounding, senders).with_seq(40)
    stale = _codec(fmt, bits, group, rounding, senders)  # header seq 9
    received = _received(reference, senders, m, 1, 7).to(device)
    count = CallCount(_counter(40, device), True, 2)
    by_header, by_count = torch.empty(m, device=device), torch.empty(m, device=device)
    cuda.KERNELS.decode_sum(received, m, bits, reference.group_size, fmt, by_header,
                            _zeros(8, device), check=(reference.header(m), [1] * 3))
    verdict = _zeros(8, device)
    cuda.KERNELS.decode_sum(received, m, bits, reference.group_size, fmt, by_count, verdict,
                            check=(stale.header(m), [1] * 3), count=count)
    assert verdict[0].item() == 0 and torch.equal(by_count, by_header)
    assert count.word.tolist() == [42, 0]
    rows = torch.stack([_received(reference, 1, m, r, 3 + r)[0] for r in range(senders)])
    into = torch.empty(senders * m - 5, device=device)
    count = CallCount(_counter(40, device), True, 2)
    verdict = _zeros(8, device)
    cuda.KERNELS.decode_into(rows.to(device), m, bits, reference.group_size, fmt, into, verdict,
                             check=(stale.header(m), [0, 1, 2]), count=count)
    assert verdict[0].item() == 0 and not bool(into.isnan().any())
    assert count.word.tolist() == [42, 0]
    summed = {}
    for name, codec, count in (("header", reference, None),
                               ("count", stale, CallCount(_counter(40, device), True, 2))):
        verdict = _zeros(8, device)
        args = _encode_args(codec, torch.empty(m, device=device), 1, m, None, count)
        args.summed = SumSpec(received, (codec.header(m), [1] * 3), verdict, count)
        args.frame = FrameSpec(codec.header(m), [1], args.frame.used, 0, verdict, count)
        cuda.KERNELS.encode(args)
        summed[name] = args.messages.cpu()
        assert verdict[0].item() == 0
        if count is not None:
            assert count.word.tolist() == [40, 0]
    assert torch.equal(summed["count"], summed["header"])


def test_a_path_whose_launches_cannot_read_the_counter_refuses_a_reading_one(on_host):
    """Rows that are not 8-byte aligned take the check kernel first, which reads no counter: a
    replay's count is refused there (an eager run's is still written by the decode)."""
    reference = _codec("nvfp4", 4, None, "nearest", 2)
    m = 1000
    gathered = torch.cat([torch.stack([_received(reference, 1, m, r, 10 * s + r)[0]
                                       for r in range(2)]) for s in range(2)])
    P = gathered.shape[1]
    room = torch.zeros(gathered.numel() + 1, dtype=torch.uint8)
    unaligned = room[1:].view(4, P)
    unaligned.copy_(gathered)
    out = torch.empty(2 * m)
    with pytest.raises(ValueError, match="cannot take its call number from the device"):
        cuda.KERNELS.decode_rows(unaligned, 2, m, 4, 16, "nvfp4", out,
                                 torch.zeros(8, dtype=torch.uint8), reference.header(m),
                                 CallCount(_counter(9, torch.device('cpu')), True, 1))
    count = CallCount(_counter(0, torch.device('cpu')), False, 11)
    cuda.KERNELS.decode_rows(unaligned, 2, m, 4, 16, "nvfp4", out,
                             torch.zeros(8, dtype=torch.uint8), reference.header(m), count)
    assert count.word.tolist() == [11, 0]


@pytest.mark.parametrize("fmt,bits,group,rounding", NEAREST[:1])
def test_a_replay_reads_its_source_and_writes_its_output_where_the_address_word_says(
        device, fmt, bits, group, rounding):
    """With the place's address word (`CallCount.addresses`: a replayed graph's), the encode
    reads its source from the word's first address and the call's last launch writes its
    output to the second, not to their arguments' (the tensors of the graph's capture, left
    untouched): the bytes and values the arguments' own tensors would give."""
    rows, m = 2, 1000
    x = _input(rows * m, 4).to(device)
    stale = torch.zeros(rows * m, device=device)  # what the arguments name: the capture's
    codec = _codec(fmt, bits, group, rounding, rows).with_seq(77)
    words = torch.tensor([x.data_ptr(), 0], dtype=torch.int64, device=device)
    count = CallCount(_counter(77, device), True, 0, addresses=words)
    want = codec.encode(x.cpu(), rows, m, 1.0, None, 0.0, [0, 1], None).messages
    args = _encode_args(codec, stale, rows, m, _zeros(8, device), count)
    cuda.KERNELS.encode(args)
    assert torch.equal(args.messages.cpu(), want) and not bool(stale.any())
    gathered = torch.cat([args.messages, args.messages])  # two senders of this call's rows
    out, by_argument = torch.full((rows * m,), 3.0, device=device), torch.empty(rows * m,
                                                                               device=device)
    words[1] = out.data_ptr()
    cuda.KERNELS.decode_rows(gathered, 2, m, bits, codec.group_size, fmt, by_argument,
                             _zeros(8, device), codec.header(m),
                             CallCount(_counter(77, device), False, None))
    cuda.KERNELS.decode_rows(gathered, 2, m, bits, codec.group_size, fmt, stale,
                             _zeros(8, device), codec.header(m), count)
    assert torch.equal(out, by_argument) and not bool(stale.any())
    senders = 3  # more ranks' last launches: decode_sum (a reduce-scatter), decode_into
    received = _received(codec, senders, m, 1, 7).to(device)
    rows = torch.stack([_received(codec, 1, m, r, 3 + r)[0] for r in range(senders)]).to(device)
    for name, messages, n, check in (("decode_sum", received, m, [1] * 3),
                                     ("decode_into", rows, senders * m - 5, [0, 1, 2])):
        out, by_argument = torch.full((n,), 3.0, device=device), torch.empty(n, device=device)
        stale = torch.zeros(n, device=device)
        words[1] = out.data_ptr()  # the source's word stays: a reduce-scatter's output differs
        decode = getattr(cuda.KERNELS, name)
        decode(messages, m, bits, codec.group_size, fmt, by_argument, _zeros(8, device),
               check=(codec.header(m), check))
        decode(messages, m, bits, codec.group_size, fmt, stale, _zeros(8, device),
               check=(codec.header(m), check), count=CallCount(_counter(77, device), True, 0,
                                                               addresses=words))
        assert torch.equal(out, by_argument) and not bool(stale.any()), name
