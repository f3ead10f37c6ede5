"""The C++ runner of steady calls (`lowbitcc.backend.steady_runner`) against the Python path it
stands in for. Each rank trains the same DDP model and issues the same reduce-scatters three
times, on three "loco" groups: every call through Python (no runner), every call the runner can
serve served by it, and the runner declining at random (half its calls, a different draw per
rank, so the ranks' paths differ call by call). The three must leave the same outputs (gloo's,
bit for bit, where exact), call numbers, tags, schedule indices, feedback-key ordinals,
cost-model counts, issuer counts and statistics, on 2 and 3 ranks and both CPU issuers, exact
and compressed (a plan's C++ core, `plan_cores`), with error feedback too (then the same error
states, each key's bytes and uses); the runner must have served most calls, and the Python path
some."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lowbitcc
from lowbitcc import state as lowbitcc_state
from lowbitcc.backend import native, steady_runner
from tests.support.corrupt_calls import corrupt_first_codes
from tests.support.device_runners import cpu_device_runner
from tests.support.ranks import run_ranks, run_script_ranks
from tests.support.training import bucketed_ddp, flat_parameters

pytestmark = pytest.mark.skipif(native.load() is None, reason="the C++ module cannot be built here")

STEPS = 80
"""More than one agreement's runs of a place (`call_schedule.REAGREE_EVERY`): renewals, and the
Python path's runs that start and take them, fall between the runner's."""

COMPRESSED = ("compressed", "chunked", "loco", "loco-chunked", "tree", "tree-loco", "ring",
              "ring-loco-chunked", "hier", "hier-loco-chunked")
"""The modes whose calls are compressed (`_train`)."""

COUNTED = ("calls", "tensor_bytes", "logical_bytes", "wire_bytes", "model_exact",
           "intra_node_bytes", "inter_node_bytes")


def _state(pg):
    """What a run leaves on its group and in the statistics that the runner also writes."""
    pg._runner.fold_timings()  # (the exact runs it timed, handed over at its next call)
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
        # each size class's timed runs, per path (exact: one in 8 on the worker)
        "timed": sorted((k, c.timed[True], c.timed[False])
                        for k, c in pg.cost_model._classes.items()),
        "issued": getattr(issuer, "_issued", None),
        "stats": {cat: {k: stats[cat][k] for k in COUNTED} for cat in ("exact", "compressed")},
        "residual_sq": stats["compressed"]["residual_sq"],
    }


def _feedback_states(pg):
    """The error states of ``pg``'s calls: key (less the group's name) -> (uses, data, scales,
    streak: how the store tracks the key's buffers, `feedback.FeedbackStore`); and under
    ``"order"`` the keys in the order of the store's states and of its layouts (least recently
    used first: what ``max_keys`` drops first)."""
    store = lowbitcc_state.FEEDBACK
    prefix = f"{pg._compressed.group_name}|"
    states = store.state_dict()["states"]
    out = {key[len(prefix):]: (v["uses"], v["data"], v["scales"], v["streak"])
           for key, v in states.items() if key.startswith(prefix)}
    live = store.keys()  # (a method of the store, which leaves out states that count as dropped)
    out["order"] = ([k[len(prefix):] for k in live if k.startswith(prefix)],
                    [k[len(prefix):] for k in store._layouts if k.startswith(prefix)])
    return out


def _train(rank, world, gloo, mode, issuer, variants=("gloo", "python", "native", "mixed")):
    """Each of ``variants``' runs (`_state`); "device" and "device-mixed": the group's CPU
    runner off and a device runner of "cpu" in its place (`steady_runner.device_runner`, as
    a CUDA group's, over the group's direct gloo group), all its calls or half."""
    compressed = mode in COMPRESSED
    block = lowbitcc.exact if mode == "exact" else (
        lowbitcc.compressed if compressed else contextlib.nullcontext)
    # "exact": the buckets above min_size, so the cost model counts them and times one in 8;
    # "chunked": rows cut into chunks of 512 elements (a plan core's transfer per row and chunk)
    # "loco", "loco-chunked": with error feedback (LoCo on NVFP4)
    # "tree", "tree-loco", "ring", "ring-loco-chunked": the tree's and the ring's plans (their
    # cores' runs), without and with feedback; "hier", "hier-loco-chunked": the hierarchical
    # schedule's over nodes of two ranks
    feedback = "loco" in mode
    schedule = {"tree": "tree", "ring": "ring", "hier": "hierarchical"}.get(mode.split("-")[0],
                                                                           "direct")
    config = lowbitcc.LocoConfig(issuer=issuer, min_size=1 << 30 if mode == "small" else 1024,
                                 chunk_size=512 if mode.endswith("chunked") else 1 << 20,
                                 feedback=feedback, schedule=schedule,
                                 node_size=2 if schedule == "hierarchical" else 0)
    named = (lambda: lowbitcc.feedback_key("chunk")) if feedback else contextlib.nullcontext
    runs = {}
    for variant in variants:
        lowbitcc.reset_stats()
        pg = gloo if variant == "gloo" else dist.new_group(backend="loco", pg_options=config)
        if variant.startswith("device"):
            cpu_device_runner(pg)
        runner = None if variant == "gloo" else (
            pg._device_runner if variant.startswith("device") else pg._runner)
        if variant == "python":
            pg._runner = steady_runner.NoRunner()
        elif variant.endswith("mixed"):
            runner.decline_at_random(0.5, 1000 * world + rank)
        model, opt = bucketed_ddp(pg)
        gen = torch.Generator().manual_seed(rank)
        scattered, reduced = [], []
        for _ in range(STEPS):
            x = torch.randn(16, 64, generator=gen)
            with block():
                model(x).square().mean().backward()
                width = 700 if compressed else 300  # compressed: above min_size
                chunk = torch.empty(width)
                # with feedback, a named key too (its layout not tracked)
                with named():
                    dist.reduce_scatter_tensor(chunk, torch.randn(width * world, generator=gen),
                                               group=pg)
                scattered.append(chunk)
                if compressed:  # a plan core's cast and part row: bf16, odd numel
                    odd = torch.randn(2001, generator=gen).to(torch.bfloat16)
                    dist.all_reduce(odd, group=pg)
                    reduced.append(odd)
                    part = torch.empty(1001, dtype=torch.bfloat16)  # (a row not a group multiple)
                    dist.reduce_scatter_tensor(
                        part, torch.randn(1001 * world, generator=gen).to(torch.bfloat16),
                        group=pg)
                    reduced.append(part)
            opt.step()
            opt.zero_grad()
        runs[variant] = {
            "params": flat_parameters(model),
            "scattered": torch.stack(scattered),
            "reduced": torch.cat(reduced) if reduced else None,
            "state": None if variant == "gloo" else _state(pg),
            "feedback": None if variant == "gloo" else _feedback_states(pg),
            "served": runner.served if runner is not None else 0,
            "served_compressed": runner.served_compressed if runner is not None else 0,
        }
    return runs


@pytest.mark.parametrize(("world", "mode", "issuer"), [
    (2, "exact", "auto"),   # `lowbitcc.exact()`: the cost model counts and times the calls
    (3, "small", "auto"),   # below min_size: exact by agreement, ordinals counted in backward
    pytest.param(2, "small", "inline", marks=pytest.mark.slow),
    (2, "compressed", "auto"),  # `lowbitcc.compressed()`: plan cores, beside the worker's calls
    (2, "compressed", "inline"),
    pytest.param(2, "chunked", "auto", marks=pytest.mark.slow),  # (inline runs no chunks)
    (3, "compressed", "auto"),  # three ranks: the all-reduce's two phases
    pytest.param(3, "chunked", "auto", marks=pytest.mark.slow),
    (2, "loco", "auto"),         # error feedback: the cores take and put the error states
    (2, "loco-chunked", "auto"),
    (3, "loco", "auto"),
    pytest.param(2, "loco", "inline", marks=pytest.mark.slow),
    pytest.param(3, "loco-chunked", "auto", marks=pytest.mark.slow),
    (3, "tree", "auto"),  # the tree schedule: its root sums two leaves' messages
    pytest.param(2, "tree", "inline", marks=pytest.mark.slow),
    pytest.param(4, "tree", "auto", marks=pytest.mark.slow),  # rank 1: a leaf's and the root's
    pytest.param(3, "tree-loco", "auto", marks=pytest.mark.slow),
    (3, "ring", "auto"),  # the ring: two hops of partial sums, the reduced rows forwarded
    (2, "ring-loco-chunked", "auto"),
    pytest.param(3, "ring-loco-chunked", "auto", marks=pytest.mark.slow),
    pytest.param(2, "ring", "inline", marks=pytest.mark.slow),
    # the hierarchical schedule: two nodes of two ranks (its rail's all-reduce an all-gather)
    (4, "hier", "auto"),
    pytest.param(4, "hier-loco-chunked", "auto", marks=pytest.mark.slow),
    pytest.param(4, "hier", "inline", marks=pytest.mark.slow),
    pytest.param(6, "hier", "auto", marks=pytest.mark.slow),  # three nodes: the two phases
    pytest.param(6, "hier-loco-chunked", "auto", marks=pytest.mark.slow),  # (in chunks)
])
def test_the_runner_and_the_python_path_mixed_at_random_leave_the_same_state(world, mode, issuer):
    compressed = mode in COMPRESSED
    for rank, runs in enumerate(run_ranks(_train, world, mode, issuer, timeout=400)):
        want = runs["python" if compressed else "gloo"]
        for variant in ("python", "native", "mixed"):
            run = runs[variant]
            assert torch.equal(run["params"], want["params"]), (rank, variant)
            assert torch.equal(run["scattered"], want["scattered"]), (rank, variant)
            if compressed:
                assert torch.equal(run["reduced"], want["reduced"]), (rank, variant)
            assert run["state"] == runs["python"]["state"], (rank, variant)
            _assert_same_states(run["feedback"], runs["python"]["feedback"], (rank, variant))
        if "loco" in mode:
            assert runs["python"]["feedback"], "the calls kept error states"
        state = runs["python"]["state"]
        if compressed:
            calls = state["stats"]["compressed"]["calls"]
            # two buckets, an all-reduce and two reduce-scatters a step
            assert calls >= 5 * STEPS - 5, state
            served = runs["native"]["served_compressed"]
            assert runs["python"]["served"] == 0
            # every call's: the all-reduces' and the reduce-scatters'
            # (0.97 of them on 2026-11-29: the places' first runs and exchanges are Python's;
            # with feedback, the calls under a named key and under derived keys alike)
            assert served > 0.9 * calls, (rank, calls, served)
            assert 0.3 * served < runs["mixed"]["served_compressed"] < 0.7 * served, (
                rank, runs["mixed"])
            continue
        calls = state["stats"]["exact"]["calls"]
        served = runs["native"]["served"]
        assert calls >= 3 * STEPS, state  # DDP's two buckets and a reduce-scatter a step
        assert runs["python"]["served"] == 0
        # every steady call, the ones the cost model times too (one in 8 of the modelled
        # buckets: they were the Python path's until 2026-11-29, 0.88 of the calls served)
        assert served > 0.92 * calls, (rank, calls, served)
        assert 0.3 * served < runs["mixed"]["served"] < 0.7 * served, (rank, runs["mixed"])
        if mode == "small":
            assert state["ordinals"], state  # the runner's ordinals were compared
        else:
            assert state["model"] and state["issued"], state  # its cost-model counts were
            # and its timings (the runner times the worker's one in 8 as the worker does)
            assert any(exact for _, exact, _ in state["timed"]), state


@pytest.mark.parametrize(("world", "mode"), [
    (2, "exact"), (3, "small"), (2, "compressed"),
    pytest.param(3, "exact", marks=pytest.mark.slow),
    pytest.param(2, "loco", marks=pytest.mark.slow),  # the feedback keys, Python's
    pytest.param(3, "tree", marks=pytest.mark.slow),  # off the direct schedule: canaries
])
def test_a_device_runner_serves_steady_calls_as_the_python_path_does(world, mode):
    """A device runner (a CUDA group's, `steady_runner.device_runner`; made here of "cpu" over
    the group's direct gloo group, under the inline issuer, which issues on the calling thread
    as `CudaIssuer` does) serves the exact entries of all-reduces (DDP's buckets, asynchronous)
    and reduce-scatters (synchronous) and leaves the same outputs, call numbers, schedule
    indices, ordinals, cost-model counts and statistics as the Python path, served whole or
    declining at random; only the tags differ: its Work is the inner backend's own, untagged,
    as a CUDA call's (the Python path's inline issuer tags its `FollowedWork`), so each exact
    call it served took one tag fewer. A compressed entry's place it takes, and hands the run
    to the Python path's `Reductions.run` (on CUDA `CudaIssuer.run_plan`)."""
    variants = ("gloo", "python", "device", "device-mixed")
    for rank, runs in enumerate(run_ranks(_train, world, mode, "inline", variants,
                                          timeout=400)):
        want = runs["python" if mode in COMPRESSED else "gloo"]
        for variant in variants[1:]:
            run = runs[variant]
            assert torch.equal(run["params"], want["params"]), (rank, variant)
            assert torch.equal(run["scattered"], want["scattered"]), (rank, variant)
            if mode in COMPRESSED:
                assert torch.equal(run["reduced"], want["reduced"]), (rank, variant)
            got, python = dict(run["state"]), dict(runs["python"]["state"])
            exact_served = run["served"] - run["served_compressed"]
            assert got.pop("tag") == python.pop("tag") - exact_served, (rank, variant)
            assert got == python, (rank, variant)
            _assert_same_states(run["feedback"], runs["python"]["feedback"], (rank, variant))
        state = runs["python"]["state"]
        served = runs["device"]["served"]
        if mode in COMPRESSED:
            calls = state["stats"]["compressed"]["calls"]
            assert calls >= 5 * STEPS - 5, state
            served = runs["device"]["served_compressed"]
            assert served > 0.9 * calls, (rank, calls, served)
            assert 0.3 * served < runs["device-mixed"]["served_compressed"] < 0.7 * served, (
                rank, runs["device-mixed"])
            continue
        calls = state["stats"]["exact"]["calls"]
        assert calls >= 3 * STEPS, state  # DDP's two buckets and a reduce-scatter a step
        assert served > 0.92 * calls, (rank, calls, served)
        assert 0.3 * served < runs["device-mixed"]["served"] < 0.7 * served, (rank, runs)
        assert state["ordinals"] if mode == "small" else state["model"], state


def _run_arguments(rank, world, gloo):
    """What `Reductions.run` is handed for the steady compressed calls of one step, issued by
    the Python path and by a device runner of "cpu" (under the inline issuer): an all-reduce
    without options and with AVG, a reduce-scatter through ``_reduce_scatter_base`` and through
    the coalesced method, both without options; per call its collective, numel, op, the native
    call's method, its argument count, its options' type and op, and whether the tensors
    handed are the caller's own objects. And the compressed calls the device runner took."""
    seen, taken = {}, 0
    for way in ("python", "device"):
        pg = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(
            min_size=2, cost_model=False, issuer="inline"))
        pg._runner = steady_runner.NoRunner()
        record = []
        real = pg._reductions.run

        def spy(*args, record=record, real=real):
            record.append(args)
            return real(*args)

        pg._reductions.run = spy  # (found by the Python path and the runner alike)
        if way == "device":
            cpu_device_runner(pg)
        x, out = torch.ones(4096), torch.empty(4096 // world)
        averaged = dist.AllreduceOptions()
        averaged.reduceOp = dist.ReduceOp.AVG
        for _ in range(6):
            del record[:]
            listed = [x]
            with lowbitcc.compressed():
                for work in (pg.allreduce(listed), pg.allreduce([x], averaged),
                             pg._reduce_scatter_base(out, x),
                             pg.reduce_scatter_tensor_coalesced([out], [x])):
                    work.wait()
            lowbitcc.end_step()
        rows = []
        for _, collective, tensor, output, numel, op, (method, args) in record:
            mine = ((args[0] is listed or args[0][0] is x) and tensor is x and output is x
                    if collective == "all_reduce" else
                    args[0] is out and args[1] is x and tensor is x and output is out)
            rows.append((collective, numel, str(op.op), method, len(args),
                         type(args[-1]).__name__, str(args[-1].reduceOp.op), mine))
        seen[way] = rows
        if way == "device":
            taken = pg._device_runner.served_compressed
    return seen, taken


def test_a_device_runner_hands_reductions_run_what_the_python_path_hands_it():
    """A compressed entry whose place a device runner took runs by `Reductions.run` with the
    arguments `LocoProcessGroup`'s methods give it: the caller's tensors and list, its options
    or fresh default ones, the native call (on CUDA the method a graph capture runs, whose
    options say whether the call takes a side stream)."""
    for seen, taken in run_ranks(_run_arguments, 2, timeout=120):
        assert seen["device"] == seen["python"] and len(seen["python"]) == 4, seen
        assert all(row[-1] for row in seen["python"]), seen
        assert taken >= 4 * 3, taken  # the four places' steady runs


def _assert_same_states(got, want, where):
    assert got.keys() == want.keys(), where
    assert got["order"] == want["order"], where
    for key, value in want.items():
        if key == "order":
            continue
        uses, data, scales, streak = value
        assert got[key][0] == uses and got[key][3] == streak, (where, key)
        assert torch.equal(got[key][1], data), (where, key)
        assert (scales is None) == (got[key][2] is None), (where, key)
        assert scales is None or torch.equal(got[key][2], scales), (where, key)


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


def _method_routes(rank, world, gloo):
    pg = dist.new_group(backend="loco",
                        pg_options=lowbitcc.LocoConfig(min_size=2, cost_model=False))
    runner = pg._runner
    routes = {"types": [type(pg.__dict__.get(name)).__name__ for name in
                        ("allreduce", "reduce_scatter_single", "_reduce_scatter_base",
                         "reduce_scatter_single_coalesced")]}

    def fresh():
        return torch.full((64,), float(rank + 1))

    def through(way):
        """Served calls and the last output of 12 steady all-reduces issued ``way``."""
        before, out = runner.served, None
        for _ in range(12):
            out = fresh()
            if way == "c10d":  # c10d's C++ method, as DDP's reducer calls it (the trampoline)
                dist.ProcessGroup.allreduce(pg, [out], dist.AllreduceOptions()).wait()
            elif way == "keywords":
                pg.allreduce(tensors=[out], opts=None).wait()
            else:
                dist.all_reduce(out, group=pg)
            lowbitcc.end_step()
        return runner.served - before, out

    through("dist")  # the place agreed
    routes["dist"] = through("dist")
    routes["c10d"] = through("c10d")
    routes["keywords"] = through("keywords")
    pg._runner = steady_runner.NoRunner()  # every call the class's Python method's
    routes["python"] = through("c10d")
    pg._runner = runner
    routes["again"] = through("dist")
    output = torch.empty(32)
    before = runner.served
    for _ in range(12):
        dist.reduce_scatter_tensor(output, torch.arange(64.0) * (rank + 1), group=pg)
        lowbitcc.end_step()
    routes["reduce_scatter"] = (runner.served - before, output.clone())
    from torch.distributed import _functional_collectives as functional

    before = runner.served  # through c10d's C++ method: the coalesced one's trampoline
    for _ in range(12):
        scattered = functional.reduce_scatter_tensor(torch.arange(64.0) * (rank + 1), "sum", 0,
                                                     pg)
        scattered = functional.wait_tensor(scattered)
        lowbitcc.end_step()
    routes["functional reduce_scatter"] = (runner.served - before, scattered.clone())
    runner.decline_at_random(0.5, 7)  # (the same draws on both ranks: they decline together)
    before = runner.served
    for _ in range(200):
        dist.reduce_scatter_tensor(output, torch.arange(64.0) * (rank + 1), group=pg)
        lowbitcc.end_step()
    runner.decline_at_random(0.0, 0)
    routes["half declined"] = (runner.served - before, output.clone())
    from lowbitcc.backend.process_group import LocoProcessGroup

    class Intercepting(LocoProcessGroup):  # a subclass's own allreduce takes its calls
        def allreduce(self, tensors, opts=None):
            return LocoProcessGroup.allreduce(self, tensors, opts)

    class InterceptingCoalesced(LocoProcessGroup):  # which the reduce-scatters go through
        def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
            return LocoProcessGroup.reduce_scatter_single_coalesced(self, outputs, inputs, opts)

    names = [name for family in steady_runner.METHODS for name in family]
    for subclass in (Intercepting, InterceptingCoalesced):
        for name in names:
            pg.__dict__.pop(name, None)
        pg.__class__ = subclass
        steady_runner.install(pg, LocoProcessGroup)
        routes[subclass.__name__] = sorted(name for name in names if name in pg.__dict__)
    pg.__class__ = LocoProcessGroup
    steady_runner.install(pg, LocoProcessGroup)
    method = pg.reduce_scatter_single
    dist.destroy_process_group(pg)
    pg = None  # (the method holds its group weakly)
    gc.collect()
    try:
        method(torch.empty(32), fresh())
    except RuntimeError as gone:
        routes["gone"] = str(gone)
    return routes


def test_a_groups_reduction_methods_are_cpp_and_every_caller_reaches_the_runner_through_them():
    """The group's ``allreduce`` and reduce-scatters are its C++ methods (`steady_runner.install`):
    `dist.all_reduce`, c10d's own C++ ``ProcessGroup.allreduce`` (pybind's trampoline, as DDP's
    reducer calls it) and a call by keywords are served by the runner once steady, with gloo's
    sums, and so are `dist.reduce_scatter_tensor` and the functional one (the coalesced
    method's trampoline); a group whose runner is a `NoRunner` runs them through its Python
    methods, with the same sums; a call the runner declines is offered to it once (half
    declined at random: about half served); a subclass that defines a method anew keeps it and
    those that route through it; a method kept past its group raises, naming why."""
    for rank, routes in enumerate(run_ranks(_method_routes, 2, timeout=120)):
        assert routes["types"] == ["AllReduceMethod", "ReduceScatterMethod",
                                   "ReduceScatterMethod", "ReduceScatterCoalescedMethod"], (
            routes["types"])
        for way in ("dist", "c10d", "keywords", "python", "again"):
            served, out = routes[way]
            assert torch.equal(out, torch.full((64,), 3.0)), way
            assert served == (0 if way == "python" else 12), (way, served)
        for way in ("reduce_scatter", "functional reduce_scatter"):
            served, out = routes[way]
            assert served >= 10, (way, served)  # (its place's first runs agree it)
            assert torch.equal(out, torch.arange(64.0)[32 * rank:32 * (rank + 1)] * 3), out
        served, out = routes["half declined"]  # (offered twice: about 150)
        assert 70 <= served <= 130, served
        assert torch.equal(out, torch.arange(64.0)[32 * rank:32 * (rank + 1)] * 3), out
        assert "after its group was gone" in routes["gone"], routes["gone"]
        all_reduce, reduce_scatters, *moves = steady_runner.METHODS  # (data movements: their own)
        movements = [name for family in moves for name in family]
        assert routes["Intercepting"] == sorted([*reduce_scatters, *movements]), (
            routes["Intercepting"])
        assert routes["InterceptingCoalesced"] == sorted([*all_reduce, *movements]), (
            routes["InterceptingCoalesced"])


def _frames_seen_by_compile(rank, world, gloo):
    from torch._C._dynamo import eval_frame
    from torch._dynamo.types import ConvertFrameReturn, FrameAction, FrameExecStrategy

    pg = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(min_size=2))
    seen = []
    run_as_is = FrameExecStrategy(FrameAction.DEFAULT, FrameAction.DEFAULT)

    def evaluate(frame, *args):  # torch.compile's callback, stood in for: records, compiles none
        seen.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}")
        return ConvertFrameReturn(frame_exec_strategy=run_as_is, apply_to_code=False)

    tensor = torch.ones(1 << 12)
    with lowbitcc.compressed():
        for _ in range(20):  # the place agreed
            dist.ProcessGroup.allreduce(pg, [tensor], dist.AllreduceOptions()).wait()
            lowbitcc.end_step()
        served = pg._runner.served
        for _ in range(140):  # two renewals' runs among them, whose bookkeeping is Python
            prior = eval_frame.set_eval_frame(evaluate)
            try:
                dist.ProcessGroup.allreduce(pg, [tensor], dist.AllreduceOptions()).wait()
            finally:
                eval_frame.set_eval_frame(prior)
            lowbitcc.end_step()
    return pg._runner.served - served, seen


def test_a_served_call_hands_none_of_its_python_frames_to_torch_compile():
    """The group's C++ ``allreduce`` turns torch.compile's frame evaluation off around what it
    runs (the runner's Python bookkeeping at a place's renewal included), as the class's
    eager-wrapped methods do, when c10d calls it from a compiled region's eager part."""
    for served, seen in run_ranks(_frames_seen_by_compile, 2, timeout=120):
        assert served == 140, served
        assert seen == [], seen[:10]


def _deviation_at_a_core(rank, world, gloo, collective, device=False):
    # one place, its entry compressed: every call a step, outside backward; ``device``: a
    # device runner of "cpu" in place of the CPU runner (it takes the place, the run is
    # `Reductions.run`'s), under the inline issuer
    pg = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(
        min_size=2, cost_model=False, issuer="inline" if device else "auto"))
    runner = pg._runner
    if device:
        runner = cpu_device_runner(pg)

    def call(n):
        tensor = torch.full((n,), float(rank + 1))
        try:
            with lowbitcc.compressed():
                if collective == "all_reduce":
                    dist.all_reduce(tensor, group=pg)
                    return tensor
                out = torch.empty(n // world)
                dist.reduce_scatter_tensor(out, tensor, group=pg)
                return out
        finally:
            lowbitcc.end_step()

    for _ in range(12):
        call(4096)
    served = runner.served_compressed
    steady = call(4096)
    assert runner.served_compressed == served + 1, "not steady"
    before = runner.served_compressed
    try:
        call(4096 + 64 * (rank == 1))  # rank 1's call is not the place's: it deviates
        raised = None
    except Exception as exc:  # noqa: BLE001 (the test reads its type)
        raised = type(exc).__name__
    served_deviation = runner.served_compressed - before
    after = [call(4096) for _ in range(12)]
    return steady, raised, served_deviation, after[-1], runner.served_compressed - before


@pytest.mark.parametrize(("world", "collective", "device"), [
    (2, "all_reduce", False), (2, "reduce_scatter", False), (3, "all_reduce", False),
    (2, "all_reduce", True), (2, "reduce_scatter", True)])
def test_a_call_whose_messages_do_not_belong_to_it_raises_from_a_plan_core_as_from_python(
        world, collective, device):
    """Rank 1 deviates from a steady compressed place that the other ranks' plan cores serve:
    their cores meet rank 1's flagged messages (on three ranks in the all-reduce's first phase,
    whose sums they send flagged in the second) and hand the decode back to the plan, so every
    rank raises `CollectiveMismatchError` at that call, and the place runs (served again)
    after. The same where a device runner takes the place (``device``) and the Python plan runs
    it."""
    results = run_ranks(_deviation_at_a_core, world, collective, device, timeout=120)
    assert [raised for _, raised, *_ in results] == ["CollectiveMismatchError"] * world
    # the others ran it in C++, rank 1 (deviating) in Python
    assert [core for _, _, core, _, _ in results] == [0 if r == 1 else 1 for r in range(world)]
    steady0, after0, total0 = results[0][0], results[0][3], results[0][4]
    want = torch.full_like(steady0, float(sum(range(1, world + 1))))
    # (three ranks: two quantizations, each up to 1/8 off where a group's block scale rounds up:
    # 6.0 comes back 6.75)
    assert torch.allclose(steady0, want, rtol=0.1 if world == 2 else 0.15)
    if collective == "all_reduce":  # (a reduce-scatter's ranks hold different rows)
        assert all(torch.equal(steady0, steady) and torch.equal(after0, after)
                   for steady, _, _, after, _ in results)
    else:
        assert torch.allclose(after0, want, rtol=0.1)  # (two ranks)
    assert total0 > 1  # the place is served again after the exchange that follows


def _in_a_key_block(rank, world, gloo):
    from lowbitcc import policy

    counts = {}
    for variant in ("python", "native"):
        pg = dist.new_group(backend="loco",
                            pg_options=lowbitcc.LocoConfig(min_size=2, cost_model=False))
        if variant == "python":
            pg._runner = steady_runner.NoRunner()
        outs = []
        for _ in range(12):  # each call a step: one place, its entry compressed
            tensor = torch.full((4096,), float(rank + 1))
            with lowbitcc.compressed(), lowbitcc.feedback_key("k"):
                dist.all_reduce(tensor, group=pg)
                dist.all_reduce(tensor, group=pg)
                counted = policy._key_stack[-1][1]
            lowbitcc.end_step()
            outs.append(tensor)
        counts[variant] = (counted, pg._runner.served_compressed, torch.stack(outs))
    return counts


def test_compressed_calls_in_a_feedback_key_block_are_served_and_counted_in_it():
    """A `feedback_key` block around steady compressed calls without feedback (as `lowbitcc
    perf` issues them): the plan core serves them, and each counts in the block as in Python."""
    for counts in run_ranks(_in_a_key_block, 2, timeout=120):
        (py_counted, py_served, py_out), (counted, served, out) = counts["python"], counts["native"]
        assert counted == py_counted == 2
        assert py_served == 0 and served >= 12
        assert torch.equal(out, py_out)


def _seconds_per_call(rank, world, gloo):
    pg = dist.new_group(backend="loco",
                        pg_options=lowbitcc.LocoConfig(min_size=2, cost_model=False))
    runner = pg._runner

    def busy():
        s = lowbitcc.stats()["compressed"]
        return s["codec_s"] + s["wire_s"]

    seen = []
    for step in range(24):
        served = runner.served_compressed
        before = busy()
        begun = time.perf_counter()
        calls = 1 if step % 3 else 2  # two calls between reads: the runner takes the first's
        for _ in range(calls):
            tensor = torch.full((1 << 16,), float(rank + 1))
            with lowbitcc.compressed():
                dist.all_reduce(tensor, group=pg)
            lowbitcc.end_step()
        wall = time.perf_counter() - begun
        seen.append((runner.served_compressed - served, busy() - before, wall))
    return seen


def test_a_served_call_counts_its_codec_and_wire_seconds_by_the_time_it_returns():
    """`lowbitcc.stats()` read after a call a plan core served counts that call's codec and wire
    seconds (not the place's previous call's): more than none, no more than the call's wall
    time; also where two calls ran between reads (the runner took the first's)."""
    for seen in run_ranks(_seconds_per_call, 2, timeout=120):
        served = [(busy, wall) for n, busy, wall in seen if n > 0]
        assert len(served) >= 12, seen
        for busy, wall in served:
            assert 0 < busy <= wall, seen


def _counts(rank, world, gloo):
    """Steps of a compressed and an exact all-reduce; what the statistics count of them where
    the runner served them: read, kept past the group, and where `state.STATS` was replaced."""
    from lowbitcc.counters import Counters, Stats

    pg = dist.new_group(backend="loco",
                        pg_options=lowbitcc.LocoConfig(min_size=1024, cost_model=False))
    runner, held = pg._runner, [pg]  # (`held`: let go of with the group, below)

    def steps(n):
        for _ in range(n):
            with lowbitcc.compressed():
                dist.all_reduce(torch.full((4096,), float(rank + 1)), group=held[0])
            dist.all_reduce(torch.full((256,), float(rank + 1)), group=held[0])  # (exact: < min_size)
            lowbitcc.end_step()

    def calls(stats):
        s = stats.snapshot()
        return s["compressed"]["calls"], s["exact"]["calls"], s["compressed"]["wire_bytes"] > 0

    steps(20)
    served = runner.served
    steps(10)
    fields = {f.name for f in dataclasses.fields(Counters)}
    taken = runner.counts.take_counts()  # (taken from the statistics: read here instead)
    seen = {"served": runner.served - served, "categories": sorted(taken),
            "unknown": sorted(k for counts in taken.values() for k in counts if k not in fields),
            "names": sorted(fields - set(type(runner.counts).names()))}
    steps(3)
    lowbitcc.reset_stats()  # (drops what the runner counted and was not read)
    seen["reset"] = calls(lowbitcc_state.STATS)
    steps(10)
    seen["read"] = calls(lowbitcc_state.STATS)
    before = lowbitcc_state.STATS
    lowbitcc.reset_stats()
    try:
        steps(5)  # counted in `before` ...
        lowbitcc_state.STATS = Stats()
        steps(3)  # ... these in the new one
        seen["replaced"] = (calls(before), calls(lowbitcc_state.STATS))
    finally:
        lowbitcc_state.STATS = before
    lowbitcc.reset_stats()
    steps(4)
    dist.destroy_process_group(pg)
    del pg, runner
    stats = lowbitcc_state.STATS
    with stats._reading, stats._lock:  # (the group let go of inside a read, as the collector may)
        held.clear()
        gc.collect()
        handed = len(stats._gone)
    seen["gone"] = (calls(stats), len(stats._counting), handed)
    return seen


def test_the_counts_of_served_calls_are_read_with_the_statistics_and_kept_past_their_group():
    """The statistics of served calls are counted in C++ (`ServedCounts`, under the counters'
    names) and added when read, or dropped by a reset: every call once, in the statistics that
    were `state.STATS` when it ran (a replaced one's calls in the one replaced), and those not
    yet read when the group goes, kept, also where it goes inside the statistics' locks (the
    garbage collector may destroy it there: nothing waits for them)."""
    for seen in run_ranks(_counts, 2, timeout=120):
        assert seen["served"] == 20, seen
        assert seen["categories"] == ["compressed", "exact"] and seen["unknown"] == [], seen
        assert seen["names"] == ["input_sq", "residual_sq"], seen  # (the encodes' sums)
        assert seen["reset"] == (0, 0, False), seen
        assert seen["read"] == (10, 10, True), seen
        assert seen["replaced"] == ((5, 5, True), (3, 3, True)), seen
        assert seen["gone"] == ((4, 4, True), 0, 1), seen


def _nan_outputs(rank, world, gloo):
    pg = dist.new_group(backend="loco",
                        pg_options=lowbitcc.LocoConfig(min_size=1024, cost_model=False))
    runner = pg._runner
    seen = []
    for _ in range(12):
        small = torch.tensor([1.0, float("nan")])  # a count and a NaN loss: exact (below min_size)
        big = torch.full((4096,), float("nan"))  # NaN past its first 16: a compressed place
        big[:16] = rank + 1.0
        served = runner.served_compressed
        raised = None
        try:
            dist.all_reduce(small, group=pg)
            with lowbitcc.compressed():
                dist.all_reduce(big, group=pg)
        except Exception as exc:  # noqa: BLE001 (the test reads its type)
            raised = type(exc).__name__
        lowbitcc.end_step()
        seen.append((raised, runner.served_compressed - served, small.tolist(),
                     bool(torch.isnan(big[16:]).all())))
    return seen


def test_outputs_a_deviation_does_not_explain_complete_as_they_are():
    """A Work reads an output for a deviating peer's NaN (`deviated_output`) only at an exact
    place of at least 32 elements: a 2-element exact call whose second element is NaN, and a
    compressed call served by a plan core whose input is NaN past its first 16 elements,
    complete without an error, NaN where their inputs are."""
    for seen in run_ranks(_nan_outputs, 2, timeout=120):
        assert all(raised is None for raised, *_ in seen), seen
        assert sum(served for _, served, _, _ in seen) > 6, seen  # the core ran most
        for _, _, small, big_nan in seen:
            assert small[0] == 2.0 and small[1] != small[1] and big_nan, seen


def _ddp_deviates(rank, world, gloo):
    from lowbitcc.backend.deviated_output import MESSAGE

    # min_size 1024: the buckets (about 2,500 elements) may be compressed; `exact()` keeps their
    # places exact whatever the cost model finds; the worker issuer, whatever LOCO_ISSUER says
    pg = dist.new_group(backend="loco",
                        pg_options=lowbitcc.LocoConfig(min_size=1024, issuer="auto"))
    runner = pg._runner
    model, opt = bucketed_ddp(pg)
    outcomes = []
    for step in range(9):
        forced = step == 8 and rank == 1  # rank 1's buckets compressed: not the places' entries
        served = runner.served
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(100 * rank + step))
        try:
            with lowbitcc.compressed() if forced else lowbitcc.exact():
                model(x).square().mean().backward()
            outcomes.append(("ok", runner.served - served))
        except Exception as exc:  # noqa: BLE001 (the test reads its message)
            outcomes.append(((type(exc).__name__, MESSAGE[:60] in str(exc)),
                             runner.served - served))
            break
        opt.step()
        opt.zero_grad()
        lowbitcc.end_step()
    return outcomes


def test_a_ddp_bucket_whose_peer_deviated_raises_from_the_reducers_future():
    """DDP reads a bucket call's result through its Work's future in C++ (the reducer's
    `getFuture`, not Python's `wait`): where the runner served rank 0's steady exact bucket
    calls (`exact()` blocks) and rank 1 compressed its backward (not the places' entries), rank
    0's backward raises the deviation (its C++ future saw the output rank 1 left) at that step,
    as rank 1 does."""
    results = run_ranks(_ddp_deviates, 2, timeout=120)
    for rank, outcomes in enumerate(results):
        assert [o for o, _ in outcomes[:8]] == ["ok"] * 8, (rank, results)
        # rank 0 the other ranks' error (through the reducer: a RuntimeError with its message),
        # rank 1 its own (raised in Python: the class itself)
        assert outcomes[8][0] == (("RuntimeError", True) if rank == 0 else
                                  ("CollectiveMismatchError", False)), (rank, results)
        assert outcomes[7][1] > 0, outcomes  # steady: the runner served the bucket calls
        if rank == 0:
            assert outcomes[8][1] > 0, outcomes  # and served the deviating step's on rank 0


def _feedback_through_faults(rank, world, gloo, collective, schedule, issuer):
    # one LoCo place (every call a step, outside backward), served by its core, the Python path,
    # or either at random; a NaN in rank 0's input at call 8 (its encode drops its states, the
    # others' decodes void theirs), rank 1's call not the place's at call 16 (every rank raises);
    # an all-reduce's step also has two places under one named key (the second takes the state
    # the first stored, its run perhaps still decoding)
    config = lowbitcc.LocoConfig(min_size=2, cost_model=False, feedback=True, schedule=schedule,
                                 issuer=issuer, node_size=2 if schedule == "hierarchical" else 0)
    runs = {}
    for variant in ("python", "native", "mixed"):
        pg = dist.new_group(backend="loco", pg_options=config)
        if variant == "python":
            pg._runner = steady_runner.NoRunner()
        elif variant == "mixed":
            pg._runner.decline_at_random(0.5, 7 * world + rank)
        gen = torch.Generator().manual_seed(rank)
        outputs, raised = [], []
        for call in range(28):
            n = 4096 + 64 * (call == 16 and rank == 1)
            tensor = torch.randn(n, generator=gen)
            if call == 8 and rank == 0:
                tensor[100] = float("nan")
            try:
                with lowbitcc.compressed():
                    if collective == "all_reduce":
                        dist.all_reduce(tensor, group=pg)
                        out = tensor
                        # (not the hierarchical schedule's: there only the ranks that read a
                        # flagged message raise at the deviating call, the others at the
                        # place's run after next, so a raise that skipped the step's later
                        # calls would leave the ranks' programs issuing different calls)
                        shared_places = 0 if schedule == "hierarchical" else 2
                        for _ in range(shared_places):  # two more places, one key: in turn
                            with lowbitcc.feedback_key("shared"):
                                shared = torch.randn(2048, generator=gen)
                                dist.all_reduce(shared, group=pg)
                            outputs.append(shared.view(torch.int32).clone())
                    else:
                        out = torch.empty(n // world)
                        dist.reduce_scatter_tensor(out, tensor, group=pg)
                outputs.append(out.view(torch.int32).clone())
            except Exception as exc:  # noqa: BLE001 (the test reads its type)
                raised.append((call, type(exc).__name__))
            finally:
                lowbitcc.end_step()
        runs[variant] = {"outputs": outputs, "raised": raised, "feedback": _feedback_states(pg),
                         "served": pg._runner.served_compressed if variant != "python" else 0}
    return runs


@pytest.mark.parametrize(("world", "collective", "schedule", "issuer"), [
    (2, "all_reduce", "direct", "auto"), (3, "all_reduce", "direct", "auto"),
    (2, "reduce_scatter", "direct", "auto"),
    # the tree's root meets rank 1's deviation in its children's messages and flags what it
    # sends down, which is all rank 2 meets; the ring's ranks meet it, or sums flagged after
    # it, at their hops
    (3, "all_reduce", "tree", "auto"), (2, "reduce_scatter", "tree", "auto"),
    (3, "all_reduce", "ring", "auto"), (2, "reduce_scatter", "ring", "auto"),
    # (the calling thread's issuer: a run that raises keeps its canary as the worker's does)
    (3, "all_reduce", "tree", "inline"), (3, "all_reduce", "ring", "inline"),
    # two nodes of two ranks: rank 1's node partner sums its NaN-run call exactly, rank 3 (the
    # other node, its rail's peer) meets its flagged messages
    (4, "all_reduce", "hierarchical", "auto"), (4, "reduce_scatter", "hierarchical", "auto")])
def test_error_states_through_a_nan_and_a_deviation_are_the_same_on_either_path(
        world, collective, schedule, issuer):
    """A LoCo place whose rank 0 sends a NaN once and whose rank 1 deviates once: its plan's core
    (which puts the states back before its last decodes, with the run's verdict) and the
    Python path (which drops them at the call's end), alone or at random per call, leave the same
    outputs (bit for bit, NaN included), errors and error states, and the core ran most calls."""
    for rank, runs in enumerate(run_ranks(_feedback_through_faults, world, collective, schedule,
                                          issuer, timeout=300)):
        want = runs["python"]
        # (the tree: a rank that met no deviated message leaves NaN outputs, whose canaries make
        # every rank exchange, and raise, at the places' runs after next: `call_schedule`)
        # (hierarchical: rank 1's node partner sums the NaN of its agreed run exactly, and
        # raises at the canary of its run after next, `deviation`)
        calls = [c for c, _ in want["raised"]]
        assert (calls == [16] if schedule == "direct" else
                calls[0] in (16, 18) if schedule == "hierarchical" else calls[0] == 16), (
            rank, want["raised"])
        assert want["feedback"], "the calls kept error states"
        for variant in ("native", "mixed"):
            run = runs[variant]
            assert run["raised"] == want["raised"], (rank, variant)
            assert len(run["outputs"]) == len(want["outputs"])
            for call, (got, expected) in enumerate(zip(run["outputs"], want["outputs"])):
                assert torch.equal(got, expected), (rank, variant, call)
            _assert_same_states(run["feedback"], want["feedback"], (rank, variant))
        assert runs["native"]["served"] > 16, runs["native"]["served"]
        assert 0 < runs["mixed"]["served"] < runs["native"]["served"]


def _corrupt_on_a_served_schedule(rank, world, gloo, schedule, served):
    # rank 1's first message of codes: a tree leaf's, or the ring's first hop
    return corrupt_first_codes(rank, 1, "send_async", served, schedule)


@pytest.mark.parametrize("schedule", ["tree", "ring"])
def test_a_corrupt_message_on_the_tree_or_ring_raises_the_same_on_either_path(schedule):
    """Rank 1's first message of a steady call travels corrupt (the tree: a leaf's codes of
    every row, its first row's header broken; the ring: its first hop's chunk 0), 3 ranks:
    whether ranks 0 and 2 run the call in Python or by the plan's C++ core, every rank raises
    the same error and leaves NaN in the same chunks (the ranks that received it, and those
    whose result was built from it), and the next call works."""
    python, served = (run_ranks(_corrupt_on_a_served_schedule, 3, schedule, way, timeout=120)
                      for way in (False, True))
    assert [r[:3] for r in python] == [r[:3] for r in served], (python, served)
    assert "WireFormatError" in [r[0] for r in python], python  # the receiver's own
    assert all(r[2] for r in python), python  # the next call
    assert [r[3] for r in served] == [1, 0, 1], served  # the cores ran it on ranks 0 and 2


DEAD_PEER_STATS = r"""
import datetime, json, os, sys, torch, torch.distributed as dist, lowbitcc
from lowbitcc.backend import steady_runner
path = sys.argv[1]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=4))
# (nodes of two ranks: ranks 0 and 1 on one, 2 on the other, so some bytes cross nodes)
pg = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(
    cost_model=False, min_size=1024, schedule="direct", node_size=2),
    timeout=datetime.timedelta(seconds=4))
if path == "python":
    pg._runner = steady_runner.NoRunner()
x = torch.linspace(-1, 1, 20_000)
for _ in range(12):  # the place agreed, its runs steady
    with lowbitcc.compressed():
        dist.all_reduce(x.clone(), group=pg)
dist.barrier()
sent = lambda: {k: lowbitcc.stats()["compressed"][k]
                for k in ("calls", "wire_bytes", "intra_node_bytes", "inter_node_bytes")}
steady = sent()
with lowbitcc.compressed():
    dist.all_reduce(x.clone(), group=pg)
before = sent()
dist.barrier()
if dist.get_rank() == 2:
    os._exit(3)
try:
    with lowbitcc.compressed():
        dist.all_reduce(x.clone(), group=pg)
    raised = False
except Exception:
    raised = True
after = sent()
served = 0 if path == "python" else pg._runner.served_compressed
print(json.dumps({"raised": raised, "served": served,
                  "steady": {k: before[k] - steady[k] for k in before},
                  "failed": {k: after[k] - before[k] for k in after}}), flush=True)
os._exit(0)
"""


def _dead_peer_stats(path: str) -> list[dict]:
    """Ranks 0 and 1's statistics of one steady compressed all-reduce on 3 ranks, then of one
    that fails (rank 2 exited before it), with every call through the C++ runner (``path``
    "native") or through Python ("python")."""
    import json
    import os

    ranks = run_script_ranks(DEAD_PEER_STATS, path, world=3,
                             port=20000 + (os.getpid() + 11 * len(path)) % 20000)
    assert ranks[2][0] == 3, ranks[2][2][-2000:]
    for code, out, err in ranks[:2]:
        assert code == 0 and out.strip(), err[-3000:]
    return [json.loads(out) for _, out, _ in ranks[:2]]


@pytest.mark.slow  # (six rank processes, 40-70 s here)
def test_a_call_a_dead_peer_fails_counts_the_bytes_it_started_on_either_path():
    """A steady compressed call that fails mid-way (a peer gone) counts the bytes of the
    transfers it started, on the runner's path (its plan core meters each transfer it starts)
    as on Python's (`MeteredTransport` does), not the whole call's: on the direct schedule's
    two phases the all-to-all starts (gloo queues it; its failure comes at the wait), so its
    all-gather never starts: half the steady call's bytes. (Not the tree's or the ring's: their
    sends to a peer gone fail at the start or at the wait, as gloo happens to see the closed
    connection, on either path.)"""
    python, native_ = _dead_peer_stats("python"), _dead_peer_stats("native")
    for rank, (p, n) in enumerate(zip(python, native_, strict=True)):
        assert p["raised"] and n["raised"], (rank, p, n)
        assert n["served"] >= 10 and p["served"] == 0, (rank, n)  # (the runner's runs)
        assert n["steady"] == p["steady"], (rank, p, n)
        assert n["failed"] == p["failed"], (rank, p, n)
        assert 2 * p["failed"]["wire_bytes"] == p["steady"]["wire_bytes"], (rank, p)
        assert p["steady"]["inter_node_bytes"] > 0, (rank, p)  # (to rank 2)
