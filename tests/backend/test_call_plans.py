"""Call plans (`lowbitcc.backend.call_plan`): a place's compressed all-reduce or reduce-scatter
run by its plan, on 2 and 3 real ranks on the worker and inline, gives the bytes and error
states of the same call run through its job after a descriptor exchange (the reference: the
schedule's own code with fresh buffers, every call of the group agreed alone), one plan per
place, kept across the place's agreements, and used for every run of its entry."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lowbitcc
from lowbitcc.backend import call_plan, call_schedule, reductions
from lowbitcc.backend.call_agreement import CollectiveMismatchError
from tests.support.ranks import run_ranks

CALLS = [  # (shape, dtype, op, collective): not a multiple of 3 ranks, a cast, 2-D, an input
    # factor; a reduce-scatter's shape is its output's (its input holds one per rank)
    ((65536,), torch.float32, dist.ReduceOp.SUM, "all_reduce"),
    ((100_003,), torch.float32, dist.ReduceOp.AVG, "all_reduce"),
    ((350, 200), torch.bfloat16, dist.ReduceOp.SUM, "all_reduce"),
    ((40_000,), torch.float32, dist.ReduceOp.SUM, "reduce_scatter"),
    ((33_333,), torch.bfloat16, dist.ReduceOp.AVG, "reduce_scatter"),
]
COUNTED = ("calls", "tensor_bytes", "logical_bytes", "wire_bytes", "intra_node_bytes",
           "inter_node_bytes", "residual_sq", "input_sq")
"""`lowbitcc.stats()` counters of compressed calls that plans and jobs count alike (a plan's
run adds its own at its end, `counters.RunTally`; the sums in the same order)."""
PASSES = 7


def _passes(rank, world, gloo, plans, deviate_at=None, device="cpu", fmt="auto", feedback=None,
            issuer="inline"):
    """``PASSES`` backward passes of the compressed all-reduces and reduce-scatters of `CALLS`
    on a group of ``issuer`` whose calls take their places (``plans``; the schedule agrees
    again every 3 runs of a place), else take none (each exchanges a descriptor and runs its
    job): every result, the error states after, how many calls ran by a plan (in Python, or
    by its C++ core, `plan_cores`) and how many plans were made; ``deviate_at``: the pass in
    which the last rank issues its second call 64 elements longer (then also: the passes that
    raised `CollectiveMismatchError`, and each pass's plan runs). ``device`` "cuda": the
    tensors live on the rank's GPU (tests/gpu/test_multirank.py); ``fmt``, ``feedback``: the
    group's code format and feedback setting (`LocoConfig`'s)."""
    call_schedule.REAGREE_EVERY = 3
    runs, made = [0], [0]
    run, init = call_plan.CallPlan.run, call_plan.CallPlan.__init__

    def counted_run(self, *args):
        runs[0] += 1
        return run(self, *args)

    def counted_init(self, *args):
        made[0] += 1
        init(self, *args)

    call_plan.CallPlan.run, call_plan.CallPlan.__init__ = counted_run, counted_init
    if not plans:  # the reference: no call takes a place, as a callback's calls
        reductions.takes_place = lambda device_type: False
    group = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(
        cost_model=False, issuer=issuer, format=fmt, feedback=feedback))
    if device == "cuda":
        from lowbitcc.tools import spawn

        device = spawn.gpu_device(rank)
    gen = torch.Generator().manual_seed(rank)
    results, raised, per_pass = [], [], []

    def plan_runs():
        return runs[0] + group._runner.served_compressed

    for p in range(PASSES):
        shapes = [(shape[0] + 64 * (p == deviate_at and rank == world - 1 and i == 1),
                   *shape[1:]) for i, (shape, *_) in enumerate(CALLS)]
        inputs = [torch.randn(shape[0] * (world if coll == "reduce_scatter" else 1), *shape[1:],
                              generator=gen).to(dtype).to(device)
                  for shape, (_, dtype, _, coll) in zip(shapes, CALLS)]
        outputs = [torch.zeros(shape, dtype=dtype, device=device) if coll == "reduce_scatter"
                   else x for x, shape, (_, dtype, _, coll) in zip(inputs, shapes, CALLS)]
        w = torch.zeros(1, requires_grad=True)

        def issue(grad, inputs=inputs, outputs=outputs):
            with lowbitcc.compressed():
                for x, y, (_, _, op, coll) in zip(inputs, outputs, CALLS):
                    if coll == "reduce_scatter":
                        dist.reduce_scatter_tensor(y, x, op=op, group=group)
                    else:
                        dist.all_reduce(x, op=op, group=group)
            return grad

        w.register_hook(issue)
        before = plan_runs()
        try:
            w.sum().backward()
        except CollectiveMismatchError:
            raised.append(p)
        per_pass.append(plan_runs() - before)
        results.append([y.to("cpu", copy=True) for y in outputs])
    states = lowbitcc.state.FEEDBACK.state_dict()["states"]
    if deviate_at is not None:
        return raised, per_pass
    counted = lowbitcc.stats()["compressed"]
    assert counted["codec_s"] > 0 and counted["wire_s"] > 0
    return results, (states, {k: counted[k] for k in COUNTED}), plan_runs(), made[0]


@pytest.mark.parametrize("world,fmt,feedback,issuer", [
    (2, "auto", None, "auto"), (2, "auto", None, "inline"), (3, "mxfp4", None, "inline"),
    (3, "nvfp4", True, "auto")])
def test_planned_calls_equal_their_jobs_bit_for_bit(world, fmt, feedback, issuer):
    """The default (NVFP4, no error state), MXFP4 (its own default: feedback on) and NVFP4 with
    feedback; on the worker (its route cuts rows into chunks: a plan runs the same chunks) and
    inline."""
    planned = run_ranks(_passes, world, True, None, "cpu", fmt, feedback, issuer, timeout=180)
    jobs = run_ranks(_passes, world, False, None, "cpu", fmt, feedback, issuer, timeout=180)
    kept = lowbitcc.LocoConfig(format=fmt, feedback=feedback).wire_feedback
    for (got, got_states, runs, made), (want, want_states, no_runs, none_made) in zip(planned,
                                                                                    jobs):
        assert no_runs == none_made == 0
        # pass 0 agrees on every call, pass 1's first call closes the period; from then on
        # each place agrees on one run in 3 and its plan runs the other two
        assert made == len(CALLS) and runs > PASSES, (made, runs)
        for pass_got, pass_want in zip(got, want):
            for a, b in zip(pass_got, pass_want):
                assert torch.equal(a, b)
        (got_states, got_counted), (want_states, want_counted) = got_states, want_states
        assert got_counted == want_counted and got_counted["calls"] == PASSES * len(CALLS)
        # the same keys: the same feedback-key ordinals and stages
        assert got_states.keys() == want_states.keys() and bool(got_states) == kept
        for key, state in got_states.items():
            other = want_states[key]
            assert state["uses"] == other["uses"], key
            assert torch.equal(state["data"], other["data"]), key
            assert (state["scales"] is None) == (other["scales"] is None), key
            if state["scales"] is not None:
                assert torch.equal(state["scales"], other["scales"]), key
    first = planned[0][0]
    for got, *_ in planned[1:]:  # every rank ends with the same bits (its own shard: scatters)
        assert all(torch.equal(a, b) for pa, pb in zip(got, first)
                   for a, b, call in zip(pa, pb, CALLS) if call[3] == "all_reduce")


@pytest.mark.parametrize("world,issuer", [(2, "inline"), (3, "inline"), (2, "auto")])
def test_a_rank_that_deviates_while_plans_run_makes_every_rank_raise(world, issuer):
    for raised, per_pass in run_ranks(_passes, world, True, 3, "cpu", "auto", None, issuer,
                                      timeout=180):
        # pass 3's second call: the others run it by its place's plan, the last rank runs the
        # agreed call in its place on flagged messages; every rank raises at that call, and
        # the passes after it run (agreed anew)
        assert raised == [3], (raised, per_pass)
        assert per_pass[2] > 0 and per_pass[3] > 0, per_pass
