"""A "loco" group destroyed while gloo's threads still run its last call's callbacks: what those
callbacks held is let go of on a Python thread, never on gloo's (where the gloo group's
destructor would join the thread it runs on and abort the process)."""

from __future__ import annotations

import gc
import time

import pytest
import torch
import torch.distributed as dist

import lowbitcc
from lowbitcc.backend import gloo_threads, native
from tests.support.ranks import run_ranks


def _destroyed_during_a_callback(rank, world, gloo, compressed):
    import threading

    pg = dist.new_group(backend="loco",
                        pg_options=lowbitcc.LocoConfig(min_size=2, cost_model=False))
    runner = pg._runner

    def call(async_op=False):
        tensor = torch.full((4096,), float(rank + 1))
        try:
            if compressed:
                with lowbitcc.compressed():
                    return tensor, dist.all_reduce(tensor, group=pg, async_op=async_op)
            # AVG: the Python callback that finishes it on gloo's thread holds the call
            return tensor, dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=pg,
                                           async_op=async_op)
        finally:
            lowbitcc.end_step()

    for _ in range(12):  # the place steady: its exact entry, or its plan core, serves it
        call()
    before = runner.served_compressed
    if rank == 1:
        time.sleep(0.3)  # rank 0's call is in flight when it adds its callback below
    tensor, work = call(async_op=True)
    # a callback on the future gloo's thread completes (below the Work the runner returns: the
    # AVG's finishing, or the plan core's run): it keeps that thread inside the call's
    # callbacks while this thread destroys the group and lets go of all it held
    future = work.inner.get_future()
    on_gloo = []
    future.then(lambda _: (on_gloo.append(isinstance(threading.current_thread(),
                                                     threading._DummyThread)),
                           time.sleep(0.5)))
    work.wait()
    served = runner.served_compressed - before
    del work, runner, future
    dist.destroy_process_group(pg)
    pg = None  # (the group's last reference here, also call's)
    gc.collect()
    time.sleep(1.0)  # the gloo thread leaves the callbacks meanwhile
    parked = gloo_threads.parked()
    gloo_threads.let_go()
    return served, tensor, on_gloo, parked


NO_CORES = pytest.mark.skipif(native.load() is None, reason="no C++ module: no plan cores")


@pytest.mark.parametrize(("compressed", "issuer"), [
    pytest.param(False, "inline", id="exact AVG"),
    pytest.param(True, "inline", id="plan core", marks=NO_CORES),
    pytest.param(True, "auto", id="plan core on the worker issuer", marks=NO_CORES),
])
def test_a_group_destroyed_while_gloo_runs_its_last_callbacks_is_let_go_of_off_gloos_threads(
        compressed, issuer):
    """Each rank destroys its group right after waiting for a call whose gloo future still runs
    a callback on gloo's thread: an exact AVG's (finished there by a Python callback that holds
    the call, and so the gloo group) and a plan core's run's (its decodes hold the core, and so
    the group); both ranks live on and return the sum."""
    results = run_ranks(_destroyed_during_a_callback, 2, compressed, timeout=120,
                        env={"LOCO_ISSUER": issuer})
    assert results[0][2] == [True]  # rank 0's callback ran on gloo's thread, during the call's
    if compressed:  # the core, let go of on gloo's thread after the callback, parked its group
        assert results[0][3] >= 1
    for served, tensor, _, _ in results:
        if compressed:
            assert served == 1  # the plan core's run
            assert torch.allclose(tensor, torch.full_like(tensor, 3.0), rtol=0.1)
        else:
            assert torch.equal(tensor, torch.full_like(tensor, 1.5))


def test_a_gloo_callback_returns_or_raises_as_its_function_and_parks_nothing_on_a_python_thread():
    """`GlooCallback` returns or raises as its function; run on a thread Python started (here:
    the future completed here) it lets go of the function at once, parking nothing."""
    gloo_threads.let_go()
    done = torch.futures.Future()
    ok = done.then(gloo_threads.GlooCallback(lambda f: f.value() + 1))

    def fails(_):
        raise ValueError("lowbitcc test: raised")

    bad = done.then(gloo_threads.GlooCallback(fails))
    done.set_result(41)
    assert ok.value() == 42
    with pytest.raises(RuntimeError, match="ValueError: lowbitcc test: raised"):
        bad.value()
    assert gloo_threads.on_python_thread() and gloo_threads.parked() == 0
