"""CUDA codec kernels: they compile without local-memory spills for sm_80 and sm_90 (nvcc, and
NVRTC through CuPy), and on a GPU they produce the reference's bytes, bit for bit."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowbitcc.codec import cuda, cuda_build
from lowbitcc.codec.formats import FORMATS
from lowbitcc.codec.kernels import select
from lowbitcc.codec.reference import FP4_FORMATS
from lowbitcc.codec.shard_codec import ShardCodec
from lowbitcc.tools import selftest

ARCHS = ("80", "90")


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    found = shutil.which("nvcc") or str(Path(home) / "bin" / "nvcc")
    return found if Path(found).exists() else None


@pytest.mark.slow  # NVRTC compiles every instance in the default suite; nvcc here
@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found (PATH, CUDA_HOME, /usr/local/cuda)")
def test_cuda_sources_compile_with_nvcc_without_spills(tmp_path):
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS]
    cmd = [_nvcc(), "-std=c++17", "--fmad=false", "-DLOCO_INSTANTIATE_ALL",
           f"-I{cuda_build.CSRC}", *gencode, "--fatbin", "-Xptxas", "-v", "--threads", "2",
           "-o", str(tmp_path / "codec.fatbin"), str(cuda_build.SOURCE)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _assert_clean_ptxas_log(proc.stdout + proc.stderr, ARCHS)


@pytest.mark.slow
@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found (PATH, CUDA_HOME, /usr/local/cuda)")
def test_cuda_source_compiles_for_host_and_device_with_nvcc(tmp_path):
    """``nvcc -c`` compiles the shared header's __host__ __device__ functions for the host too
    (it used to fail: quiet_nan called the device-only __int_as_float)."""
    cmd = [_nvcc(), "-std=c++17", "--fmad=false", "-DLOCO_INSTANTIATE_ALL", f"-I{cuda_build.CSRC}",
           "-gencode=arch=compute_80,code=sm_80", "-c", "-o", str(tmp_path / "codec.o"),
           str(cuda_build.SOURCE)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "codec.o").stat().st_size > 0


def _assert_clean_ptxas_log(log: str, archs: tuple[str, ...]) -> None:
    """ptxas -v output: every kernel instance built for every arch, no warning, no spill, no
    stack frame (local memory)."""
    assert "warning" not in log.lower(), log[-4000:]
    builds = 0
    for arch in archs:
        entries = re.findall(rf"Compiling entry function '(\w+)' for 'sm_{arch}'", log)
        # every instance the launcher can ask for is built (the kernels that are no template
        # in every part of a build in parts, `cuda_build.compile_with_nvrtc`)
        assert len(set(entries)) == len(cuda.name_expressions()), (arch, len(set(entries)))
        builds += len(entries)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    stacks = re.findall(r"(\d+) bytes stack frame", log)
    assert len(spills) == builds
    assert all(s == ("0", "0") for s in spills), "local-memory spills"
    assert all(s == "0" for s in stacks), "stack frames (local memory)"


def _cupy_or_skip():
    try:
        import cupy  # noqa: F401
    except ImportError:
        pytest.skip("CuPy is not installed (pip install lowbitcc[cuda])")
    if not cuda.available():
        pytest.skip("CuPy sees no GPU")


def _nvrtc_or_skip() -> None:
    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
    except Exception as exc:  # noqa: BLE001 (no CuPy, or no libnvrtc)
        pytest.skip(f"NVRTC is not available through CuPy ({type(exc).__name__}: {exc}); "
                    "pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12")
    if not cuda_build.include_dirs():
        pytest.skip("no CUDA headers (cuda_bf16.h) found for NVRTC")


@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.slow) if a != "90" else a
                                  for a in ARCHS])
@pytest.mark.timeout(600)  # every (format, width) instance: past 300 s on 2 busy cores
def test_cuda_sources_compile_with_nvrtc_without_spills(arch):
    """The same source through NVRTC, as CuPy's RawModule compiles it at run time (no GPU is
    needed to compile for a named architecture), in a part per core (about 35 s on two cores
    for sm_90's 168 instances, 63 s in one part); sm_80 with ``-m slow``, where nvcc also builds both."""
    _nvrtc_or_skip()
    build = cuda_build.compile_with_nvrtc(arch)
    _assert_clean_ptxas_log(build.log, (arch,))
    assert build.cubins and all(cubin[:4] == b"\x7fELF" for cubin in build.cubins)
    assert set(build.lowered) == set(cuda.name_expressions())
    assert all(name.startswith("_Z") for name in build.lowered.values())


@pytest.mark.gpu
def test_cuda_module_loads_every_kernel_on_the_gpu():
    _cupy_or_skip()
    module = cuda.module()
    for name in cuda.name_expressions():
        assert module.get_function(name) is not None


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.gpu
@given(
    rows=st.integers(1, 4), m=st.integers(1, 2500), wire=st.sampled_from(selftest.WIRES),
    group=st.sampled_from([8, 32, 128, 256]), dtype=st.sampled_from(DTYPES),
    error_dtype=st.sampled_from([None, "int8", "fp32", "bf16"]),
    with_state=st.booleans(), beta=st.sampled_from([0.0, 0.5, 0.8]),
    factor=st.sampled_from([1.0, 0.25, 1 / 3]), poison=st.sampled_from([None, "nan", "inf"]),
    seed=st.integers(0, 2**31 - 1), rounding=st.sampled_from(["nearest", "stochastic"]),
)
@settings(max_examples=200, deadline=None)
def test_cuda_kernels_match_reference_bitwise(rows, m, wire, group, dtype, error_dtype,
                                              with_state, beta, factor, poison, seed, rounding):
    """The selftest's comparison (messages, flags, new error state and scales, decode_sum,
    decode_into; decoded NaNs by position, as a NaN's payload is not specified: the GPU's
    arithmetic writes 0x7fffffff, x86's keeps the operand's 0x7fc00000) on hypothesis' cases."""
    _cupy_or_skip()
    bits, fmt = wire
    group, rounding = selftest.fit_to_format(fmt, group, rounding)
    case = selftest.Case(rows, m, bits, group, dtype, error_dtype, with_state, beta, factor,
                         poison, rounding, seed, fmt)
    assert selftest.compare_kernels(select("auto", "cuda"), "cuda", case) is None, case


@pytest.mark.gpu
@given(data=st.binary(min_size=0, max_size=600), rows=st.integers(1, 3), m=st.integers(1, 300))
@settings(max_examples=200, deadline=None)
def test_cuda_decoder_fuzz_random_bytes_give_nan_not_garbage(data, rows, m):
    """Random bytes on the GPU: a wrong size is refused before any kernel runs; a foreign
    header (checked on the device, without a host sync) turns every decoded value into NaN
    and flags the call non-finite."""
    from lowbitcc.codec import wire

    _cupy_or_skip()
    codec = ShardCodec(4, 64, 0, 7, 3, 99, kernels=select("auto", "cuda"))
    size = codec.message_bytes(m)
    raw = (data * (rows * size // max(len(data), 1) + 1))[: rows * size] if data else b""
    messages = torch.frombuffer(bytearray(raw.ljust(rows * size, b"\0")), dtype=torch.uint8)
    messages = messages.view(rows, size).cuda()
    out = torch.empty(rows * m, device="cuda")
    flagged = codec.decode_into(messages, m, list(range(rows)), out)
    assert bool(flagged) and bool(torch.isnan(out).all())
    total, flagged = codec.decode_sum(messages, m, 0)
    assert bool(flagged) and bool(torch.isnan(total).all())
    with pytest.raises(wire.WireFormatError):
        codec.decode_sum(messages[:, : size - 1 - len(data) % 3].contiguous(), m, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [40, 300, -1])
def test_cuda_decoder_turns_a_payload_that_fails_its_checksum_into_nan(offset):
    """The checksum computed on the GPU equals the CPU's, and a message whose scales, codes or
    trailer changed in transit decodes to NaN and flags the call, without a host sync."""
    from lowbitcc.codec import reference

    _cupy_or_skip()
    codec = ShardCodec(4, 64, 0, 7, 2, 99, kernels=select("auto", "cuda"))
    m = 1000
    messages = codec.encode(torch.randn(2 * m, device="cuda"), 2, m, 1.0, None, 0.0, [0, 0],
                            None).messages
    assert torch.equal(codec.kernels.checksum(messages).cpu(), reference.checksum(messages.cpu()))
    total, flagged = codec.decode_sum(messages, m, 0)
    assert not bool(flagged) and bool(torch.isfinite(total).all())
    messages[1, offset] ^= 0x10
    total, flagged = codec.decode_sum(messages, m, 0)
    assert bool(flagged) and bool(torch.isnan(total).all())


@pytest.mark.gpu
@given(rows=st.integers(1, 6), words=st.integers(0, 5000), seed=st.integers(0, 2**31 - 1),
       misaligned=st.booleans())
@settings(max_examples=200, deadline=None)
def test_cuda_fused_checksum_matches_reference(rows, words, seed, misaligned):
    """The fused checksum kernels (grid-stride sums, warp and block reductions, atomics, fold)
    give `reference.checksum`'s values on random bytes of any body length, including rows that
    need several blocks; rows not 8-byte aligned take the reference path and agree too."""
    from lowbitcc.codec import reference, wire

    _cupy_or_skip()
    width = wire.HEADER_BYTES + 8 * words + wire.TRAILER_BYTES
    gen = torch.Generator().manual_seed(seed)
    host = torch.randint(0, 256, (rows, width), dtype=torch.uint8, generator=gen)
    if misaligned:
        room = torch.empty(rows * width + 4, dtype=torch.uint8, device="cuda")
        messages = room[4:].view(rows, width)
        messages.copy_(host)
    else:
        messages = host.cuda()
    assert torch.equal(cuda.KERNELS.checksum(messages).cpu(), reference.checksum(host))


@pytest.mark.gpu
@given(rows=st.integers(1, 6), m=st.integers(1, 40000), seed=st.integers(0, 2**31 - 1),
       checksum=st.booleans(), data=st.data())
@settings(max_examples=100, deadline=None)
def test_cuda_frame_kernels_write_the_reference_bytes(rows, m, seed, checksum, data):
    """`CudaKernels.frame` (frame_body, frame_fold) on random bytes: the padding cleared, the
    headers with each row's shard and flags, the trailer and the answer as the reference's,
    with rows that need several blocks."""
    from lowbitcc.codec import wire
    from lowbitcc.codec.kernels import REFERENCE

    _cupy_or_skip()
    codec = ShardCodec(bits=4, group_size=32, dtype_code=0, seq=seed, world=7, signature=seed,
                       fmt="mxfp4", kernels=cuda.KERNELS)
    used, ng = wire.used_bytes(m, 4, 32, "mxfp4"), wire.ngroups(m, 32)
    gen = torch.Generator().manual_seed(seed)
    host = torch.randint(0, 256, (rows, codec.message_bytes(m)), dtype=torch.uint8, generator=gen)
    nonfinite = (torch.rand(rows * ng, generator=gen) < 0.5 / ng).to(torch.uint8)
    shard0 = data.draw(st.integers(0, 100))
    shards = list(range(shard0, shard0 + rows))
    flags = data.draw(st.sampled_from([0, wire.FLAG_PEER_ERROR]))
    messages = host.cuda()
    answer = cuda.KERNELS.frame(messages, codec.header(m), shards, nonfinite.cuda(), used, flags,
                                checksum)
    want = REFERENCE.frame(host, codec.header(m), shards, nonfinite, used, flags, checksum)
    assert torch.equal(messages.cpu(), host)
    assert bool(answer) == want


@pytest.mark.gpu
@given(rows=st.integers(1, 6), m=st.integers(1, 40000), seed=st.integers(0, 2**31 - 1),
       checksum=st.booleans(), same_shard=st.booleans(), data=st.data())
@settings(max_examples=100, deadline=None)
def test_cuda_check_kernels_give_the_torch_verdict(rows, m, seed, checksum, same_shard, data):
    """`CudaKernels.check` (checksum, check_fold) on encoded messages with one byte changed
    anywhere (or none), contiguous or rows apart: the (non-finite, foreign) answers of
    `framing.check_with_torch`."""
    from lowbitcc.codec.framing import check_with_torch
    from lowbitcc.codec.kernels import REFERENCE

    _cupy_or_skip()
    codec = ShardCodec(bits=4, group_size=32, dtype_code=0, seq=seed, world=7, signature=seed,
                       fmt="mxfp4", kernels=REFERENCE)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows * m, generator=gen)
    shards = [3] * rows if same_shard else list(range(3, 3 + rows))
    host = codec.encode(x, rows, m, 1.0, None, 0.0, shards, None).messages
    if data.draw(st.booleans()):
        r = data.draw(st.integers(0, rows - 1))
        at = data.draw(st.integers(0, host.shape[1] - 1))
        host[r, at] ^= data.draw(st.sampled_from([1, 2, 4, 128]))
    want = check_with_torch(REFERENCE, host, codec.header(m), shards, checksum)
    messages = host.cuda()
    if data.draw(st.booleans()):  # rows apart, as a column of gathered messages
        room = torch.zeros(rows, 3 * host.shape[1], dtype=torch.uint8, device="cuda")
        messages = room[:, :host.shape[1]]
        messages.copy_(host)
    got = cuda.KERNELS.check(messages, codec.header(m), shards, checksum)
    assert (bool(got[0]), bool(got[1])) == (bool(want[0]), bool(want[1]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_decodes_read_columns_in_place_and_write_nan_from_the_verdict(dtype):
    """The decodes read a column of gathered messages where it lies (the row stride) with the
    values of its contiguous copy; with the call's verdict, they write NaN where its foreign
    byte is set; encode's frame and a check write the verdict's bytes on the device."""
    from lowbitcc.codec import framing

    _cupy_or_skip()
    m, rows = 1000, 3
    codec = ShardCodec(bits=4, group_size=32, dtype_code=0, seq=1, world=rows, signature=1,
                       fmt="mxfp4", kernels=cuda.KERNELS)
    x = torch.randn(rows * m, device="cuda")
    messages = codec.encode(x, rows, m, 1.0, None, 0.0, list(range(rows)), None).messages
    column = torch.stack([messages, messages])[:, 1]  # row 1 of two ranks, 3 rows apart
    verdict = framing.new_verdict(torch.device("cuda"))
    in_place, copied = torch.empty(m, device="cuda"), torch.empty(m, device="cuda")
    cuda.KERNELS.decode_sum(column, m, 4, 32, "mxfp4", in_place, verdict)
    cuda.KERNELS.decode_sum(column.contiguous(), m, 4, 32, "mxfp4", copied)
    assert torch.equal(in_place, copied) and bool(torch.isfinite(in_place).all())
    nonfinite, foreign = codec.check_on_device(column, m, [1, 1], verdict)
    assert not bool(nonfinite) and not bool(foreign)
    bad = column.contiguous()
    bad[0, 3] ^= 1  # the magic
    codec.check_on_device(bad, m, [1, 1], verdict)
    assert verdict.tolist()[:2] == [1, 0]
    out = torch.empty(m, device="cuda")
    cuda.KERNELS.decode_sum(column, m, 4, 32, "mxfp4", out, verdict)
    into = torch.empty(rows * m, dtype=dtype, device="cuda")
    cuda.KERNELS.decode_into(messages, m, 4, 32, "mxfp4", into, verdict)
    assert bool(out.isnan().all()) and bool(into.isnan().all())
    poisoned = x.clone()
    poisoned[5] = float("nan")
    fresh = framing.new_verdict(torch.device("cuda"))
    codec.encode(poisoned, rows, m, 1.0, None, 0.0, list(range(rows)), None, verdict=fresh)
    assert fresh.tolist()[:2] == [0, 1]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FP4_FORMATS)
@pytest.mark.parametrize("error_dtype", ["int8", "fp32"])
def test_cuda_encode_reads_a_state_s_poison_word(error_dtype, fmt):
    """A state whose poison word is set encodes as no state at all (``has_error`` 0); a word of
    zero leaves it applied; the encode's new state carries no word."""
    from lowbitcc.codec import framing
    from lowbitcc.codec.error_state import ErrorState

    _cupy_or_skip()
    m, rows, group = 4096, 2, FORMATS[fmt].default_group
    codec = ShardCodec(bits=4, group_size=group, dtype_code=0, seq=1, world=rows, signature=1,
                       fmt=fmt, kernels=cuda.KERNELS)
    x = torch.randn(rows * m, device="cuda")
    error = torch.randn(rows * m, device="cuda") * 0.1

    def encode(word):
        state = ErrorState.encode(error, error_dtype, group)
        if word is not None:
            state.poison = torch.tensor([word], dtype=torch.int64, device="cuda").view(torch.uint8)
        return codec.encode(x, rows, m, 1.0, state, 0.8, [0, 1], error_dtype,
                            verdict=framing.new_verdict(torch.device("cuda")))

    none = codec.encode(x, rows, m, 1.0, None, 0.8, [0, 1], error_dtype)
    voided, kept, plain = encode(1 << 8), encode(0), encode(None)
    assert torch.equal(voided.messages, none.messages)
    assert torch.equal(voided.error.data, none.error.data)
    assert torch.equal(kept.messages, plain.messages)
    assert not torch.equal(kept.messages, none.messages)
    assert voided.error.poison is None and kept.error.poison is None


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FP4_FORMATS)
@pytest.mark.parametrize("into", [False, True], ids=["decode_sum", "decode_into"])
def test_cuda_decodes_that_check_the_rows_themselves_answer_as_check(into, fmt):
    """With the call's header (`ShardCodec._fused_check`: a verdict, checksums off) a decode
    checks the rows in its own launch: the same values and verdict bytes as `check` and then
    the decode, for the call's messages, a foreign one (NaN everywhere) and a non-finite one."""
    from lowbitcc.codec import framing

    _cupy_or_skip()
    m, rows, group = 3000, 3, FORMATS[fmt].default_group
    codec = ShardCodec(bits=4, group_size=group, dtype_code=0, seq=1, world=rows, signature=1,
                       fmt=fmt, kernels=cuda.KERNELS, checksum=False)
    x = torch.randn(rows * m, device="cuda")
    bad = x.clone()
    bad[7] = float("inf")
    for source, corrupt in [(x, False), (x, True), (bad, False)]:
        messages = codec.encode(source, rows, m, 1.0, None, 0.0, list(range(rows)), None).messages
        if corrupt:
            messages[1, 3] ^= 1
        answers = []
        for fused in (True, False):
            verdict = framing.new_verdict(torch.device("cuda"))
            out = torch.empty(rows * m if into else m, device="cuda")
            shards = list(range(rows)) if into else [1] * rows
            column = messages if into else torch.stack([messages[1]] * rows)
            if fused:
                if into:
                    codec.decode_into(column, m, shards, out, verdict)
                else:
                    codec.decode_sum(column, m, 1, out, verdict)
            else:
                codec.check_on_device(column, m, shards, verdict)
                decode = cuda.KERNELS.decode_into if into else cuda.KERNELS.decode_sum
                decode(column, m, 4, group, fmt, out, verdict)
            answers.append((out.cpu(), verdict.tolist()[:2]))
        (got, got_verdict), (want, want_verdict) = answers
        assert got_verdict == want_verdict
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
        assert got_verdict[0] == int(corrupt)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FP4_FORMATS)
@pytest.mark.parametrize("rows,m", [(1, 1000), (2, 4096), (3, 777), (4, 100_003)])
def test_cuda_encode_frames_its_messages_as_frame_does(rows, m, fmt):
    """With the call's verdict and checksums off the encode frames its messages itself (the
    last block to finish writes headers, padding and trailers): the same bytes and verdict as
    the encode without a verdict followed by `frame`, call after call (the per-stream words it
    counts in are left zero), a non-finite call's flags not leaking into the next one."""
    from lowbitcc.codec import framing

    _cupy_or_skip()
    codec = ShardCodec(bits=4, group_size=FORMATS[fmt].default_group, dtype_code=0, seq=1,
                       world=rows, signature=1, fmt=fmt, kernels=cuda.KERNELS, checksum=False)
    gen = torch.Generator().manual_seed(rows)
    finite = torch.randn(rows * m, generator=gen).cuda()
    bad = finite.clone()
    bad[-1] = float("nan")
    for x in (finite, bad, finite, bad, bad, finite):
        verdict = framing.new_verdict(torch.device("cuda"), cleared_by_encode=True)
        verdict.fill_(0xAB)  # the encode must clear what the memory held
        fused = codec.encode(x, rows, m, 1.0, None, 0.0, list(range(rows)), None,
                             verdict=verdict, clear_verdict=True)
        plain = codec.encode(x, rows, m, 1.0, None, 0.0, list(range(rows)), None)
        assert torch.equal(fused.messages, plain.messages)
        assert verdict.tolist() == [0, int(bool(x.isnan().any())), 0, 0, 0, 0, 0, 0]
        assert bool(fused.nonfinite) == bool(plain.nonfinite)


@pytest.mark.gpu
def test_cuda_decode_into_checks_every_row_also_past_its_output():
    """A clipped output (the last shard's tail) still has every received row checked: a foreign
    last row sets the verdict although none of its elements is decoded."""
    from lowbitcc.codec import framing

    _cupy_or_skip()
    m, rows = 1000, 4
    codec = ShardCodec(bits=4, group_size=32, dtype_code=0, seq=1, world=rows, signature=1,
                       fmt="mxfp4", kernels=cuda.KERNELS, checksum=False)
    messages = codec.encode(torch.randn(rows * m, device="cuda"), rows, m, 1.0, None, 0.0,
                            list(range(rows)), None).messages
    messages[rows - 1, 3] ^= 1
    verdict = framing.new_verdict(torch.device("cuda"))
    out = torch.empty((rows - 1) * m, device="cuda")
    codec.decode_into(messages, m, list(range(rows)), out, verdict)
    assert verdict.tolist()[:2] == [1, 0]
    assert bool(out.isnan().all())
