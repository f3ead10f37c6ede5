"""Bad input fails loudly on every rank, within the timeout, never hangs or lies."""

from __future__ import annotations

import datetime
import math
import time

import pytest
import torch
import torch.distributed as dist

import lowbitcc
from tests.support.ranks import run_ranks


def _mismatch(rank, world, gloo, what):
    n = 100_000
    t = torch.randn(n + (rank if what == "shape" else 0))
    if what == "dtype" and rank == 1:
        t = t.to(torch.bfloat16)
    try:
        with lowbitcc.compressed():
            if what == "reduce_scatter":
                m = n // world + rank  # consistent on each rank, different across ranks
                dist.reduce_scatter_single(torch.empty(m), torch.randn(m * world))
            else:
                dist.all_reduce(t)
    except Exception as exc:  # noqa: BLE001
        msg = str(exc)
    else:
        msg = ""
    # the group must still work after a detected mismatch
    ok = torch.ones(3)
    dist.all_reduce(ok)
    return msg, bool((ok == world).all())


@pytest.mark.parametrize("what", ["shape", "dtype", "reduce_scatter"])
def test_mismatch_across_ranks_raises_everywhere(what):
    for msg, still_works in run_ranks(_mismatch, 3, what, timeout=60, pg_timeout_s=20):
        assert "issued different collectives" in msg, msg
        assert "rank 0" in msg and "rank 2" in msg
        assert still_works


def _non_finite(rank, world, gloo):
    n = 70_000
    key = "grad"
    finite_out = torch.randn(n)
    with lowbitcc.compressed(), lowbitcc.feedback_key(key):
        dist.all_reduce(finite_out)  # builds state
    states_before = {k for k in lowbitcc.state_dict()["states"] if "|grad|" in k}
    bad = torch.randn(n)
    if rank == 0:
        bad[5] = float("nan")
    if rank == 1:
        bad[-1] = float("inf")
    with lowbitcc.compressed(), lowbitcc.feedback_key(key):
        dist.all_reduce(bad)
    states_after = {k for k in lowbitcc.state_dict()["states"] if "|grad|" in k}
    again = torch.randn(n)
    with lowbitcc.compressed(), lowbitcc.feedback_key(key):
        dist.all_reduce(again)
    return {
        "before": len(states_before),
        "after": len(states_after),
        "nan_seen": bool(torch.isnan(bad[5])),
        "inf_region_nonfinite": not math.isfinite(float(bad[-1])),
        "all_finite": bool(torch.isfinite(bad).all()),
        "recovered": bool(torch.isfinite(again).all()),
    }


def test_non_finite_inputs_propagate_and_reset_state():
    for r in run_ranks(_non_finite, 2, env={"LOCO_FEEDBACK": "1"}):
        assert r["before"] == 1  # direct's two-rank all-reduce has one stage ("gather")
        assert r["after"] == 0, r
        assert r["nan_seen"] and r["inf_region_nonfinite"] and not r["all_finite"], r
        assert r["recovered"], r


def test_invalid_config_raises_at_init(monkeypatch, tmp_path):
    monkeypatch.setenv("LOCO_BITS", "5")
    with pytest.raises(ValueError, match="invalid bits=5"):
        dist.init_process_group(
            "loco", init_method=f"file://{tmp_path}/store", rank=0, world_size=1,
            timeout=datetime.timedelta(seconds=10),
        )
    if dist.is_initialized():
        dist.destroy_process_group()
    monkeypatch.delenv("LOCO_BITS")
    monkeypatch.setenv("LOCO_BETTA", "0.5")
    with pytest.raises(ValueError, match="unknown environment variable LOCO_BETTA"):
        dist.init_process_group(
            "loco", init_method=f"file://{tmp_path}/store2", rank=0, world_size=1,
            timeout=datetime.timedelta(seconds=10),
        )
    if dist.is_initialized():
        dist.destroy_process_group()


def test_pg_options_of_wrong_type_raise(tmp_path):
    with pytest.raises(TypeError, match="must be a lowbitcc.LocoConfig"):
        dist.init_process_group(
            "loco", init_method=f"file://{tmp_path}/store", rank=0, world_size=1,
            pg_options={"bits": 4},
        )
    if dist.is_initialized():
        dist.destroy_process_group()


def _meta_tensor_refused(rank, world, gloo):
    try:
        dist.all_reduce(torch.ones(3, device="meta"))
    except Exception as exc:  # noqa: BLE001
        return str(exc)
    return ""


def test_non_cpu_tensor_is_refused_with_a_clear_error():
    for msg in run_ranks(_meta_tensor_refused, 2, timeout=60):
        assert "got a meta tensor" in msg and "serves CPU and CUDA tensors" in msg, msg


def _bounded_keys(rank, world, gloo):
    group = dist.new_group(backend="loco")
    for i in range(6):
        with lowbitcc.compressed(), lowbitcc.feedback_key(f"tensor{i}"):
            dist.all_reduce(torch.ones(70_000), group=group)
    return len(lowbitcc.state_dict()["states"])


def test_max_keys_bounds_the_feedback_store():
    """LOCO_MAX_KEYS / LocoConfig.max_keys is the store's bound (it used to keep 4096). The
    store is shared by every group of the process, so its bound is the largest any group set."""
    # 6 keys (one stage each: a two-rank all-reduce) would be 6 states without the bound
    assert run_ranks(_bounded_keys, 2, env={"LOCO_MAX_KEYS": "3", "LOCO_FEEDBACK": "1"}) == [3, 3]


def _late_sender(rank, world, gloo):
    t = torch.zeros(10)
    if rank == 0:
        work = dist.irecv(t, src=1)
        start = time.monotonic()
        try:
            work.wait(timeout=datetime.timedelta(seconds=0.5))
            timed_out = False
        except dist.DistBackendError as exc:
            timed_out = "timed out" in str(exc)
        waited = time.monotonic() - start
        dist.barrier(group=gloo)
        work.wait()  # no bound: the value arrives
        return timed_out, waited, float(t.sum())
    dist.barrier(group=gloo)
    dist.send(torch.ones(10), dst=0)
    return None


def test_work_wait_honours_its_timeout():
    """Work.wait(timeout) raises at the timeout as gloo's does (it used to block until done)."""
    timed_out, waited, total = run_ranks(_late_sender, 2, timeout=60)[0]
    assert timed_out and waited < 5.0
    assert total == 10.0
