"""The CUDA kernels run on the host (`tests.support.cuda_host`: g++'s build of
``cuda_codec.cu``, a std::thread per CUDA thread, block barriers and warp shuffles as CUDA
defines them) through `cuda.CudaKernels` itself, its launcher's grids and arguments included,
on CPU tensors: the C++ codec's bytes, error states, values and verdicts, bit for bit. No GPU:
what a GPU's memory model, scheduling or speed would show is not held here (`-m gpu` and
``benchmarks/gpu_suite.sh`` run the same comparisons on one)."""

from __future__ import annotations

import pytest
import torch

from lowbitcc.codec import cpu, cuda, cuda_build, framing, wire
from lowbitcc.codec.error_state import ErrorState
from lowbitcc.codec.formats import FORMATS
from lowbitcc.codec.interface import EncodeArgs, FrameSpec, SumSpec
from lowbitcc.codec.shard_codec import ShardCodec

WIRES = [("nvfp4", 4, None, "nearest"), ("int", 4, None, "stochastic"), ("mxfp4", 4, None, "nearest"),
         ("int", 4, None, "nearest"), ("int", 2, None, "nearest"), ("int", 8, None, "nearest"),
         ("int", 4, 24, "nearest"), ("nvint3", 3, None, "nearest"), ("nvfp3", 3, None, "nearest")]
"""(format, bits, group size (None: the format's default), rounding): a group of 24 takes the
encode's whole-warp segments (24 / 8 lanes is no power of two); the 3-bit formats' lanes store
and load their 3 code bytes byte by byte."""
SLOW = pytest.mark.slow


def _fast_first(values: list, fast: int) -> list:
    """``values`` as parameters, all but the first ``fast`` marked slow (`-m slow` runs the
    whole matrix; the default suite the first of each, about 15 s with the build: the default
    format and an integer one, each kernel's vector and element-by-element paths)."""
    return [v if i < fast else pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=SLOW)
            for i, v in enumerate(values)]


def _codec(fmt, bits, group, rounding, world, kernels=None) -> ShardCodec:
    """The C++ codec, or ``kernels``."""
    return ShardCodec(bits=bits, group_size=group or FORMATS[fmt].default_group, dtype_code=0,
                      seq=9, world=world, signature=5, fmt=fmt, kernels=kernels or cpu.KERNELS,
                      checksum=False, rounding=rounding, seed=3)


def _input(n: int, seed: int, dtype=torch.float32, poison: bool = False) -> torch.Tensor:
    torch.manual_seed(seed)
    x = torch.randn(n) * torch.logspace(-4, 4, n)[torch.randperm(n)]
    if poison:
        x[n // 3] = float("inf")
    return x.to(dtype)


def _state_equal(got: ErrorState | None, want: ErrorState | None) -> None:
    assert (got is None) == (want is None)
    if got is not None:
        bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.int8: torch.int8}
        assert torch.equal(got.data.view(bits[got.data.dtype]), want.data.view(bits[want.data.dtype]))
        assert (got.scales is None) == (want.scales is None)
        if got.scales is not None:
            assert torch.equal(got.scales.view(torch.int32), want.scales.view(torch.int32))


@pytest.mark.parametrize("fmt,bits,group,rounding", _fast_first(WIRES, 2))
@pytest.mark.parametrize("error_dtype", _fast_first([None, "int8", "fp32", "bf16"], 2))
@pytest.mark.parametrize("dtype,rows,m", _fast_first([(torch.float32, 3, 1000),
                                                      (torch.bfloat16, 2, 4099),
                                                      (torch.float16, 3, 1000)], 1))
def test_the_cuda_encode_and_frame_write_the_cpu_codec_s_bytes(on_host, fmt, bits, group,
                                                               rounding, error_dtype, dtype, rows,
                                                               m):
    """Two calls (the second applies the first's error state), then a third with an Inf: the
    messages (header, scales, codes, padding, trailer: the encode, `frame_body` and
    `frame_fold`), the new error states, the non-finite answer and the residual sums."""
    want_codec = _codec(fmt, bits, group, rounding, rows)
    got_codec = _codec(fmt, bits, group, rounding, rows, kernels=cuda.KERNELS)
    states = {"want": None, "got": None}
    for call in range(3):
        x = _input(rows * m - 5, 10 * call + m, dtype, poison=call == 2)
        want = want_codec.encode(x, rows, m, 0.5, states["want"], 0.8, list(range(rows)),
                                 error_dtype, stream=call)
        got = got_codec.encode(x, rows, m, 0.5, states["got"], 0.8, list(range(rows)),
                               error_dtype, stream=call)
        assert torch.equal(got.messages, want.messages), call
        _state_equal(got.error, want.error)
        assert bool(got.any_nonfinite) == bool(want.any_nonfinite) == (call == 2)
        # statistics: fp64 sums in another order (per warp, then atomics) than the C++ codec's
        torch.testing.assert_close(got.sums, want.sums, rtol=1e-6, atol=0)
        states = {"want": want.error, "got": got.error}
    assert any("frame_fold" in name for name in on_host.launched)


@pytest.mark.parametrize("fmt,bits,group,rounding", _fast_first(WIRES[:3], 2))
@pytest.mark.parametrize("rows,m", _fast_first([(1, 1000), (4, 4099)], 1))
def test_the_encode_that_frames_its_messages_writes_frame_s_bytes(on_host, fmt, bits, group,
                                                                  rounding, rows, m):
    """`EncodeArgs.frame` (the last block to finish writes every row's header, padding and
    trailer) against the same encode followed by the frame kernels; the verdict's non-finite
    byte where a row holds an Inf, and ``clear`` zeroing the verdict first."""
    codec = _codec(fmt, bits, group, rounding, rows, kernels=cuda.KERNELS)
    for poison in (False, True):
        x = _input(rows * m, m + rows, poison=poison)
        framed = codec.encode(x, rows, m, 1.0, None, 0.0, list(range(rows)), None).messages
        verdict = torch.full((8,), 7, dtype=torch.uint8)  # cleared by the encode
        messages = torch.full_like(framed, 0xAB)
        ng = wire.ngroups(m, codec.group_size)
        args = EncodeArgs(
            source=x, rows=rows, m=m, factor=1.0, messages=messages, state=None,
            has_error=False, beta=0.0, bits=bits, group_size=codec.group_size,
            keys=codec.keys(0),  # stream 0, as the encode above
            nonfinite=torch.empty(rows * ng, dtype=torch.uint8),
            sums=torch.zeros(2, dtype=torch.float64), fmt=fmt, clear=verdict,
            frame=FrameSpec(codec.header(m), list(range(rows)),
                            wire.used_bytes(m, bits, codec.group_size, fmt), 0, verdict))
        on_host.launched.clear()
        cuda.KERNELS.encode(args)
        assert [name.split("<")[0] for name in on_host.launched] == ["loco_cuda::encode"]
        assert torch.equal(messages, framed)
        assert verdict.tolist() == [0, int(poison), 0, 0, 0, 0, 0, 0]


def _received(codec: ShardCodec, senders: int, m: int, shard: int, seed: int,
              poison_sender: int | None = None) -> torch.Tensor:
    """``senders`` ranks' messages of ``shard`` (uint8 ``[senders, P]``)."""
    rows = []
    for s in range(senders):
        x = _input(m, seed + s, poison=s == poison_sender)
        rows.append(codec.encode(x, 1, m, 1.0, None, 0.0, [shard], None).messages[0])
    return torch.stack(rows)


@pytest.mark.parametrize("fmt,bits,group,rounding", _fast_first(WIRES, 2))
@pytest.mark.parametrize("m", _fast_first([1000, 4099, 7], 2))
@pytest.mark.parametrize("case", ["own", "foreign", "flagged"])
def test_the_self_checking_decodes_answer_as_check_and_decode_as_the_cpu_codec(
        on_host, fmt, bits, group, rounding, m, case):
    """`decode_sum` and `decode_into` given ``check`` (each block checks every row's header,
    block 0 sets the verdict): the values of the C++ codec's decodes, NaN everywhere where a
    row is foreign, the verdict's bytes as torch's check sets them."""
    reference = _codec(fmt, bits, group, rounding, 3)
    received = _received(reference, 3, m, 1, m, poison_sender=1 if case == "flagged" else None)
    if case == "foreign":
        received[2, 3] ^= 1  # the magic
    header = reference.header(m)
    want_verdict = torch.zeros(8, dtype=torch.uint8)
    framing.check_with_torch(reference.kernels, received, header, [1, 1, 1], False, want_verdict)
    want = torch.empty(m)
    reference.kernels.decode_sum(received, m, bits, reference.group_size, fmt, want)
    verdict = torch.zeros(8, dtype=torch.uint8)
    got = torch.full((m,), 3.0)
    cuda.KERNELS.decode_sum(received, m, bits, reference.group_size, fmt, got, verdict,
                            check=(header, [1, 1, 1]))
    assert torch.equal(verdict, want_verdict)
    if case == "foreign":
        assert bool(got.isnan().all())
    else:
        _same_values(got, want)
    rows = _received(reference, 3, m, 0, 2 * m)  # three rows of shards 0, 1, 2
    rows = torch.stack([r for r in rows])
    for r in range(3):
        rows[r].copy_(_received(reference, 1, m, r, 3 * m + r)[0])
    into = torch.full((3 * m - 2,), 3.0, dtype=torch.bfloat16)
    into_verdict = torch.zeros(8, dtype=torch.uint8)
    cuda.KERNELS.decode_into(rows, m, bits, reference.group_size, fmt, into, into_verdict,
                             check=(header, [0, 1, 2]))
    want_into = torch.empty(3 * m)
    reference.kernels.decode_into(rows, m, bits, reference.group_size, fmt, want_into)
    assert into_verdict.tolist() == [0] * 8
    assert torch.equal(into.view(torch.int16), want_into[:3 * m - 2].to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("fmt,bits,group,rounding", _fast_first(WIRES, 2))
@pytest.mark.parametrize("error_dtype", _fast_first([None, "int8", "fp32", "bf16"], 2))
@pytest.mark.parametrize("senders,m", _fast_first([(3, 1000), (4, 4099)], 1))
@pytest.mark.parametrize("case", ["own", "foreign"])
def test_encode_sum_writes_the_bytes_of_decode_sum_then_the_encode(on_host, fmt, bits, group,
                                                                    rounding, error_dtype,
                                                                    senders, m, case):
    """The fused all-gather stage (`EncodeArgs.summed`, ``encode_sum``) against the C++
    codec's `decode_sum` of the received messages and its encode of the sum: messages, error
    state, sums and verdict (NaN sum, flagged messages where a row is foreign)."""
    reference = _codec(fmt, bits, group, rounding, senders)
    shard = senders - 1
    received = _received(reference, senders, m, shard, 5 * m)
    if case == "foreign":
        received[0, 3] ^= 1
    header = reference.header(m)
    state = (ErrorState.encode(_input(reference.padded(m), 7) * 1e-3, error_dtype,
                               reference.group_size) if error_dtype else None)
    # the C++ codec: decode_sum (NaN where a row is foreign, as the device check makes it), encode
    total = torch.empty(m)
    reference.kernels.decode_sum(received, m, bits, reference.group_size, fmt, total)
    if case == "foreign":
        total.fill_(float("nan"))
    want = reference.encode(total, 1, m, 1.0, None if state is None else state.to("cpu", copy=True),
                            0.8, [shard], error_dtype, stream=4)
    codec = _codec(fmt, bits, group, rounding, senders, kernels=cuda.KERNELS)
    verdict = torch.zeros(8, dtype=torch.uint8)
    on_host.launched.clear()
    got = codec.encode(torch.empty(m), 1, m, 1.0, state, 0.8, [shard], error_dtype, stream=4,
                       verdict=verdict, summed=SumSpec(received, (header, [shard] * senders),
                                                       verdict))
    assert [name.split("<")[0] for name in on_host.launched][0] == "loco_cuda::encode_sum"
    assert torch.equal(got.messages, want.messages)
    _state_equal(got.error, want.error)
    torch.testing.assert_close(got.sums, want.sums, rtol=1e-6, atol=0)
    assert verdict[0].item() == int(case == "foreign")
    assert bool(got.any_nonfinite) == (case == "foreign")


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _placed(n: int, dtype: torch.dtype, aligned: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A flat output of ``n`` elements (inside a larger buffer), 16-byte aligned or not."""
    room = torch.full((n + 16,), 3.0, dtype=dtype)
    skip = (-room.data_ptr() % 16) // room.element_size() + (0 if aligned else 1)
    return room, room[skip:skip + n]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _same_values(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit where finite, NaN where NaN (a NaN's payload is the host's here: a GPU's
    cast writes others)."""
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(_bits(got)[~nan], _bits(want)[~nan])


def _expected_accesses(m: int, fmt: str, bits: int, group: int, dtype: torch.dtype,
                       aligned: bool) -> dict[str, int]:
    """The vector accesses of `test_the_encode_reads_its_source_in_16_byte_loads_and_writes_codes_in_words`'s
    encode (source loads, code stores) and decode (code loads, output stores; fp32 output) of 3
    rows of ``m`` elements, the last 5 missing. 1024: every whole chunk's source in one load
    where the source is aligned (the last is short), none an element off. 1003: the rows'
    chunks whose start is 16-byte aligned (125 in all where fp32 rows start 4 bytes apart;
    2-byte elements an element off never are); no decode in chunks (m not a multiple of 8).
    1152: as 1024. At every size every lane's codes in one word (a lane's 8 of the row's
    groups' codes, padding included): the codes start 16-byte aligned (`wire.CODES_ALIGN`;
    before wire format 6, NVFP4's at 1003 and 1152 and 8-bit codes at 1152 started off their
    word and went byte by byte). 3-bit codes: 3 bytes a lane, byte by byte at every size."""
    chunks, lanes = 3 * m // 8, 3 * wire.ngroups(m, group) * group // 8
    lanes = lanes if bits % 2 == 0 else 0
    if m == 1003:
        source = 0 if not aligned and dtype != torch.float32 else 125
        return {"source loads": source, "code stores": lanes, "code loads": 0,
                "output stores": 0}
    return {"source loads": chunks - 1 if aligned else 0, "code stores": lanes,
            "code loads": lanes, "output stores": chunks}


def _access_cases() -> list:
    """(wire, dtype, aligned): every dtype with the default format and every code width with
    fp32, aligned or not; the other pairs, and 3-bit codes, with ``-m slow``."""
    return [pytest.param(wire, dtype, aligned, marks=() if wire[1] != 3 and (
                wire == WIRES[0] or dtype == DTYPES[0]) else SLOW)
            for wire in (WIRES[0], WIRES[2], WIRES[4], WIRES[5], WIRES[7]) for dtype in DTYPES
            for aligned in (True, False)]


@pytest.mark.parametrize("wire_case,dtype,aligned", _access_cases())
def test_the_encode_reads_its_source_in_16_byte_loads_and_writes_codes_in_words(
        on_host, wire_case, dtype, aligned):
    """`TensorSource::chunk` and `store_codes`: a source that starts 16-byte aligned (rows of
    1024 elements: every whole chunk in one load) or one element after (every chunk element by
    element), 1003-element rows (some rows' chunks aligned, the row ends element by element),
    messages whose scales end off a word (NVFP4 at 1003: 67 scale bytes; int at 1152: 9 groups
    of 128, 36 bytes) and whose codes start aligned all the same (the field's padding), MXFP4,
    NVFP4, 2-, 3- and 8-bit codes: the C++
    codec's bytes; and `decode_into` of them (`load_codes`: the codes of a chunk in one load
    where aligned) its values. The harness counts the vector accesses (`_expected_accesses`)."""
    fmt, bits, group, rounding = wire_case
    on_host.vector_accesses()
    for rows, m in ((3, 1024), (3, 1003), (3, 1152)):
        want_codec = _codec(fmt, bits, group, rounding, rows)
        got_codec = _codec(fmt, bits, group, rounding, rows, kernels=cuda.KERNELS)
        _, x = _placed(rows * m - 5, dtype, aligned)
        x.copy_(_input(rows * m - 5, m, dtype))
        want = want_codec.encode(x, rows, m, 0.5, None, 0.0, list(range(rows)), None)
        got = got_codec.encode(x, rows, m, 0.5, None, 0.0, list(range(rows)), None)
        encoded = on_host.vector_accesses()
        assert torch.equal(got.messages, want.messages), (rows, m)
        decoded, values = torch.empty(rows * m), torch.empty(rows * m)
        cuda.KERNELS.decode_into(got.messages, m, bits, want_codec.group_size, fmt, decoded,
                                 torch.zeros(8, dtype=torch.uint8))
        decoded_accesses = on_host.vector_accesses()
        cpu.KERNELS.decode_into(want.messages, m, bits, want_codec.group_size, fmt, values)
        _same_values(decoded, values)
        expected = _expected_accesses(m, fmt, bits, want_codec.group_size, dtype, aligned)
        assert encoded == {**expected, "code loads": 0, "output stores": 0}, (m, encoded)
        assert decoded_accesses == {**expected, "source loads": 0, "code stores": 0}, (
            m, decoded_accesses)


@pytest.mark.parametrize("fmt", ["nvfp4", pytest.param("mxfp4", marks=SLOW)])
@pytest.mark.parametrize("m", [98_324, pytest.param(2**20 + 3, marks=SLOW)])
def test_codes_are_stored_and_loaded_in_words_at_real_sizes(on_host, fmt, m):
    """At a real bucket's shard sizes (98,324 elements: NVFP4's scales end at byte 6,563) the
    encode stores every lane's codes in one word and the decode (m a multiple of 8) loads them
    in one: the codes start 16-byte aligned whatever the scales' length (wire format 6; in
    format 5 every access here was byte by byte). Two rows, fp32, the C++ codec's bytes. (At
    2^24 elements the host harness, a thread per CUDA thread, takes over 300 s per case; there
    `test_codes_and_messages_start_16_byte_aligned_at_every_size` holds the offset.)"""
    rows, group = 2, FORMATS[fmt].default_group
    assert wire.codes_offset(m, group, fmt) % 16 == 0
    want_codec = _codec(fmt, 4, None, "nearest", rows)
    got_codec = _codec(fmt, 4, None, "nearest", rows, kernels=cuda.KERNELS)
    x = _input(rows * m, m)
    on_host.vector_accesses()
    got = got_codec.encode(x, rows, m, 1.0, None, 0.0, list(range(rows)), None)
    encoded = on_host.vector_accesses()
    want = want_codec.encode(x, rows, m, 1.0, None, 0.0, list(range(rows)), None)
    assert torch.equal(got.messages, want.messages)
    lanes = rows * wire.ngroups(m, group) * group // 8
    assert encoded["code stores"] == lanes, encoded
    decoded = torch.empty(rows * m)
    cuda.KERNELS.decode_into(got.messages, m, 4, group, fmt, decoded,
                             torch.zeros(8, dtype=torch.uint8))
    loads = on_host.vector_accesses()["code loads"]
    assert loads == (lanes if m % 8 == 0 else 0), loads


@pytest.mark.parametrize("fmt,bits,group,rounding", _fast_first(WIRES, 2))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world,m,numel", _fast_first([(2, 1000, 1999), (3, 1001, 3001),
                                                       (2, 8, 15), (2, 1000, 2000),
                                                       (2, 4096, 8192)], 2))
def test_decode_rows_writes_the_row_by_row_decodes_and_casts(on_host, fmt, bits, group, rounding,
                                                             dtype, world, m, numel):
    """Every sender's rows, sender by sender; each row's sum over the senders cast into an
    output aligned or not (8 elements a thread, 16-byte stores where aligned, element by
    element otherwise), every row checked against shard ``q % n``; NaN everywhere where a
    row is foreign."""
    reference = _codec(fmt, bits, group, rounding, world)
    gathered = torch.cat([torch.stack([_received(reference, 1, m, r, 10 * s + r + m)[0]
                                       for r in range(world)]) for s in range(world)])
    want = torch.empty(numel, dtype=dtype)
    row = torch.empty(m)
    by_sender = gathered.view(world, world, -1)
    for r in range(world):
        lo, hi = r * m, min((r + 1) * m, numel)
        if lo < hi:
            reference.kernels.decode_sum(by_sender[:, r].contiguous(), m, bits,
                                         reference.group_size, fmt, row)
            want[lo:hi] = row[:hi - lo]
    header = reference.header(m)
    for aligned, foreign in ((True, False), (False, False), (True, True)):
        messages = gathered.clone()
        if foreign:
            messages[world + 1, 3] ^= 1
        room, out = _placed(numel, dtype, aligned)
        verdict = torch.zeros(8, dtype=torch.uint8)
        cuda.KERNELS.decode_rows(messages, world, m, bits, reference.group_size, fmt, out,
                                 verdict, header)
        assert verdict[0].item() == int(foreign)
        if foreign:
            assert bool(out.isnan().all())
        else:
            assert torch.equal(_bits(out), _bits(want))
        assert bool((room[:out.storage_offset()] == 3).all())  # nothing written around it
        assert bool((room[out.storage_offset() + numel:] == 3).all())


@pytest.mark.parametrize("fmt,bits,group,rounding", _fast_first(WIRES, 2))
@pytest.mark.parametrize("m", _fast_first([6144, 4099, 1, 7, 9, 1000], 2))
@pytest.mark.parametrize("dtype", _fast_first(DTYPES, 2))
def test_the_decodes_without_their_own_check_read_columns_and_write_any_alignment(
        on_host, fmt, bits, group, rounding, m, dtype):
    """`decode_sum` of a column of gathered messages (rows 3 shards apart) into an fp32
    output, and `decode_into` of 3 rows into ``dtype``, each aligned or not, the call's
    verdict read for its foreign byte (NaN everywhere where set)."""
    reference = _codec(fmt, bits, group, rounding, 3)
    gathered = torch.stack([torch.stack([_received(reference, 1, m, r, 7 * s + r)[0]
                                         for r in range(3)]) for s in range(3)])  # [3, 3, P]
    column = gathered[:, 1]
    want = torch.empty(m)
    reference.kernels.decode_sum(column.contiguous(), m, bits, reference.group_size, fmt, want)
    want_into = torch.empty(3 * m)
    reference.kernels.decode_into(gathered[0], m, bits, reference.group_size, fmt, want_into)
    for aligned in (True, False):
        for foreign in (False, True):
            verdict = torch.tensor([int(foreign)] + [0] * 7, dtype=torch.uint8)
            room, out = _placed(m, torch.float32, aligned)
            cuda.KERNELS.decode_sum(column, m, bits, reference.group_size, fmt, out, verdict)
            assert bool((room[:out.storage_offset()] == 3).all())  # nothing written around it
            assert bool((room[out.storage_offset() + m:] == 3).all())
            _, into = _placed(3 * m, dtype, aligned)
            cuda.KERNELS.decode_into(gathered[0], m, bits, reference.group_size, fmt, into,
                                     verdict)
            if foreign:
                assert bool(out.isnan().all()) and bool(into.isnan().all())
            else:
                assert torch.equal(_bits(out), _bits(want))
                assert torch.equal(_bits(into), _bits(want_into.to(dtype)))


@pytest.mark.parametrize("rows,m", [(1, 1000), (3, 4099)])
def test_the_check_and_checksum_kernels_answer_as_torch(on_host, rows, m):
    """`check` (`checksum`, `check_fold`) and `checksum` (`checksum_fold`) with checksums on:
    a row's corrupt payload or header is foreign, a flagged one non-finite."""
    reference = ShardCodec(bits=4, group_size=32, dtype_code=0, seq=9, world=rows, signature=5,
                           fmt="mxfp4", kernels=cpu.KERNELS, checksum=True)
    messages = reference.encode(_input(rows * m, m), rows, m, 1.0, None, 0.0, list(range(rows)),
                                None).messages
    header = reference.header(m)
    from lowbitcc.codec import reference as ref

    assert torch.equal(cuda.KERNELS.checksum(messages), ref.checksum(messages))
    for corrupt in (None, 40, 3, "flag"):
        bad = messages.clone()
        if corrupt == "flag":
            bad[rows - 1, wire.FLAGS_OFFSET] |= wire.FLAG_NONFINITE
        elif corrupt is not None:
            bad[rows - 1, corrupt] ^= 1
        want = framing.check_with_torch(cpu.KERNELS, bad, header, list(range(rows)), True)
        got = cuda.KERNELS.check(bad, header, list(range(rows)), True)
        assert (bool(got[0]), bool(got[1])) == (bool(want[0]), bool(want[1])) == (
            corrupt == "flag", corrupt in (40, 3))


def test_an_argument_of_another_size_than_its_parameter_is_refused(on_host):
    """The host launch checks each argument's bytes against its parameter's size, as
    cuLaunchKernel cannot: an int32 where the kernel takes a 64-bit count."""
    import numpy as np

    with pytest.raises(TypeError, match="size"):
        on_host.launch(cuda_build.CHECKSUM_FOLD, torch.device("cpu"), 1,
                       (np.uint64(0), np.int32(0), np.uint64(0)))
