"""Every schedule, in one process: ranks are threads over an in-memory `Transport`.

The fast companions of tests/schedules/test_schedules.py (real processes over gloo and MPI):
the same properties (bitwise-identical all-reduce results on every rank, the reduce-scatter's
rows, error within the quantizer's bound for the schedule's number of quantizations) in well
under a second per case, so schedule changes can be checked at once.
"""

from __future__ import annotations

import threading

import pytest
import torch

from lowbitcc import schedules
from lowbitcc.codec import kernels, wire
from lowbitcc.codec.shard_codec import ShardCodec
from lowbitcc.compressor import CallCompressor, Source
from lowbitcc.counters import Stats
from lowbitcc.feedback import FeedbackStore
from lowbitcc.transports import topology
from tests.support.memory_transport import MemoryGroup, memory_links
from tests.support.numerics import group_amax
from tests.support.schedule_checks import bound_factor

NODE_SIZE = {2: 1, 3: 1, 4: 2, 6: 3}
Q = 7  # 4-bit codes


def _quantizations(name: str, collective: str, world: int) -> int:
    nodes = world // NODE_SIZE[world]
    two = collective == "all_reduce"
    # direct's all-reduce on two ranks (and hierarchical's over two nodes) is one all-gather
    return {"direct": 2 if two and world > 2 else 1, "ring": world if two else world - 1,
            "tree": schedules.tree.depth(world) + 1,
            "hierarchical": 0 if nodes == 1 else (2 if two and nodes > 2 else 1)}[name]


def _run(name: str, collective: str, world: int, numel: int, chunk: int) -> list[torch.Tensor]:
    group = MemoryGroup(world)
    inputs = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    results: list = [None] * world
    errors: list = []
    m = -(-numel // world)

    def rank_main(rank: int) -> None:
        try:
            layout = topology.layout(range(world), rank, NODE_SIZE[world])
            links = memory_links(group, rank, layout)
            codec = ShardCodec(bits=4, group_size=64, dtype_code=0, seq=1, world=world,
                               signature=wire.call_signature(collective, numel, torch.float32),
                               kernels=kernels.REFERENCE)
            comp = CallCompressor(codec, FeedbackStore(), "k", Stats(), error_dtype="int8",
                                  beta=0.8, reset_interval=0, rank=rank)
            source = Source(inputs[rank], world, m)
            if collective == "all_reduce":
                out = torch.empty(numel)
                schedules.all_reduce(name, source, out, comp, links, chunk)
            else:
                out = schedules.reduce_scatter(name, source, comp, links, chunk)
            comp.finish()
            results[rank] = out
        except BaseException as exc:  # noqa: BLE001 (re-raised by the test)
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a schedule hung"
    if errors:
        raise errors[0]
    exact = torch.stack(inputs).double().sum(dim=0)
    # docs/algorithms.md: each quantization errs by at most half a step of its group's max;
    # A is the sum over ranks of each element's group max
    amax = sum(group_amax(x, world, 64) for x in inputs)
    bound = amax * bound_factor(_quantizations(name, collective, world)) * 1.001 + 1e-6
    if collective == "all_reduce":
        assert all(torch.equal(results[0], r) for r in results), "ranks differ"
        assert float(((results[0].double() - exact).abs() / bound).max()) <= 1.0
    else:
        for rank, out in enumerate(results):
            lo, hi = rank * m, min((rank + 1) * m, numel)
            err = (out[:hi - lo].double() - exact[lo:hi]).abs() / bound[lo:hi]
            assert float(err.max()) <= 1.0
    return results


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("world", [2, 3, 4, 6])
@pytest.mark.parametrize("name", schedules.NAMES)
def test_schedule_in_memory(name, world, collective):
    _run(name, collective, world, numel=1000 * world + 7, chunk=0)


@pytest.mark.parametrize(("name", "world"), [("direct", 2), ("direct", 3), ("ring", 3)])
def test_chunked_schedule_gives_the_same_bytes_with_nearest_rounding(name, world):
    whole = _run(name, "all_reduce", world, numel=world * 900 + 5, chunk=0)
    chunked = _run(name, "all_reduce", world, numel=world * 900 + 5, chunk=256)
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked))


@pytest.mark.parametrize("chunk", [0, 256])
def test_direct_all_reduce_on_two_ranks_sums_each_ranks_own_codes_once(chunk):
    """On two ranks the all-reduce is one all-gather of each rank's codes of its whole input:
    the result is, bit for bit, rank 0's decoded codes plus rank 1's (no second quantization)."""
    numel = 2 * 900 + 5
    results = _run("direct", "all_reduce", 2, numel=numel, chunk=chunk)
    m = -(-numel // 2)
    decoded = []
    for rank in range(2):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        codec = ShardCodec(bits=4, group_size=64, dtype_code=0, seq=1, world=2,
                           signature=wire.call_signature("all_reduce", numel, torch.float32),
                           kernels=kernels.REFERENCE)
        encoded = codec.encode(x, 2, m, 1.0, None, 0.0, [0, 1], None)
        out = torch.empty(numel)
        codec.decode_into(encoded.messages, m, [0, 1], out)
        decoded.append(out)
    assert torch.equal(results[0], decoded[0] + decoded[1])


@pytest.mark.parametrize("m", [1, 1000, 4096, 4097, 1_490_000, 8_388_608, 33_554_432])
@pytest.mark.parametrize("chunk_size, max_chunks", [(1_048_576, 4), (1024, 4), (1024, 0), (0, 4)])
def test_chunk_width_caps_the_chunks_per_row(m, chunk_size, max_chunks):
    """A row gets chunks of ``chunk_size`` (rounded up to groups), widened so that there are at
    most ``max_chunks`` of them; ranges cover the row in order, group-aligned but the last."""
    from lowbitcc.schedules.chunking import chunk_width, chunks

    ranges = chunks(m, chunk_width(m, chunk_size, max_chunks), 32)
    assert ranges[0][0] == 0 and ranges[-1][1] == m
    assert all(a < b and b == c for (a, b), (c, _) in zip(ranges, ranges[1:]))
    assert all(b % 32 == 0 for _, b in ranges[:-1])
    if chunk_size == 0:
        assert len(ranges) == 1
    elif max_chunks:
        assert len(ranges) <= max_chunks
        assert len(ranges) == 1 or all(b - a >= chunk_size for a, b in ranges[:-1])
    else:
        width = -(-chunk_size // 32) * 32
        assert len(ranges) == -(-m // width)


def test_chunk_width_of_the_measured_cases():
    """docs/performance.md: a 64 MiB two-rank all-reduce (rows of 8 Mi elements) runs in four
    chunks of 2 Mi per row; DDP's 2.98 M-element bucket (rows of 1.49 M) keeps 1 Mi."""
    from lowbitcc.schedules.chunking import chunk_width

    assert chunk_width(8_388_608, 1_048_576, 4) == 2_097_152
    assert chunk_width(1_490_000, 1_048_576, 4) == 1_048_576
    assert chunk_width(8_388_608, 1_048_576, 0) == 1_048_576
    assert chunk_width(8_388_608, 0, 4) == 0
