"""The C++ runner of steady exact calls (`lowbitcc.backend.steady_runner`) against the Python
path it stands in for. Each rank trains the same DDP model and issues the same reduce-scatters
three times, on three "loco" groups: every call through Python (no runner), every call the
runner can serve served by it, and the runner declining at random (half its calls, a
different draw per rank, so the ranks' paths differ call by call). The three must leave the
same outputs (gloo's, bit for bit), call numbers, tags, schedule indices, feedback-key
ordinals, cost-model counts, issuer counts and statistics, on 2 and 3 ranks and both CPU
issuers; the runner must have served most calls, and the Python path some."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lowbitcc
from lowbitcc.backend import native, steady_runner
from tests.support.ranks import run_ranks
from tests.support.training import bucketed_ddp, flat_parameters

pytestmark = pytest.mark.skipif(native.load() is None, reason="the C++ module cannot be built here")

STEPS = 80
"""More than one agreement's runs of a place (`call_schedule.REAGREE_EVERY`): renewals, and the
Python path's runs that start and take them, fall between the runner's."""

COUNTED = ("calls", "tensor_bytes", "logical_bytes", "wire_bytes", "model_exact")


def _state(pg):
    """What a run leaves on its group and in the statistics that the runner also writes."""
    compressed = pg._compressed
    issuer = pg._issuers["cpu"]
    stats = lowbitcc.stats()
    return {
        "next_seq": compressed.agreement.next_seq(),
        "tag": next(pg._queue._issued),
        "index": compressed.call_schedules["cpu"]._next,
        "ordinals": sorted((c, str(d), n, k) for (c, d, n), k in compressed._ordinals.items()),
        "model": sorted((r["collective"], r["bytes_log2"], r["calls"])
                        for r in pg.cost_model.table()),
        "issued": getattr(issuer, "_issued", None),
        "stats": {cat: {k: stats[cat][k] for k in COUNTED} for cat in ("exact", "compressed")},
    }


def _train(rank, world, gloo, mode, issuer):
    block = lowbitcc.exact if mode == "exact" else contextlib.nullcontext
    # "exact": the buckets above min_size, so the cost model counts them and times one in 8
    config = lowbitcc.LocoConfig(issuer=issuer, min_size=1 << 30 if mode == "small" else 1024)
    runs = {}
    for variant in ("gloo", "python", "native", "mixed"):
        lowbitcc.reset_stats()
        pg = gloo if variant == "gloo" else dist.new_group(backend="loco", pg_options=config)
        runner = None if variant == "gloo" else pg._runner
        if variant == "python":
            pg._runner = steady_runner.NoRunner()
        elif variant == "mixed":
            runner.decline_at_random(0.5, 1000 * world + rank)
        model, opt = bucketed_ddp(pg)
        gen = torch.Generator().manual_seed(rank)
        scattered = []
        for _ in range(STEPS):
            x = torch.randn(16, 64, generator=gen)
            with block():
                model(x).square().mean().backward()
                chunk = torch.empty(300)
                dist.reduce_scatter_tensor(chunk, torch.randn(300 * world, generator=gen),
                                           group=pg)
                scattered.append(chunk)
            opt.step()
            opt.zero_grad()
        runs[variant] = {
            "params": flat_parameters(model),
            "scattered": torch.stack(scattered),
            "state": None if variant == "gloo" else _state(pg),
            "served": runner.served if runner is not None else 0,
        }
    return runs


@pytest.mark.parametrize(("world", "mode", "issuer"), [
    (2, "exact", "auto"),   # `lowbitcc.exact()`: the cost model counts and times the calls
    (3, "small", "auto"),   # below min_size: exact by agreement, ordinals counted in backward
    (2, "small", "inline"),
])
def test_the_runner_and_the_python_path_mixed_at_random_leave_the_same_state(world, mode, issuer):
    for rank, runs in enumerate(run_ranks(_train, world, mode, issuer, timeout=400)):
        gloo = runs["gloo"]
        for variant in ("python", "native", "mixed"):
            run = runs[variant]
            assert torch.equal(run["params"], gloo["params"]), (rank, variant)
            assert torch.equal(run["scattered"], gloo["scattered"]), (rank, variant)
            assert run["state"] == runs["python"]["state"], (rank, variant)
        state = runs["python"]["state"]
        calls = state["stats"]["exact"]["calls"]
        served = runs["native"]["served"]
        assert calls >= 3 * STEPS, state  # DDP's two buckets and a reduce-scatter a step
        assert runs["python"]["served"] == 0
        assert served > 0.6 * calls, (rank, calls, served)
        assert 0.3 * served < runs["mixed"]["served"] < 0.7 * served, (rank, runs["mixed"])
        if mode == "small":
            assert state["ordinals"], state  # the runner's ordinals were compared
        else:
            assert state["model"] and state["issued"], state  # its cost-model counts were


def _declines(rank, world, gloo):
    import threading

    # without the cost model: no run is the worker's timed one (1 in 8), which the runner leaves
    pg = dist.new_group(backend="loco",
                        pg_options=lowbitcc.LocoConfig(min_size=2, cost_model=False))
    runner = pg._runner

    def call(tensor, **kwargs):
        dist.all_reduce(tensor, group=pg, **kwargs)
        lowbitcc.end_step()  # each call a step: one place, its entry exact (outside backward)
        return tensor

    def fresh():
        return torch.full((64,), float(rank + 1))

    for _ in range(12):
        call(fresh())
    served = runner.served
    call(fresh())
    assert runner.served == served + 1, "not steady"  # (not one of the worker's timed runs)
    cases = {
        "feedback_key block": lambda: _within(lowbitcc.feedback_key("k"), lambda: call(fresh())),
        "another thread": lambda: _on_thread(threading, lambda: call(fresh())),
        "a Parameter": lambda: call(nn.Parameter(fresh(), requires_grad=False)).detach(),
    }
    seen = {}
    for name, case in cases.items():
        before = runner.served
        out = case()
        seen[name] = (runner.served - before, out.clone())
        served = runner.served
        steady = call(fresh())  # the place still runs as its entry, served again
        seen[name + ", then"] = (runner.served - served, steady.clone())
    before = runner.served  # a place whose entry is an AVG (gloo runs SUM and divides)
    averaged = [call(fresh(), op=dist.ReduceOp.AVG) * world for _ in range(12)]
    seen["AVG"] = (runner.served - before, averaged[-1])
    return seen


def _within(block, fn):
    with block:
        return fn()


def _on_thread(threading, fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def test_calls_the_runner_declines_take_the_python_path_and_leave_the_place_steady():
    """Calls at a steady exact place that the runner must not serve (a `feedback_key` block,
    another thread, a tensor subclass) are served by none of its code, give the exact sum, and
    the place's next plain call is served by it again; an AVG place (an op gloo does not run
    itself) is never served."""
    for seen in run_ranks(_declines, 2, timeout=120):
        want = torch.full((64,), 3.0)
        for name, (served, out) in seen.items():
            assert torch.equal(out, want), name
            assert served == (1 if name.endswith(", then") else 0), (name, served)
