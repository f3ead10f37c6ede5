"""The CUDA decode kernels (`decode_sum`, `decode_into`, `decode_rows` of ``cuda_codec.cu``)
compiled by g++ for the host and run thread by thread as the launcher grids them
(``tests/support/cuda_on_host``: CUDA's keywords, types and intrinsics on the host), against
the C++ codec: the same values bit for bit, for every wire, sizes that do and do not fill a
thread's ``kDecodeVec`` elements, group sizes that are and are not multiples of it, outputs
that are and are not 16-byte aligned, columns of gathered messages, and NaN everywhere where
the call's verdict says a message was foreign. No GPU: what this holds is the kernels'
indexing, their vector path and their casts; the kernels' own row check (which needs a
block's threads together) and the encodes (warp shuffles) are not run here."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from lowbitcc.codec import cpu, cuda_build
from lowbitcc.codec.abi import FORMAT_CODES
from lowbitcc.codec.formats import FORMATS
from lowbitcc.codec.kernels import REFERENCE
from lowbitcc.codec.shard_codec import ShardCodec

HOST = Path(__file__).resolve().parents[1] / "support" / "cuda_on_host"
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
WIRES = [("int", 2, None), ("int", 4, None), ("int", 8, None), ("int", 4, 12), ("mxfp4", 4, None),
         ("nvfp4", 4, None)]
"""(format, bits, group size; None: the format's default): 12 is not a multiple of
``kDecodeVec``, so its decodes take the element-by-element path."""


@pytest.fixture(scope="module")
def host(tmp_path_factory) -> ctypes.CDLL:
    compiler = shutil.which("g++")
    if compiler is None or cpu.load() is None:
        pytest.skip("g++ or the C++ codec is missing")
    library = tmp_path_factory.mktemp("cuda_on_host") / "decodes.so"
    done = subprocess.run([compiler, "-std=c++17", "-O1", "-ffp-contract=off", "-fPIC", "-shared",
                           "-Wno-unknown-pragmas", f"-I{HOST}", f"-I{cuda_build.CSRC}", "-o",
                           str(library), str(HOST / "driver.cpp")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return ctypes.CDLL(str(library))


def _codec(fmt: str, bits: int, group: int | None, world: int) -> ShardCodec:
    """The C++ codec's (the reference's for groups that are not a multiple of 8, which the
    C++ codec refuses; the two give the same bytes, `tests/codec/test_kernels.py`)."""
    group = group or FORMATS[fmt].default_group
    return ShardCodec(bits=bits, group_size=group, dtype_code=0, seq=7, world=world,
                      signature=5, fmt=fmt, kernels=cpu.KERNELS if group % 8 == 0 else REFERENCE,
                      checksum=False)


def _messages(codec: ShardCodec, rows: int, m: int, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    x = torch.randn(rows * m) * torch.logspace(-3, 3, rows * m)[torch.randperm(rows * m)]
    return codec.encode(x, rows, m, 1.0, None, 0.0, list(range(rows)), None).messages


def _placed(n: int, dtype: torch.dtype, aligned: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A flat output of ``n`` elements (inside a larger buffer), 16-byte aligned or not."""
    room = torch.full((n + 16,), 3.0, dtype=dtype)
    skip = (-room.data_ptr() % 16) // room.element_size() + (0 if aligned else 1)
    return room, room[skip:skip + n]


def _verdict(foreign: bool) -> torch.Tensor:
    return torch.tensor([int(foreign), 0, 0, 0, 0, 0, 0, 0], dtype=torch.uint8)


def _same(got: torch.Tensor, want: torch.Tensor, foreign: bool) -> None:
    if foreign:
        assert bool(got.isnan().all())
        return
    bits = torch.int32 if got.dtype == torch.float32 else torch.int16
    assert torch.equal(got.view(bits), want.view(bits))


P = ctypes.c_void_p
L = ctypes.c_longlong
I = ctypes.c_int  # noqa: E741 (ctypes' names)


@pytest.mark.parametrize("fmt,bits,group", WIRES)
@pytest.mark.parametrize("m", [1, 7, 8, 9, 100, 1000, 4099, 6144])
@pytest.mark.parametrize("foreign", [False, True], ids=["own", "foreign"])
def test_decode_sum_on_the_host_is_the_cpu_codec_s(host, fmt, bits, group, m, foreign):
    """Three ranks' messages of one shard as a column of gathered messages (rows 3 shards
    apart); the fp32 output 16-byte aligned where the size allows, else not."""
    codec = _codec(fmt, bits, group, 3)
    gathered = torch.stack([_messages(codec, 3, m, seed) for seed in range(3)])  # [3, 3, P]
    column = gathered[:, 1]
    want = torch.empty(m)
    codec.kernels.decode_sum(column.contiguous(), m, bits, codec.group_size, fmt, want)
    verdict = _verdict(foreign)  # (held: ctypes keeps only its address)
    for aligned in (True, False):
        room, out = _placed(m, torch.float32, aligned)
        host.host_decode_sum(I(bits), I(FORMAT_CODES[fmt]), P(column.data_ptr()), L(3),
                             L(column.stride(0)), L(m), I(codec.group_size), P(out.data_ptr()),
                             P(verdict.data_ptr()))
        _same(out, want, foreign)
        assert bool((room[:out.storage_offset()] == 3).all())  # nothing written before it
        assert bool((room[out.storage_offset() + m:] == 3).all())  # nor after


def _into_reference(codec: ShardCodec, messages: torch.Tensor, m: int, numel: int,
                    dtype: torch.dtype) -> torch.Tensor:
    want = torch.empty(numel, dtype=dtype)
    row = torch.empty(m)
    for r in range(messages.shape[0]):
        lo, hi = r * m, min((r + 1) * m, numel)
        if lo < hi:
            codec.kernels.decode_sum(messages[r:r + 1], m, codec.bits, codec.group_size, codec.fmt,
                                   row)
            want[lo:hi] = row[:hi - lo]  # torch's cast
    return want


@pytest.mark.parametrize("fmt,bits,group", WIRES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("m,numel", [(8, 30), (1000, 3000), (1000, 2999), (1001, 4004),
                                     (4096, 12000)])
def test_decode_into_on_the_host_is_the_cpu_codec_s(host, fmt, bits, group, dtype, m, numel):
    """Rows cast into an output of ``numel`` (a partial last row too), aligned or not."""
    codec = _codec(fmt, bits, group, 4)
    messages = _messages(codec, 4, m, m + numel)
    want = _into_reference(codec, messages, m, numel, dtype)
    for aligned in (True, False):
        for foreign in (False, True):
            _, out = _placed(numel, dtype, aligned)
            verdict = _verdict(foreign)
            host.host_decode_into(I(DTYPES[dtype]), I(bits), I(FORMAT_CODES[fmt]),
                                  P(messages.data_ptr()), L(messages.shape[1]), L(m),
                                  I(codec.group_size), L(numel), P(out.data_ptr()),
                                  P(verdict.data_ptr()))
            _same(out, want, foreign)


@pytest.mark.parametrize("fmt,bits,group", WIRES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("world,m,numel", [(2, 8, 15), (2, 1000, 2000), (2, 1000, 1999),
                                           (3, 1001, 3001), (2, 4096, 8192)])
def test_decode_rows_on_the_host_is_the_cpu_codec_s(host, fmt, bits, group, dtype, world, m,
                                                    numel):
    """Every sender's rows, sender by sender, each row's sum over the senders cast into the
    output (what `CallPlan._gather` decoded row by row), aligned or not; and without the
    call's verdict (null), as a launch given none."""
    codec = _codec(fmt, bits, group, world)
    gathered = torch.cat([_messages(codec, world, m, 10 * s + m) for s in range(world)])
    want = torch.empty(numel, dtype=dtype)
    row = torch.empty(m)
    by_sender = gathered.view(world, world, -1)
    for r in range(world):
        lo, hi = r * m, min((r + 1) * m, numel)
        if lo < hi:
            codec.kernels.decode_sum(by_sender[:, r].contiguous(), m, bits, codec.group_size, fmt,
                                   row)
            want[lo:hi] = row[:hi - lo]
    for aligned, verdict in ((True, _verdict(False)), (False, _verdict(False)), (True, None),
                             (False, _verdict(True))):
        _, out = _placed(numel, dtype, aligned)
        host.host_decode_rows(I(DTYPES[dtype]), I(bits), I(FORMAT_CODES[fmt]),
                              P(gathered.data_ptr()), L(world), L(world), L(gathered.shape[1]),
                              L(m), I(codec.group_size), L(numel), P(out.data_ptr()),
                              P(None if verdict is None else verdict.data_ptr()))
        _same(out, want, verdict is not None and bool(verdict[0]))
