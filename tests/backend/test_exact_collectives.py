"""Every exact collective of the "loco" group equals gloo bit for bit, sync and async, except
the order of float sums on 3 or more ranks: reductions small enough to travel in the descriptor
frame are summed in rank order, and a coalesced reduction tensor by tensor, so there they equal
gloo's to rounding (and each other bit for bit)."""

from __future__ import annotations

import contextlib
import datetime

import pytest
import torch
import torch.distributed as dist

import lowbitcc
import lowbitcc.codec.exchange_frame
import lowbitcc.codec.wire
from lowbitcc.backend.exact import op_type
from tests.support.ranks import run_ranks


def _data(rank: int, n: int, dtype=torch.float32, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + salt)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g, dtype=dtype)


def _finish(work, async_op):
    if async_op:
        assert work is not None
        work.wait()


# Each case runs one collective on ``group`` and returns the tensors it produced.
def all_reduce_ops(group, rank, world, async_op):
    outs = []
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT):
        t = _data(rank, 1001)
        _finish(dist.all_reduce(t, op=op, group=group, async_op=async_op), async_op)
        outs.append(t)
    for op in (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR, dist.ReduceOp.SUM):
        t = _data(rank, 77, torch.int64)
        _finish(dist.all_reduce(t, op=op, group=group, async_op=async_op), async_op)
        outs.append(t)
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        t = _data(rank, 513, dtype)
        _finish(dist.all_reduce(t, group=group, async_op=async_op), async_op)
        outs.append(t)
    return outs


def all_reduce_large_outside_backward(group, rank, world, async_op):
    # Above min_size but not in backward: the default policy keeps it exact.
    t = _data(rank, 300_001)
    _finish(dist.all_reduce(t, group=group, async_op=async_op), async_op)
    return [t]


def all_reduce_future(group, rank, world, async_op):
    t = _data(rank, 64)
    work = dist.all_reduce(t, group=group, async_op=True)
    value = work.get_future().wait()
    return [t, *value]


def reduce_scatter(group, rank, world, async_op):
    out = torch.empty(129)
    ins = [_data(rank, 129, salt=s) for s in range(world)]
    _finish(dist.reduce_scatter(out, ins, group=group, async_op=async_op), async_op)
    out2 = torch.empty(257)
    _finish(dist.reduce_scatter_single(out2, _data(rank, 257 * world), group=group,
                                       async_op=async_op), async_op)
    out3 = torch.empty(33)
    _finish(dist.reduce_scatter_single(out3, _data(rank, 33 * world), op=dist.ReduceOp.MAX,
                                       group=group, async_op=async_op), async_op)
    return [out, out2, out3]


def all_gather(group, rank, world, async_op):
    outs = [torch.empty(65) for _ in range(world)]
    _finish(dist.all_gather(outs, _data(rank, 65), group=group, async_op=async_op), async_op)
    single = torch.empty(world * 31, dtype=torch.bfloat16)
    _finish(dist.all_gather_single(single, _data(rank, 31, torch.bfloat16), group=group,
                                   async_op=async_op), async_op)
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "x": [rank] * 3}, group=group)
    return [*outs, single, torch.tensor([o["rank"] for o in objs])]


def broadcast_reduce(group, rank, world, async_op):
    root = world - 1
    t = _data(rank, 99)
    _finish(dist.broadcast(t, group_src=root, group=group, async_op=async_op), async_op)
    r = _data(rank, 99, salt=7)
    _finish(dist.reduce(r, group_dst=1, group=group, async_op=async_op), async_op)
    objs = [rank, "x" * rank] if rank == 0 else [None, None]
    dist.broadcast_object_list(objs, group_src=0, group=group)
    return [t, r if rank == 1 else torch.zeros(1), torch.tensor([objs[0], len(objs[1])])]


def gather_scatter(group, rank, world, async_op):
    gathered = [torch.empty(17) for _ in range(world)] if rank == 0 else None
    _finish(dist.gather(_data(rank, 17), gathered, group_dst=0, group=group,
                        async_op=async_op), async_op)
    out = torch.empty(23)
    scatter_list = [_data(rank, 23, salt=s) for s in range(world)] if rank == 1 else None
    _finish(dist.scatter(out, scatter_list, group_src=1, group=group, async_op=async_op), async_op)
    return [*(gathered or []), out]


def all_to_all(group, rank, world, async_op):
    outs = [torch.empty(11) for _ in range(world)]
    ins = [_data(rank, 11, salt=s) for s in range(world)]
    _finish(dist.all_to_all(outs, ins, group=group, async_op=async_op), async_op)
    even = torch.empty(5 * world)
    _finish(dist.all_to_all_single(even, _data(rank, 5 * world), group=group,
                                   async_op=async_op), async_op)
    # uneven: rank r sends (j + 1) elements to rank j and receives (r + 1) from each
    in_splits = [j + 1 for j in range(world)]
    out_splits = [rank + 1] * world
    uneven = torch.empty(sum(out_splits))
    _finish(dist.all_to_all_single(uneven, _data(rank, sum(in_splits)), out_splits, in_splits,
                                   group=group, async_op=async_op), async_op)
    return [*outs, even, uneven]


def point_to_point(group, rank, world, async_op):
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    send, recv = _data(rank, 40), torch.empty(40)
    to_global = lambda r: r  # noqa: E731  (both groups span every rank)
    if async_op:
        reqs = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, send, to_global(nxt), group),
            dist.P2POp(dist.irecv, recv, to_global(prv), group),
        ])
        for req in reqs:
            req.wait()
    elif rank % 2 == 0:
        dist.send(send, to_global(nxt), group=group)
        dist.recv(recv, to_global(prv), group=group)
    else:
        dist.recv(recv, to_global(prv), group=group)
        dist.send(send, to_global(nxt), group=group)
    dist.barrier(group=group)
    return [recv]


def coalesced(group, rank, world, async_op):
    # loco reduces a coalesced call's tensors one by one (each may be compressed), gloo as one
    # buffer: float sums on 3+ ranks then differ in rounding, so these are integers
    a, b = _data(rank, 70, torch.int64), _data(rank, 71, torch.int64, salt=1)
    with dist._coalescing_manager(group=group, async_ops=async_op) as cm:
        dist.all_reduce(a, group=group)
        dist.all_reduce(b, group=group)
    if async_op:
        cm.wait()
    ga, gb = torch.empty(world * 9), torch.empty(world * 10)
    with dist._coalescing_manager(group=group, async_ops=async_op) as cm:
        dist.all_gather_single(ga, _data(rank, 9), group=group)
        dist.all_gather_single(gb, _data(rank, 10, salt=2), group=group)
    if async_op:
        cm.wait()
    ra, rb = torch.empty(60), torch.empty(70)  # over FRAME_PAYLOAD: gloo's own summation order
    with dist._coalescing_manager(group=group, async_ops=async_op) as cm:
        dist.reduce_scatter_single(ra, _data(rank, 60 * world), group=group)
        dist.reduce_scatter_single(rb, _data(rank, 70 * world, salt=3), group=group)
    if async_op:
        cm.wait()
    return [a, b, ga, gb, ra, rb]


def sparse_all_reduce(group, rank, world, async_op):
    # gloo reduces sparse COO tensors (DDP's sparse embedding gradients take this path); loco
    # hands them to it, never in the descriptor frame (6 elements would fit) nor compressed
    outs = []
    for n, forced in ((6, False), (50_000, False), (100_000, True)):
        t = torch.sparse_coo_tensor(torch.tensor([[rank % n, (3 * rank + 1) % n, n - 1]]),
                                    _data(rank, 3), (n,))
        with lowbitcc.compressed() if forced else contextlib.nullcontext():
            _finish(dist.all_reduce(t, group=group, async_op=async_op), async_op)
        outs.append(t.to_dense())
    return outs


CASES = [all_reduce_ops, all_reduce_large_outside_backward, all_reduce_future, reduce_scatter,
         all_gather, broadcast_reduce, gather_scatter, all_to_all, point_to_point, coalesced,
         sparse_all_reduce]


def _compare_all(rank, world, gloo):
    report = []
    for case in CASES:
        for async_op in (False, True):
            ours = case(None, rank, world, async_op)
            theirs = case(gloo, rank, world, async_op)
            same = len(ours) == len(theirs) and all(
                a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
                for a, b in zip(ours, theirs)
            )
            report.append((case.__name__, async_op, same))
    return report


@pytest.mark.parametrize("issuer", ["auto", "inline"])  # LOCO_ISSUER: worker, calling thread
@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_exact_collectives_equal_gloo_bitwise(world, issuer):
    for rank_report in run_ranks(_compare_all, world, env={"LOCO_ISSUER": issuer}):
        bad = [(name, a) for name, a, same in rank_report if not same]
        assert not bad, f"differs from gloo: {bad}"
        assert len(rank_report) == 2 * len(CASES)


def _reductions_gloo_lacks(rank, world, gloo):
    x = _data(rank, 1000)
    avg = x.clone()
    dist.all_reduce(avg, op=dist.ReduceOp.AVG)
    ref = x.clone()
    dist.all_reduce(ref, group=gloo)
    pre = x.clone()
    dist.all_reduce(pre, op=dist._make_nccl_premul_sum(0.25))
    ref_pre = x * 0.25
    dist.all_reduce(ref_pre, group=gloo)
    # integers: refused as NCCL refuses them, at every size and by every call kind
    ints = []
    for n in (5, 1000):
        for call in (lambda t, op: dist.all_reduce(t, op=op),
                     lambda t, op: dist.reduce_scatter_tensor(torch.empty_like(t),
                                                              t.repeat(world), op=op),
                     lambda t, op: dist.reduce(t, dst=0, op=op)):
            try:
                call(torch.full((n,), 2 * rank + 1, dtype=torch.int64),
                     dist._make_nccl_premul_sum(0.5))
                ints.append("reduced")
            except TypeError as exc:
                ints.append("refused" if "PREMUL_SUM needs floating-point" in str(exc)
                            else str(exc))
    after = torch.ones(3)
    dist.all_reduce(after)  # the group is still in step
    return (torch.equal(avg, ref / world), torch.equal(pre, ref_pre), ints,
            after.tolist() == [world] * 3)


def test_avg_and_premul_sum_are_exact_sum_with_scaling():
    """Before 2026-11-24 an integer PREMUL_SUM small enough for the descriptor frame put the
    float products' bytes where the integers were read: garbage (9133300046433878016 for 1 and
    3 times 0.5 on int64); larger ones summed float products, and a reduce-scatter failed a
    gloo check. NCCL refuses PREMUL_SUM on integers ("PreMulSum Data type must be half, float,
    bfloat16 or double"); so does loco now, on every rank."""
    for avg_ok, pre_ok, ints, after in run_ranks(_reductions_gloo_lacks, 3):
        assert avg_ok and pre_ok and ints == ["refused"] * 6 and after


def _subgroups(rank, world, gloo):
    from torch.distributed.device_mesh import init_device_mesh

    evens = dist.new_group([0, 2], backend="loco")
    evens_gloo = dist.new_group([0, 2], backend="gloo")
    out = []
    if rank in (0, 2):
        a, b = _data(rank, 50), _data(rank, 50)
        dist.all_reduce(a, group=evens)
        dist.all_reduce(b, group=evens_gloo)
        out.append(torch.equal(a, b))
        assert dist.get_backend(evens) == "loco"
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    t = _data(rank, 33)
    ref = t.clone()
    dist.all_reduce(t, group=mesh.get_group("dp"))
    dp_ranks = dist.get_process_group_ranks(mesh.get_group("dp"))
    # every rank creates every group, in the same order
    ref_groups = {tuple(r): dist.new_group(r, backend="gloo") for r in ([0, 2], [1, 3])}
    ref_group = ref_groups[tuple(dp_ranks)]
    dist.all_reduce(ref, group=ref_group)
    out.append(torch.equal(t, ref))
    out.append(dist.get_backend(mesh.get_group("dp")) == "loco")
    return out


def test_new_group_and_device_mesh_subgroups():
    for flags in run_ranks(_subgroups, 4):
        assert all(flags)


def _receive_from_any_source(rank, world, gloo):
    """Rank 0 receives one message from each other rank without naming the sender."""
    senders = []
    for group in (None, gloo):
        if rank == 0:
            for _ in range(world - 1):
                got = torch.empty(5)
                sender = dist.recv(got, group=group)
                assert torch.equal(got, torch.full((5,), float(sender))), (sender, got)
                senders.append(sender)
        else:
            dist.send(torch.full((5,), float(rank)), 0, group=group)
        dist.barrier(group=group)
        if rank == 0:
            work = dist.irecv(got, group=group)
            work.wait()
            senders.append(work._source_rank())
        elif rank == 1:
            dist.send(torch.full((5,), 1.0), 0, group=group)
        dist.barrier(group=group)
    return senders


def test_receive_from_any_source_names_the_sender_as_gloo_does():
    senders = run_ranks(_receive_from_any_source, 3)[0]
    loco, gloo = senders[:3], senders[3:]
    assert sorted(loco[:2]) == [1, 2] and loco[2] == 1
    assert sorted(loco[:2]) == sorted(gloo[:2]) and loco[2] == gloo[2]


def _monitored_barrier(rank, world, gloo):
    import lowbitcc

    dist.all_reduce(torch.ones(10))
    lowbitcc.monitored_barrier(timeout=datetime.timedelta(seconds=20))
    dist.new_group().monitored_barrier(datetime.timedelta(seconds=20), wait_all_ranks=True)
    with pytest.raises(ValueError, match="needs a 'loco' group, got 'gloo'"):
        lowbitcc.monitored_barrier(gloo)
    dist.barrier()
    if rank == 1:
        return "absent"
    with pytest.raises(RuntimeError, match="Rank 1 failed to pass monitoredBarrier"):
        lowbitcc.monitored_barrier(timeout=1.0)
    return "named rank 1"


def test_monitored_barrier_names_the_rank_that_did_not_arrive():
    assert run_ranks(_monitored_barrier, 2) == ["named rank 1", "absent"]


def _small_reductions(rank, world, gloo):
    """Reductions that fit a descriptor frame (``exchange_frame.FRAME_PAYLOAD`` bytes), against gloo's."""
    R = dist.ReduceOp
    report = []
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
                  torch.uint8, torch.int32, torch.int64):
        floating = dtype.is_floating_point
        ops = [R.SUM, R.PRODUCT, R.MIN, R.MAX]
        ops += [R.AVG, dist._make_nccl_premul_sum(0.5)] if floating else [R.BAND, R.BOR, R.BXOR]
        n = lowbitcc.codec.exchange_frame.FRAME_PAYLOAD // dtype.itemsize // world * world
        for op in ops:
            x = _data(rank, n, dtype) if dtype.itemsize > 1 else torch.randint(
                -9 * dtype.is_signed, 9, (n,), generator=torch.Generator().manual_seed(rank),
                dtype=dtype)
            ours, theirs = x.clone(), x.clone() if op_type(op) != R.PREMUL_SUM else x * 0.5
            dist.all_reduce(ours, op=op)
            gloo_op = R.SUM if op_type(op) in (R.AVG, R.PREMUL_SUM) else op
            dist.all_reduce(theirs, op=gloo_op, group=gloo)
            if op_type(op) == R.AVG:
                theirs /= world
            shard = torch.empty(n // world, dtype=dtype)
            dist.reduce_scatter_tensor(shard, x.clone(), op=op)
            everyone = [torch.empty_like(ours) for _ in range(world)]
            dist.all_gather(everyone, ours, group=gloo)
            exact_order = world == 2 or not floating or op_type(op) in (R.MIN, R.MAX)
            half = dtype.itemsize == 2
            tol = dict(rtol=1e-2 if half else 1e-6, atol=5e-2 if half else 1e-6)
            report.append((str(dtype), str(op_type(op)),
                           all(torch.equal(e, ours) for e in everyone),
                           torch.equal(ours, theirs) if exact_order
                           else torch.allclose(ours.double(), theirs.double(), **tol),
                           torch.equal(shard, ours.view(world, -1)[rank])))
    return report


@pytest.mark.parametrize("world", [2, 3])
def test_small_reductions_travel_in_the_descriptor_frame_and_equal_gloo(world):
    """All-reduces and reduce-scatters of at most FRAME_PAYLOAD bytes are reduced from the
    gathered frames in rank order: the same bits on every rank; gloo's result bit for bit
    where the order cannot matter (2 ranks, integers, MIN and MAX), else to rounding."""
    for report in run_ranks(_small_reductions, world):
        bad = [row for row in report if not all(row[2:])]
        assert not bad, bad
        assert len(report) == 4 * 6 + 4 * 7


def _dtypes_gloo_refuses(rank, world, gloo):
    outcomes = []
    for dtype in (torch.int16, torch.uint16, torch.uint32, torch.float8_e4m3fn):
        for n in (5, 100_000):  # in the descriptor frame, and not
            for group in (None, gloo):
                try:
                    dist.all_reduce(torch.ones(n).to(dtype), group=group)
                    outcomes.append("reduced")
                except RuntimeError as exc:
                    outcomes.append("refused" if "Invalid scalar type" in str(exc) else str(exc))
    after = torch.ones(3)
    dist.all_reduce(after)
    return outcomes, after.tolist()


def test_dtypes_gloo_refuses_are_refused_at_every_size():
    """Reductions small enough for the descriptor frame were folded by torch, so int16 summed
    at 5 elements and failed at 100,000 ("Invalid scalar type", gloo's), and the unsigned and
    float8 types raised torch's NotImplementedError at 5. Now every size raises as gloo does."""
    for outcomes, after in run_ranks(_dtypes_gloo_refuses, 2):
        assert outcomes == ["refused"] * 16 and after == [2.0] * 3
