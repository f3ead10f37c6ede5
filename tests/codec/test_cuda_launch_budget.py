"""The GPU work one steady-state compressed all-reduce issues on CUDA, counted without a GPU.

The CUDA code branch of the direct schedule (a call's job, and a place's `CallPlan`; the
hierarchical schedule's plan too, `HIERARCHICAL_BUDGET`) runs on
``device="meta"`` tensors (shapes and
dtypes, no data) with the CUDA kernels' launcher and the NCCL transport's process group
replaced by recorders; a `TorchDispatchMode` classifies every torch operation as GPU work
(a kernel), a host-to-device copy, a host synchronisation, an allocation or a view (free).
The budgets below are today's (2026-11-28: 2 kernels at 2 ranks, the direct schedule's encode
and one decode of every row, ``decode_rows``; 3 at 4, whose all-gather stage decodes and sums
the received rows inside its encode, ``encode_sum``; the same for a call's job and a place's
plan, which runs the schedule's own code with its kept buffers): lower them as the path gets
there, never raise them. A place's plan without feedback (the default) allocates nothing.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from lowbitcc import state
from lowbitcc.buffers import Buffers
from lowbitcc.codec import cuda
from lowbitcc.codec.formats import FORMATS
from lowbitcc.codec.shard_codec import ShardCodec
from lowbitcc.compressor import CallCompressor, Source
from lowbitcc.counters import Stats
from lowbitcc.feedback import FeedbackStore
from lowbitcc.schedules import direct
from lowbitcc.transports.links import Links
from lowbitcc.transports.nccl import NcclTransport
from tests.support.cuda_trace import GpuWork, RecordingGroup, meta_plan

FREE = ("view", "_unsafe_view", "select", "slice", "detach", "alias", "as_strided", "split",
        "_reshape_alias", "unsqueeze", "squeeze", "expand", "t", "transpose", "permute",
        "lift_fresh", "reshape", "unbind")
"""Operations that only make a new view of memory: no GPU work."""
ALLOCATING = ("empty", "empty_like", "empty_strided", "new_empty")
SYNCHRONISING = ("_local_scalar_dense", "equal", "nonzero", "item")
ALLOCATING_KERNELS = ("zeros", "zeros_like", "new_zeros", "clone", "full", "ones")
"""An allocation and a kernel (a fill or a copy)."""


class _Classified(TorchDispatchMode):
    def __init__(self, work: GpuWork) -> None:
        super().__init__()
        self.work = work

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        out = func(*args, **kwargs)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if name in FREE:
            pass
        elif name in ALLOCATING:
            self.work.allocations += 1
        elif name in SYNCHRONISING:
            self.work.synchronisations += 1
        elif any(t.device.type == "cpu" for t in tensors) and isinstance(out, torch.Tensor) \
                and out.device.type == "meta" or (name == "copy_" and tensors[1].device.type == "cpu"):
            self.work.host_to_device += 1
        else:
            self.work.allocations += name in ALLOCATING_KERNELS or (
                name != "copy_" and not name.endswith("_") and isinstance(out, torch.Tensor))
            self.work.kernels[name] += 1
        return out


def _steady_state_call(world: int, numel: int, monkeypatch, fmt: str = "mxfp4") -> GpuWork:
    """The GPU work of the third all-reduce of one key (its error state kept), rank 0."""
    work = GpuWork()
    monkeypatch.setattr(cuda, "_launch", lambda name, device, grid, args: work.launches.update(
        [name.split("<")[0].removeprefix("loco_cuda::")]))
    store, scratch, stats = FeedbackStore(), Buffers(), Stats()
    links = Links.of(NcclTransport(RecordingGroup(work, 0, world)))
    x = torch.empty(numel, device="meta")
    out = torch.empty(numel, device="meta")
    m = -(-numel // world)
    for seq in range(3):
        codec = ShardCodec(bits=FORMATS[fmt].width, group_size=FORMATS[fmt].default_group,
                           dtype_code=0, seq=seq,
                           world=world, signature=1, fmt=fmt, kernels=cuda.KERNELS,
                           checksum=False)
        comp = CallCompressor(codec, store, "bucket", stats, error_dtype="int8", beta=0.8,
                              reset_interval=1024, rank=0, scratch=scratch)
        if seq < 2:
            direct.all_reduce(Source(x, world, m), out, comp, links)
            comp.finish()
            continue
        work.launches.clear()
        work.nccl.clear()
        with _Classified(work):
            direct.all_reduce(Source(x, world, m), out, comp, links)
            comp.finish()
    return work


def _planned_call(world: int, numel: int, monkeypatch, fmt: str = "mxfp4",
                  collective: str = "all_reduce", feedback: bool = True,
                  plan_out: list | None = None, node_size: int = 0) -> GpuWork:
    """The GPU work of the third run of a place's `CallPlan` (its error state kept, where
    ``feedback``), rank 0: an all-reduce of ``numel`` elements, or a reduce-scatter of them
    into ``numel / world``; the plan appended to ``plan_out`` where given; ``node_size``: the
    hierarchical schedule over nodes of that many ranks."""
    work = GpuWork()
    monkeypatch.setattr(cuda, "_launch", lambda name, device, grid, args: work.launches.update(
        [name.split("<")[0].removeprefix("loco_cuda::")]))
    monkeypatch.setattr(state, "FEEDBACK", FeedbackStore())
    monkeypatch.setattr(state, "STATS", Stats())
    plan, x, out = meta_plan(work, world, numel, fmt, collective, feedback, node_size=node_size)
    if plan_out is not None:
        plan_out.append(plan)
    for _ in range(2):
        plan.run(x, dist.ReduceOp.SUM, out)
    work.launches.clear()
    work.nccl.clear()
    with _Classified(work):
        plan.run(x, dist.ReduceOp.SUM, out)
    return work


BUDGET = {2: dict(kernels=2, allocations=4, plan_allocations=1, host_to_device=0,
                  synchronisations=0),
          4: dict(kernels=3, allocations=7, plan_allocations=1, host_to_device=0,
                  synchronisations=0)}
"""Per steady-state compressed all-reduce of 1 Mi fp32 elements (MXFP4, NVFP4 or 3-bit nvint3,
int8 error state, checksums off as on CUDA by default): today's counts, the most a change may
leave."""


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "nvint3"])
@pytest.mark.parametrize("planned", [False, True], ids=["job", "plan"])
@pytest.mark.parametrize("world", sorted(BUDGET))
def test_a_steady_state_cuda_all_reduce_stays_within_its_launch_budget(world, planned, fmt,
                                                                      monkeypatch):
    work = (_planned_call if planned else _steady_state_call)(world, 1 << 20, monkeypatch, fmt)
    budget = BUDGET[world]
    summary = (f"{work.total_kernels} kernels: torch {dict(work.kernels)}, codec "
               f"{dict(work.launches)}; {work.allocations} allocations, {work.host_to_device} uploads, "
               f"{work.synchronisations} synchronisations; NCCL {dict(work.nccl)}")
    assert work.total_kernels <= budget["kernels"], summary
    # a plan keeps every stage's messages, non-finite bytes and received messages: only the
    # call's verdict is new
    assert work.allocations <= budget["plan_allocations" if planned else "allocations"], summary
    assert work.host_to_device <= budget["host_to_device"], summary
    assert work.synchronisations <= budget["synchronisations"], summary
    fused = world > 2  # the all-gather stage: `CallCompressor.encode_sum`
    every_row = world == 2  # the decode of every row: `CallCompressor.decode_rows`
    assert work.launches["encode"] == (1 if world == 2 or fused else 2), summary
    assert work.launches["encode_sum"] == int(fused), summary
    assert work.launches["decode_rows"] == int(every_row), summary
    assert work.launches["decode_sum"] == (0 if fused or every_row else 2 if world == 2 else 1), \
        summary
    assert work.launches["check_fold"] == 0, summary  # the decodes check the rows themselves
    assert work.launches["frame_body"] == work.launches["frame_fold"] == 0, summary  # the encode
    assert sum(work.nccl.values()) == (1 if world == 2 else 2), summary


@pytest.mark.parametrize("world", [2, 4])
def test_a_planned_cuda_reduce_scatter_takes_an_encode_and_a_decode(world, monkeypatch):
    """A reduce-scatter's plan: one encode (which frames its messages), one NCCL all-to-all,
    one `decode_sum` straight into the fp32 output (which checks its rows); only the call's
    verdict is allocated (the plan keeps its messages and the all-to-all's received ones)."""
    work = _planned_call(world, 1 << 20, monkeypatch, collective="reduce_scatter")
    summary = f"{dict(work.kernels)}, codec {dict(work.launches)}, NCCL {dict(work.nccl)}"
    assert work.total_kernels == 2 and work.launches == {"encode": 1, "decode_sum": 1}, summary
    assert work.nccl == {"all_to_all": 1}, summary
    assert work.allocations == 1 and work.host_to_device == work.synchronisations == 0, summary


HIERARCHICAL_BUDGET = {"all_reduce": dict(kernels=7, allocations=0, nccl=3),
                       "reduce_scatter": dict(kernels=6, allocations=0, nccl=2)}
"""Per steady-state planned call of the hierarchical schedule, 2 nodes of 2 ranks, 1 Mi fp32
elements, NVFP4 without feedback (the default), rank 0: today's counts (2026-11-29), the most a
change may leave. The codec's part is the direct schedule's on the rail (one encode, one
decode); the rest is the exact node phases in fp32 (`schedules.hierarchical`: the values, the
node all-to-all's send copy and sum, the node all-gather's reordering into the output), in the
plan's kept buffers (`CallCompressor.kept`): nothing allocated (the verdict is one of the plan's
two words)."""


@pytest.mark.parametrize("collective", sorted(HIERARCHICAL_BUDGET))
def test_a_planned_hierarchical_call_stays_within_its_budget(collective, monkeypatch):
    """A hierarchical place's plan (4 ranks on 2 nodes): the codec runs once per stage on the
    rail, as the direct schedule's plan at 2 ranks; no upload, no host synchronisation."""
    work = _planned_call(4, 1 << 20, monkeypatch, fmt="nvfp4", collective=collective,
                         feedback=False, node_size=2)
    budget = HIERARCHICAL_BUDGET[collective]
    summary = (f"{work.total_kernels} kernels: torch {dict(work.kernels)}, codec "
               f"{dict(work.launches)}; {work.allocations} allocations; NCCL {dict(work.nccl)}")
    decode = "decode_rows" if collective == "all_reduce" else "decode_sum"
    assert work.launches == {"encode": 1, decode: 1}, summary
    assert work.total_kernels <= budget["kernels"], summary
    assert work.allocations <= budget["allocations"], summary
    assert sum(work.nccl.values()) == budget["nccl"], summary
    assert work.host_to_device == work.synchronisations == 0, summary


@pytest.mark.parametrize("world", [2, 4])
def test_a_planned_call_without_feedback_allocates_nothing(world, monkeypatch):
    """The default (NVFP4, no error state): a place's plan hands its runs two verdict words in
    turn (`CallPlan._verdict_slot`), so its steady-state run allocates nothing, and each run's
    first encode clears its word (``clear``) and the second, at 4 ranks, does not."""
    packed, plans = [], []
    real = cuda.pack_encode_args

    def record(args):
        packed.append(args.clear)
        return real(args)

    monkeypatch.setattr(cuda, "pack_encode_args", record)
    work = _planned_call(world, 1 << 20, monkeypatch, fmt="nvfp4", feedback=False,
                         plan_out=plans)
    summary = f"{dict(work.kernels)}, codec {dict(work.launches)}, NCCL {dict(work.nccl)}"
    assert work.allocations == 0 and work.host_to_device == work.synchronisations == 0, summary
    assert work.total_kernels == (2 if world == 2 else 3), summary
    assert work.launches["encode_sum"] == (world > 2) and work.launches["decode_rows"] == (world == 2)
    per_run = 1 if world == 2 else 2
    runs = [packed[i:i + per_run] for i in range(0, len(packed), per_run)]
    assert len(runs) == 3 and all(run[0] is not None for run in runs)
    assert all(clear is None for run in runs for clear in run[1:])
    # two words in turn: the first and third runs share one, the second has the other
    assert runs[0][0] is runs[2][0] and runs[0][0] is not runs[1][0]
    assert plans[0].verdict is not None


@pytest.mark.parametrize("planned", [False, True], ids=["job", "plan"])
def test_only_the_first_encode_of_a_call_clears_its_verdict_and_reads_the_poison(planned,
                                                                             monkeypatch):
    """The call's verdict is not zero-filled: its first encode zeroes it (``clear``), a later
    one (the all-gather stage at 4 ranks) must not; every encode that applies a state passes
    the state's poison word, the verdict of the call that wrote it."""
    packed = []
    real = cuda.pack_encode_args

    def record(args):
        packed.append((args.clear, args.state.poison if args.state is not None and args.has_error
                       else None))
        return real(args)

    monkeypatch.setattr(cuda, "pack_encode_args", record)
    (_planned_call if planned else _steady_state_call)(4, 1 << 16, monkeypatch)
    calls = [packed[i:i + 2] for i in range(0, len(packed), 2)]
    assert len(calls) == 3
    for call in calls:
        assert call[0][0] is not None and call[1][0] is None, call
        assert call[0][0] is not call[1][0]
    assert calls[0][0][1] is None  # the first call has no state yet
    # the third call's encodes read the poison of the second's states: its verdict
    assert calls[2][0][1] is calls[1][0][0] and calls[2][1][1] is calls[1][0][0]


@pytest.mark.parametrize("world", [2, 4])
def test_each_planned_run_leaves_the_place_s_next_call_number_in_its_counter(world, monkeypatch):
    """Every eager CUDA run of a place (no host record: `launch_record`) passes the place's
    counter (`interface.CallCount`) to its launches: none reads it (an eager run takes its call
    number by value), and the last
    (``decode_rows`` at 2 ranks, ``decode_into`` at 4) writes there the number the place's
    next run takes where as many calls come between as between its last two runs; the first
    run, with no stride yet, writes nothing."""
    from lowbitcc.codec.cuda_build import COUNT_SET

    launched = []
    monkeypatch.setattr(cuda, "_launch", lambda name, device, grid, args: launched.append(
        (name.split("<")[0].removeprefix("loco_cuda::"), args)))
    monkeypatch.setattr(state, "FEEDBACK", FeedbackStore())
    monkeypatch.setattr(state, "STATS", Stats())
    plan, x, _ = meta_plan(GpuWork(), world, 1 << 16, "nvfp4", feedback=False, replay=False)
    next_seq = plan.group.agreement.next_seq
    counts = []
    for between in (0, 2, 2, 0):  # other calls of the group before this run
        for _ in range(between):
            next_seq()
        launched.clear()
        plan.run(x, dist.ReduceOp.SUM)
        checks = [args[-1]["count"] for name, args in launched if name != "encode"]
        frames = [args[1]["seq_at"] for name, args in launched if name.startswith("encode")]
        assert all(int(c["read"]) == 0 for c in checks) and all(int(f) == 0 for f in frames)
        assert launched[-1][0] == ("decode_rows" if world == 2 else "decode_into")
        assert all(int(c["mode"]) == 0 for c in checks[:-1])  # encode_sum's check counts nothing
        counts.append((plan.seq, int(checks[-1]["mode"]), int(checks[-1]["value"])))
    assert counts == [(1, 0, 0), (4, COUNT_SET, 7), (7, COUNT_SET, 10), (8, COUNT_SET, 9)]
