"""`CallCompressor.decode_rows`: the two-rank all-reduce's decode of every row of the gathered
messages (each row's messages of both ranks summed in rank order, cast into the output) in one
CUDA launch, ``decode_rows``, where the decode can check the rows itself; else `decode_sum`
row by row, as on the CPU. On CPU: the launch's arguments (traced on ``device="meta"``) and
when the row-by-row decodes stay. On a GPU (``-m gpu``): the values of the row-by-row decodes
and casts, a foreign row and rows that are not 8-byte aligned included."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lowbitcc import state
from lowbitcc.codec import cuda, framing, wire
from lowbitcc.codec.formats import FORMATS
from lowbitcc.codec.shard_codec import ShardCodec
from lowbitcc.compressor import CallCompressor
from lowbitcc.counters import Stats
from lowbitcc.feedback import FeedbackStore
from tests.support.cuda_trace import GpuWork, meta_plan


@pytest.mark.parametrize("numel", [1 << 20, (1 << 20) - 5])
def test_a_two_rank_plan_decodes_every_row_in_one_launch(numel, monkeypatch):
    """One ``decode_rows`` after the NCCL all-gather: both ranks' messages of both rows, P
    bytes apart, summed into the output's ``numel`` elements (a partial last row too), every
    one of the 4 rows checked against shard ``q % 2``."""
    launched: list[tuple[str, tuple]] = []
    monkeypatch.setattr(cuda, "_launch", lambda name, device, grid, args: launched.append(
        (name, args)))
    monkeypatch.setattr(state, "FEEDBACK", FeedbackStore())
    monkeypatch.setattr(state, "STATS", Stats())
    plan, x, _ = meta_plan(GpuWork(), 2, numel, "mxfp4", feedback=False)
    for _ in range(3):
        launched.clear()
        plan.run(x, dist.ReduceOp.SUM)
    assert [name for name, _ in launched] == [
        "loco_cuda::encode<float, 4, 0, false, 1>", "loco_cuda::decode_rows<float, 4, 1>"]
    _, (messages, senders, n, width, m, group, count, out, verdict, check) = launched[1]
    assert (senders, n, m, group, count) == (2, 2, -(-numel // 2), 32, numel)
    assert width == wire.payload_bytes(int(m), 4, 32, "mxfp4")
    assert (check["check"], check["shard0"], check["shard_step"], check["rows"],
            check["shard_mod"]) == (1, 0, 1, 4, 2)


def test_rows_that_are_not_8_byte_aligned_are_checked_before_the_launch(monkeypatch):
    """Where the rows cannot be read as words (`cuda_args.aligned_stride` None), `check` runs
    first (of every row, whose shards repeat: ``[0, 1, 0, 1]``) and the launch reads its
    answer from the verdict (a `cuda_args.row_check` without a header: ``check`` 0)."""
    launched: list[tuple[str, tuple]] = []
    checked: list[list[int]] = []
    monkeypatch.setattr(cuda, "_launch", lambda name, device, grid, args: launched.append(
        (name, args)))
    monkeypatch.setattr(cuda, "aligned_stride", lambda messages: None)
    monkeypatch.setattr(cuda.KERNELS, "check", lambda messages, header, shards, checksum,
                        verdict: checked.append(shards))
    codec = _codec()
    m = 4096
    gathered = torch.empty(4, codec.message_bytes(m), dtype=torch.uint8, device="meta")
    verdict = framing.new_verdict(torch.device("meta"))
    comp = CallCompressor(codec, FeedbackStore(), "k", Stats(), error_dtype=None, beta=0.0,
                          reset_interval=0)
    comp.restart(codec, "k", None, verdict)
    assert comp.decode_rows(gathered, 2, m, torch.empty(2 * m, device="meta"))
    assert [name.split("<")[0] for name, _ in launched] == ["loco_cuda::decode_rows"]
    assert launched[0][1][-1]["check"] == 0 and checked == [[0, 1, 0, 1]]


def _codec(kernels=cuda.KERNELS, checksum: bool = False, world: int = 2,
           fmt: str = "mxfp4", bits: int = 4) -> ShardCodec:
    return ShardCodec(bits=bits, group_size=FORMATS[fmt].default_group, dtype_code=0, seq=3,
                      world=world, signature=1, fmt=fmt, kernels=kernels, checksum=checksum)


@pytest.mark.parametrize("why", ["checksums", "wrong size", "empty output"])
def test_the_rows_are_decoded_one_by_one_where_one_launch_cannot_check_them(why, monkeypatch):
    """Checksums on, gathered messages of another size (whose `wire.WireFormatError` the
    row-by-row decodes meet and defer) or nothing to write: `decode_rows` does nothing and
    says so."""
    launched: list[str] = []
    monkeypatch.setattr(cuda, "_launch", lambda name, device, grid, args: launched.append(name))
    codec = _codec(checksum=why == "checksums")
    comp = CallCompressor(codec, FeedbackStore(), "k", Stats(), error_dtype=None, beta=0.0,
                          reset_interval=0)
    m = 4096
    width = codec.message_bytes(m) - (8 if why == "wrong size" else 0)
    gathered = torch.empty(4, width, dtype=torch.uint8, device="meta")
    out = torch.empty(0 if why == "empty output" else 2 * m, device="meta")
    assert comp.decode_rows(gathered, 2, m, out) is False
    assert launched == []


# -- on a GPU -----------------------------------------------------------------------------------
def _cupy_or_skip() -> None:
    pytest.importorskip("cupy", reason="CuPy is not installed (pip install lowbitcc[cuda])")
    if not cuda.available():
        pytest.skip("CuPy sees no GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,bits", [("mxfp4", 4), ("nvfp4", 4), ("int", 4), ("int", 8),
                                      ("nvint3", 3), ("nvfp3", 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("world,numel", [(2, 2000), (2, 200_001), (3, 3001)])
@pytest.mark.parametrize("foreign", [False, True], ids=["own", "foreign"])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
def test_cuda_decode_rows_writes_the_values_of_the_row_by_row_decodes(fmt, bits, dtype, world,
                                                                      numel, foreign, offset):
    """Every sender's rows encoded, gathered sender by sender (``offset`` 1: not 8-byte
    aligned, checked by `Kernels.check` first); `decode_rows` against `decode_sum` per row
    and a cast: the same values and verdict; where a row is foreign, NaN everywhere (the
    row-by-row decodes make only that row NaN; the call raises either way)."""
    _cupy_or_skip()
    codec = _codec(world=world, fmt=fmt, bits=bits)
    m = -(-numel // world)
    width = codec.message_bytes(m)
    torch.manual_seed(numel + world)
    room = torch.zeros(world * world * width + 8, dtype=torch.uint8, device="cuda")
    gathered = room[offset:offset + world * world * width].view(world * world, width)
    for s in range(world):
        x = torch.randn(numel, device="cuda") * (s + 1)
        sent = codec.encode(x, world, m, 1.0, None, 0.0, list(range(world)), None,
                            verdict=framing.new_verdict(torch.device("cuda")))
        gathered[s * world:(s + 1) * world].copy_(sent.messages)
    if foreign:
        gathered[world + 1, 3] ^= 1  # the magic of sender 1's message of row 1
    comp = CallCompressor(codec, FeedbackStore(), "k", Stats(), error_dtype=None, beta=0.0,
                          reset_interval=0)
    fused = torch.full((numel,), 5.0, dtype=dtype, device="cuda")
    assert comp.decode_rows(gathered, world, m, fused)
    row_by_row = torch.full((numel,), 5.0, dtype=dtype, device="cuda")
    other = CallCompressor(codec, FeedbackStore(), "k", Stats(), error_dtype=None, beta=0.0,
                           reset_interval=0)
    by_sender = gathered.view(world, world, width)
    for r in range(world):
        lo, hi = r * m, min((r + 1) * m, numel)
        row_by_row[lo:hi].copy_(other.decode_sum(by_sender[:, r], m, r)[:hi - lo])
    assert bool(comp.foreign()) == bool(other.foreign()) == foreign
    assert torch.equal(comp._verdict, other._verdict)
    if foreign:  # every value NaN (as `decode_into`'s), row by row only the foreign row's; a
        # NaN's payload may differ between CUDA's casts and torch's
        assert bool(fused.isnan().all()) and bool(row_by_row[m:2 * m].isnan().all())
        assert bool(row_by_row[:m].isfinite().all())
    else:  # bit for bit (torch.equal takes -0.0 for 0.0)
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        assert torch.equal(fused.view(bits), row_by_row.view(bits))
        assert bool(fused.isfinite().all())
