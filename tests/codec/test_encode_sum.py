"""`CallCompressor.encode_sum`: the all-gather stage of an all-reduce of more than two ranks
(the own row's messages from every rank, summed in rank order and encoded again) in one CUDA
launch, ``encode_sum``, where the decode can check the rows itself; else `decode_sum` and an
encode, as on the CPU. On CPU: the launch's arguments (traced on ``device="meta"``) and when
the two launches stay. On a GPU (``-m gpu``): the same bytes, error states, sums and verdict
as the two launches, a foreign row included."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from lowbitcc import state
from lowbitcc.codec import cuda, framing, wire
from lowbitcc.codec.formats import FORMATS
from lowbitcc.codec.shard_codec import ShardCodec
from lowbitcc.compressor import CallCompressor, Source
from lowbitcc.counters import Stats
from lowbitcc.feedback import FeedbackStore
from tests.support.cuda_trace import GpuWork, meta_plan


def _traced_run(world: int, monkeypatch, feedback: bool = True) -> list[tuple[str, tuple]]:
    """The launches (kernel name, arguments) of the third run of rank 0's plan of an all-reduce
    of 1 Mi fp32 elements on the CUDA code branch (meta tensors)."""
    launched: list[tuple[str, tuple]] = []
    monkeypatch.setattr(cuda, "_launch", lambda name, device, grid, args: launched.append(
        (name, args)))
    monkeypatch.setattr(state, "FEEDBACK", FeedbackStore())
    monkeypatch.setattr(state, "STATS", Stats())
    plan, x, out = meta_plan(GpuWork(), world, 1 << 20, "mxfp4", feedback=feedback)
    for _ in range(3):
        launched.clear()
        plan.run(x, dist.ReduceOp.SUM, out)
    return launched


@pytest.mark.parametrize("world", [3, 4])
def test_the_all_gather_stage_sums_the_received_rows_inside_its_encode(world, monkeypatch):
    """One ``encode_sum`` between the two NCCL calls: it encodes one row of ``m`` elements
    (its source unread, no factor), sums the ``world`` received messages of rank 0's shard, P
    bytes apart, and checks their headers itself against shard 0 (step 0), every row."""
    launched = _traced_run(world, monkeypatch)
    assert [name.split("<")[0] for name, _ in launched] == [
        "loco_cuda::encode", "loco_cuda::encode_sum", "loco_cuda::decode_into"]
    name, (args, frame, source, check) = launched[1]
    m = -(-(1 << 20) // world)
    width = wire.payload_bytes(m, 4, FORMATS["mxfp4"].default_group, "mxfp4")
    assert name == "loco_cuda::encode_sum<4, 1, false, 1>"  # int8 error state, MXFP4
    assert (args["rows"], args["m"], args["numel"], args["scale_input"], args["P"]) == (
        1, m, m, 0, width)
    assert args["clear"] == 0  # the call's first encode cleared its verdict
    assert frame["enabled"] == 1 and frame["shard0"] == 0  # it frames its one row (rank 0's)
    assert (source["k"], source["stride"]) == (world, width)
    assert (check["check"], check["shard0"], check["shard_step"], check["rows"]) == (1, 0, 0, world)


def _meta_compressor(monkeypatch, checksum: bool) -> tuple[ShardCodec, CallCompressor, list]:
    """A 4-rank MXFP4 call's codec and compressor on the CUDA kernels (no feedback), and the
    kernels its launches name, recorded instead of launched."""
    launched: list[str] = []
    monkeypatch.setattr(cuda, "_launch", lambda name, device, grid, args: launched.append(
        name.split("<")[0].removeprefix("loco_cuda::")))
    codec = ShardCodec(bits=4, group_size=32, dtype_code=0, seq=1, world=4, signature=1,
                       fmt="mxfp4", kernels=cuda.KERNELS, checksum=checksum)
    comp = CallCompressor(codec, FeedbackStore(), "k", Stats(), error_dtype=None, beta=0.0,
                          reset_interval=0)
    return codec, comp, launched


def test_with_checksums_the_sum_is_decoded_before_its_encode(monkeypatch):
    """Checksums on: no decode checks its rows itself (`ShardCodec.sum_spec` is None), so the
    all-gather stage stays `decode_sum` and an encode, each row checked on its own."""
    codec, comp, launched = _meta_compressor(monkeypatch, checksum=True)
    m = 4096
    received = torch.empty(4, codec.message_bytes(m), dtype=torch.uint8, device="meta")
    comp.encode_sum("ag", received, m, 2, torch.empty(m, device="meta"))
    assert "encode_sum" not in launched and launched.count("decode_sum") == 1
    assert launched.count("encode") == 1


def test_a_sum_of_the_wrong_size_is_deferred_as_a_decode_defers_it(monkeypatch):
    """Received messages of another size: no fused launch; `decode_sum` meets the
    `wire.WireFormatError`, fills the sum with NaN and keeps the error for `raise_deferred`."""
    codec, comp, launched = _meta_compressor(monkeypatch, checksum=False)
    m = 4096
    comp.encode("rs", Source(torch.empty(4 * m, device="meta"), 4, m), [0, 1, 2, 3])
    short = torch.empty(4, codec.message_bytes(m) - 8, dtype=torch.uint8, device="meta")
    comp.encode_sum("ag", short, m, 2, torch.empty(m, device="meta"))
    assert "encode_sum" not in launched and launched.count("encode") == 2
    with pytest.raises(wire.WireFormatError, match="received a corrupt or foreign message"):
        comp.raise_deferred()


# -- on a GPU -----------------------------------------------------------------------------------
def _cupy_or_skip() -> None:
    pytest.importorskip("cupy", reason="CuPy is not installed (pip install lowbitcc[cuda])")
    if not cuda.available():
        pytest.skip("CuPy sees no GPU")


def _two_ways(codec: ShardCodec, received: torch.Tensor, m: int, shard: int,
              error_dtype: str | None, calls: int, monkeypatch) -> list[dict]:
    """``calls`` calls of the all-gather stage by `encode_sum` and by `decode_sum` + `encode`
    (each with its own store and statistics): per way, its messages, verdict, sums and error
    states after the last call, and the kernels it launched."""
    real = cuda._launch
    ways = []
    for fused in (True, False):
        launched: list[str] = []

        def launch(name, device, grid, args, launched=launched):
            launched.append(name.split("<")[0].removeprefix("loco_cuda::"))
            real(name, device, grid, args)

        monkeypatch.setattr(cuda, "_launch", launch)
        store, stats = FeedbackStore(), Stats()
        comp = CallCompressor(codec, store, "bucket", stats, error_dtype=error_dtype, beta=0.8,
                              reset_interval=0, rank=shard)
        for _ in range(calls):  # the same call again: the received rows stay its own
            comp.restart(codec, "bucket", None)
            scratch = torch.full((m,), 7.0, device="cuda")
            if fused:
                messages = comp.encode_sum("ag", received, m, shard, scratch)
            else:
                reduced = comp.decode_sum(received, m, shard, scratch)
                messages = comp.encode("ag", Source(reduced, 1, m), [shard])
            verdict = comp.foreign()
            comp.finish()
        ways.append({"messages": messages.cpu(), "verdict": comp._verdict.cpu(),
                     "sums": stats.accumulator("compressed", received.device).cpu(),
                     "states": store.state_dict()["states"], "launched": launched,
                     "foreign": bool(verdict)})
    return ways


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,bits,error_dtype,rounding", [
    ("mxfp4", 4, "int8", "nearest"), ("nvfp4", 4, None, "nearest"),
    ("nvfp4", 4, "bf16", "nearest"), ("int", 4, "fp32", "nearest"),
    ("int", 8, "int8", "nearest"), ("int", 4, "int8", "stochastic"),
    ("nvint3", 3, "int8", "nearest"), ("nvfp3", 3, None, "nearest")])
@pytest.mark.parametrize("world,m", [(3, 1000), (4, 100_003), (8, 4096)])
@pytest.mark.parametrize("foreign", [False, True], ids=["own", "foreign"])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
def test_cuda_encode_sum_writes_the_bytes_of_a_decode_then_an_encode(world, m, fmt, bits,
                                                                     error_dtype, rounding,
                                                                     foreign, offset,
                                                                     monkeypatch):
    """Unaligned rows (``offset`` 1) are checked by `Kernels.check` first, whose answer the
    launch reads from the verdict (`CudaKernels._row_check`)."""
    _cupy_or_skip()
    group = FORMATS[fmt].default_group
    codec = ShardCodec(bits=bits, group_size=group, dtype_code=0, seq=5, world=world,
                       signature=3, fmt=fmt, kernels=cuda.KERNELS, checksum=False,
                       rounding=rounding, seed=11)
    shard = world - 1
    torch.manual_seed(world * m)
    # every rank's message of `shard`, a column of gathered messages (rows 3 widths apart)
    width = codec.message_bytes(m)
    room = torch.zeros(world, 3 * width, dtype=torch.uint8, device="cuda")
    received = room[:, width + offset:2 * width + offset]
    for r in range(world):
        x = torch.randn(m, device="cuda") * (r + 1)
        sent = codec.encode(x, 1, m, 1.0, None, 0.0, [shard], None,
                            verdict=framing.new_verdict(torch.device("cuda")))
        received[r].copy_(sent.messages[0])
    if foreign:
        received[1, 3] ^= 1  # the magic
    fused, unfused = _two_ways(codec, received, m, shard, error_dtype, 2, monkeypatch)
    assert fused["launched"].count("encode_sum") == 2 and "decode_sum" not in fused["launched"]
    assert unfused["launched"].count("decode_sum") == 2 and "encode_sum" not in unfused["launched"]
    assert torch.equal(fused["messages"], unfused["messages"])
    assert torch.equal(fused["verdict"], unfused["verdict"])
    assert fused["foreign"] == unfused["foreign"] == foreign
    # one fp64 atomic add a warp, in no fixed order: equal but for the last bits
    torch.testing.assert_close(fused["sums"], unfused["sums"], rtol=1e-12, atol=0)
    assert bool(fused["sums"][1] > 0) != foreign  # the input squares of finite groups
    assert fused["states"].keys() == unfused["states"].keys()
    for key, got in fused["states"].items():
        want = unfused["states"][key]
        assert got["uses"] == want["uses"] and torch.equal(got["data"], want["data"])
        assert (got["scales"] is None) == (want["scales"] is None)
        if got["scales"] is not None:
            assert torch.equal(got["scales"], want["scales"])
    flags = fused["messages"][0, wire.FLAGS_OFFSET].item()
    assert bool(flags & wire.FLAG_NONFINITE) == foreign
    assert np.isfinite(fused["sums"].numpy()).all()


def test_an_encode_of_a_sum_is_refused_where_it_would_read_its_scratch(monkeypatch):
    """Kernels that do not fuse the sum refuse ``summed`` (they would encode the unread
    scratch), and `ShardCodec.encode` refuses it as a call's first encode (its clear would
    erase what the rows' check set)."""
    from lowbitcc.codec.interface import SumSpec
    from lowbitcc.codec.kernels import REFERENCE

    monkeypatch.setattr(cuda, "_launch", lambda *args: None)
    m = 4096
    for kernels, clear in ((REFERENCE, False), (cuda.KERNELS, True)):
        codec = ShardCodec(bits=4, group_size=32, dtype_code=0, seq=1, world=4, signature=1,
                           fmt="mxfp4", kernels=kernels, checksum=False)
        received = torch.empty(4, codec.message_bytes(m), dtype=torch.uint8, device="meta")
        verdict = torch.empty(8, dtype=torch.uint8, device="meta")
        spec = SumSpec(received, (codec.header(m), [2] * 4), verdict)
        with pytest.raises(ValueError, match="decode a sum inside the encode|not as the call's first"):
            codec.encode(torch.empty(m, device="meta"), 1, m, 1.0, None, 0.0, [2], None,
                         verdict=verdict, clear_verdict=clear, summed=spec)
