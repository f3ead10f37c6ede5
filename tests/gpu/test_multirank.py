"""Several ranks of real NCCL under "loco" (``pytest -m gpu``; skipped without a GPU).

Ranks map to ``rank % device_count``; where they share a GPU, `spawn.gpu_rank_env` gives each
its own ``NCCL_HOSTID`` (NCCL then takes them for separate nodes over its socket transport),
and the test ids say so. Timings mean nothing there; results do: compressed all-reduce and
reduce-scatter identical on every rank and equal to the same call on CPU tensors (the C++
codec, gloo) bit for bit, a mismatched call raising on every rank, no host synchronisation,
the call schedule's steady state and agreed re-learning (`backend.call_schedule`), and a
rank's invalid arguments refused on every rank. Runs and results: docs/gpu.md.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import lowbitcc
from lowbitcc.backend.call_agreement import CollectiveMismatchError
from lowbitcc.codec import cuda
from lowbitcc.tools import spawn
from tests.backend import test_call_plans as call_plans
from tests.backend import test_call_schedule as schedule
from tests.backend import test_exact_places as places
from tests.backend import test_faults as faults
from tests.schedules import test_hierarchical_inline as hierarchical
from tests.support.ranks import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible to torch"),
    pytest.mark.skipif(not dist.is_nccl_available(), reason="torch was built without NCCL"),
    pytest.mark.skipif(not cuda.available(), reason="CuPy is not installed or sees no GPU"),
]

N = 3 * 65536 + 40


def _placement(world: int) -> str:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    shared = " sharing GPUs (NCCL_HOSTID per rank)" if 0 < gpus < world else ""
    return f"{world} ranks on {gpus} GPU(s){shared}"


WORLDS = [pytest.param(w, id=_placement(w)) for w in (2, 4)]


def _ranks(fn, world: int, *args, timeout: float = 300, pg_timeout_s: float = 60,
           env: dict[str, str] | None = None):
    rank_env = spawn.gpu_rank_env(world, torch.cuda.device_count())
    return run_ranks(fn, world, *args, rank_env=rank_env, timeout=timeout,
                     pg_timeout_s=pg_timeout_s, env=env)


def _same_on_every_rank(t: torch.Tensor, gloo) -> bool:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t, group=gloo)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _compressed_equals_cpu(rank, world, gloo, dtype):
    device = spawn.gpu_device(rank)
    x = torch.randn(N, generator=torch.Generator().manual_seed(rank)).to(dtype)
    on_gpu, on_cpu = x.to(device), x.clone()
    with lowbitcc.compressed():
        with lowbitcc.feedback_key("cuda-all-reduce"):
            dist.all_reduce(on_gpu)
        with lowbitcc.feedback_key("cpu-all-reduce"):
            dist.all_reduce(on_cpu)
    rows = x.reshape(-1)[: (N // world) * world]
    out_gpu = torch.empty(N // world, dtype=dtype, device=device)
    out_cpu = torch.empty(N // world, dtype=dtype)
    with lowbitcc.compressed():
        with lowbitcc.feedback_key("cuda-reduce-scatter"):
            dist.reduce_scatter_tensor(out_gpu, rows.to(device))
        with lowbitcc.feedback_key("cpu-reduce-scatter"):
            dist.reduce_scatter_tensor(out_cpu, rows.clone())
    got = on_gpu.cpu()
    return {"all_reduce_equal": torch.equal(got, on_cpu),
            "reduce_scatter_equal": torch.equal(out_gpu.cpu(), out_cpu),
            "identical": _same_on_every_rank(got, gloo),
            "compressed": lowbitcc.stats()["compressed"]["calls"]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world", WORLDS)
def test_compressed_calls_on_nccl_equal_the_cpu_calls_bit_for_bit(world, dtype):
    for r in _ranks(_compressed_equals_cpu, world, dtype):
        assert r["all_reduce_equal"] and r["reduce_scatter_equal"] and r["identical"], r
        assert r["compressed"] == 4, r  # two calls per device, all compressed


def _mismatch(rank, world, gloo):
    device = spawn.gpu_device(rank)
    x = torch.ones(N + (64 if rank == world - 1 else 0), device=device)
    try:
        with lowbitcc.compressed():
            dist.all_reduce(x)
        torch.cuda.synchronize()
        outcome = "completed"
    except CollectiveMismatchError:
        outcome = "raised"
    y = torch.ones(N, device=device)  # the group goes on
    with lowbitcc.compressed():
        dist.all_reduce(y)
    return outcome, float(y.sum().cpu()) / N


@pytest.mark.parametrize("world", WORLDS)
def test_a_mismatched_call_raises_on_every_rank_and_the_group_goes_on(world):
    for outcome, mean in _ranks(_mismatch, world):
        assert outcome == "raised"
        assert abs(mean - world) < 0.05 * world


def _no_host_sync(rank, world, gloo):
    device = spawn.gpu_device(rank)
    x = torch.randn(N, device=device)
    with lowbitcc.compressed():
        dist.all_reduce(x.clone())  # warm up: buffers, kernels, the descriptor's first use
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with lowbitcc.compressed():
            work = dist.all_reduce(x, async_op=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    work.wait()
    return _same_on_every_rank(x.cpu(), gloo)


@pytest.mark.parametrize("world", WORLDS)
def test_a_compressed_call_enqueues_without_a_host_sync_and_orders_with_the_stream(world):
    assert all(_ranks(_no_host_sync, world))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("plan", ["steady", "every rank deviates alike", "renewed"])
def test_the_call_schedule_on_cuda_equals_the_cpu_inline_path(world, plan):
    """Backward passes of three compressed all-reduces under the call schedule: on CUDA the
    same agreements as on CPU tensors (pass 0 agrees every call, pass 1 closes the period, then
    none; a new bucket order agreed alike by every rank; "renewed": every place agreed again
    every other run in the background, `lowbitcc.backend.renewal`), the same renewals, and the
    same bits."""
    plans = {"steady": schedule._steady, "every rank deviates alike": schedule._every_rank_deviates,
             "renewed": schedule._steady}
    reagree_every = 2 if plan == "renewed" else None
    on_gpu = _ranks(schedule._passes, world, "inline", plans[plan], reagree_every, "cuda")
    on_cpu = run_ranks(schedule._passes, world, "inline", plans[plan], reagree_every)
    for (got, agreements, errors, renewals), (want, cpu_agreements, _, cpu_renewals) in zip(
            on_gpu, on_cpu):
        assert not errors, errors
        assert agreements == cpu_agreements, (agreements, cpu_agreements)
        assert renewals == cpu_renewals, (renewals, cpu_renewals)
        assert schedule._same_passes(got, want)


def test_hierarchical_on_nccl_equals_the_cpu_calls_bit_for_bit():
    """4 ranks as 2 nodes of 2 (``node_size=2``; each rank its own ``NCCL_HOSTID``): node and
    rail NCCL groups, the same bits as the CPU worker path on every rank."""
    on_gpu = _ranks(hierarchical._hierarchical, 4, "inline", 2, "cuda")
    on_cpu = run_ranks(hierarchical._hierarchical, 4, "auto", 2, timeout=240)
    for got, want in zip(on_gpu, on_cpu, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("fmt,feedback", [("auto", None), ("mxfp4", None), ("nvfp4", True)])
@pytest.mark.parametrize("world", WORLDS)
def test_cuda_call_plans_equal_their_jobs_bit_for_bit(world, fmt, feedback):
    """A place's `CallPlan` on CUDA against the same calls run by their jobs (no call taking a
    place: each exchanges): the same results and error states on every rank; the default
    (NVFP4, no error state), MXFP4 (feedback on) and NVFP4 with feedback."""
    planned = _ranks(call_plans._passes, world, True, None, "cuda", fmt, feedback)
    jobs = _ranks(call_plans._passes, world, False, None, "cuda", fmt, feedback)
    for (got, got_states, runs, made), (want, want_states, _, _) in zip(planned, jobs):
        assert made == len(call_plans.CALLS) and runs > call_plans.PASSES, (made, runs)
        assert all(torch.equal(a, b) for pa, pb in zip(got, want) for a, b in zip(pa, pb))
        (got_states, got_counted), (want_states, want_counted) = got_states, want_states
        assert got_counted == want_counted
        for key, state in got_states.items():
            assert torch.equal(state["data"], want_states[key]["data"]), key


MIXED = "records, C++ or Python at random"


def _replay_records_from_cpp_or_python_at_random(rank: int) -> None:
    """Each replay of a host record issued by its C++ replay or step by step in Python, at
    random (seeded by ``rank``); the first replay from C++, and every record must have one."""
    import random

    from lowbitcc.backend import launch_record

    chooser, replay = random.Random(rank), launch_record.LaunchRecord.replay
    natives = [0]

    def mixed(self, stream):
        native = self._native
        assert native is not None, "a host record without its C++ replay on a GPU"
        if natives[0] and chooser.random() < 0.5:
            self._native = None
        else:
            natives[0] += 1
        try:
            replay(self, stream)
        finally:
            self._native = native

    launch_record.LaunchRecord.replay = mixed


def _graph_steps(rank, world, gloo, mode):
    """12 steps of one compressed all-reduce place (a DDP bucket's: the tensor kept, here and
    there another one) on a group whose places replay by ``mode``: "graphs" (``call_graphs``),
    "records" (host records, the default), "records on rank 0" (the others eager: ranks may
    differ in it) or "eager" (neither): every result, and how many runs replayed
    (`place_graph`)."""
    from lowbitcc.backend import place_graph

    replays = [0]
    replay = place_graph.PlaceGraph._replay

    def counted(self, *args, **kwargs):
        replays[0] += 1
        return replay(self, *args, **kwargs)

    place_graph.PlaceGraph._replay = counted
    if mode == MIXED:
        _replay_records_from_cpp_or_python_at_random(rank)
    if mode == "eager" or (mode == "records on rank 0" and rank != 0):
        place_graph.PlaceGraph.of = staticmethod(lambda plan: None)
    group = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(
        cost_model=False, call_graphs=mode == "graphs"))
    device = spawn.gpu_device(rank)
    gen = torch.Generator().manual_seed(rank)
    bucket = torch.empty(N, device=device)
    results = []
    for step in range(12):
        target = bucket if step % 5 else torch.empty_like(bucket)
        target.copy_(torch.randn(N, generator=gen))
        with lowbitcc.compressed(), lowbitcc.feedback_key("graphs"):
            dist.all_reduce(target, group=group)
        lowbitcc.end_step()
        results.append(target.cpu())
    return results, replays[0]


@pytest.mark.parametrize("world", WORLDS)
def test_cuda_call_graphs_replay_the_eager_calls_bit_for_bit(world):
    """``call_graphs`` on (from its plan's third run a place launches graphs, captured where
    the tensor is new: twice for the bucket, again for the tensors that moved) against the
    same calls run eagerly: the same bits on every rank, and graph launches from the third
    planned run on."""
    replayed = _ranks(_graph_steps, world, "graphs")
    eager = _ranks(_graph_steps, world, "eager")
    for (got, replays), (want, none) in zip(replayed, eager, strict=True):
        assert none == 0 and replays >= 6, replays
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("mode", ["records", "records on rank 0", MIXED])
@pytest.mark.parametrize("world", WORLDS)
def test_cuda_call_records_issue_the_eager_calls_bit_for_bit(world, mode):
    """Host records (the default: from its plan's third run a place issues its run from a
    host record, made again where the tensor moved, by its C++ replay) against the same calls
    run eagerly: the same bits on every rank, also where only rank 0 replays, and where each
    replay is issued by C++ or step by step in Python at random."""
    replayed = _ranks(_graph_steps, world, mode)
    eager = _ranks(_graph_steps, world, "eager")
    for rank, ((got, replays), (want, none)) in enumerate(zip(replayed, eager, strict=True)):
        everywhere = mode != "records on rank 0"
        assert none == 0 and (replays >= 6 if rank == 0 or everywhere else replays == 0)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", faults.INLINE_INVALID_CASES)
def test_invalid_arguments_on_one_rank_raise_on_every_rank_and_the_group_goes_on(world, case):
    """As on CPU (tests/backend/test_faults.py), for calls of at least ``min_size`` elements:
    rank 0 raises its own error, the others an `InvalidPeerCallError` naming it, and the next
    calls work. (Calls under ``min_size`` skip the descriptor exchange: docs/reliability.md.)"""
    results = _ranks(faults.invalid_inline_call_on_one_rank, world, case, "cuda", timeout=90,
                     pg_timeout_s=30)
    assert results == [("own", True, True)] + [("peer", True, True)] * (world - 1), results


def _resume(rank, world, gloo):
    device = spawn.gpu_device(rank)
    x = torch.randn(N, generator=torch.Generator().manual_seed(rank)).to(device)
    with lowbitcc.compressed(), lowbitcc.feedback_key("resume"):
        dist.all_reduce(x.clone())
    saved = lowbitcc.state_dict()
    on_cpu = bool(saved["states"]) and all(v["data"].device.type == "cpu"
                                           for v in saved["states"].values())
    runs = []
    for load in (False, True):
        if load:
            lowbitcc.load_state_dict(saved)
        y = x.clone()
        with lowbitcc.compressed(), lowbitcc.feedback_key("resume"):
            dist.all_reduce(y)
        runs.append(y.cpu())
    return on_cpu, torch.equal(*runs), _same_on_every_rank(runs[1], gloo)


@pytest.mark.parametrize("world", WORLDS)
def test_error_states_checkpoint_to_the_cpu_and_resume_on_every_rank(world):
    """Each rank's states are saved as CPU tensors; loaded back, the next call repeats the
    call made from the saved states bit for bit, identical on every rank."""
    assert _ranks(_resume, world, env={"LOCO_FEEDBACK": "1"}) == [(True, True, True)] * world


@pytest.mark.parametrize("world", WORLDS)
def test_exact_cuda_calls_run_as_their_places_agreed_without_an_exchange(world):
    """In steady state an exact CUDA call is NCCL's own call, no descriptor exchange."""
    for exchanges, outcomes, same in _ranks(places._steps, world, "auto", places._steady,
                                            False, (), "cuda"):
        assert exchanges == [len(places.STEADY), 1, 0, 0, 0, 0], exchanges
        assert all(set(row) == {"ok"} for row in outcomes) and all(same), (outcomes, same)


@pytest.mark.parametrize("world", WORLDS)
def test_an_exact_cuda_call_that_deviates_on_one_rank_raises_on_every_rank(world):
    """Rank 1 raises at once; the others' outputs are NaN; the place's next run (step 4) runs
    as agreed, and every rank raises at the run after it (step 5: its canary, copied to pinned
    memory behind an event, read one run behind); then the ranks agree anew."""
    plan = functools.partial(places._one_rank_deviates, "size")
    for rank, (exchanges, outcomes, same) in enumerate(
            _ranks(places._steps, world, "auto", plan, False, (3,), "cuda")):
        assert outcomes[3][1] == ("mismatch" if rank == 1 else "nan"), outcomes
        assert outcomes[4][1] == "ok" and exchanges[4] == 0, (outcomes, exchanges)
        assert outcomes[5][1] == "mismatch", outcomes
        assert same[7] and same[8] and exchanges[8] == 0, (same, exchanges)


@pytest.mark.parametrize(("async_op", "decline"), [(False, 0.0), (True, 0.5)])
def test_exact_cuda_calls_are_served_by_the_device_runner(async_op, decline):
    """Exact CUDA calls at steady places, synchronous or not, are the group's device runner's
    (`steady_runner.device_runner`: NCCL's own call and Work, or where NCCL returns none
    `CudaIssuer.synced`'s, served in C++), every op NCCL runs itself included; a deviation on
    rank 1 raises as through Python: at once on rank 1, NaN outputs on the others, and on every
    rank at the place's run after next (the canary the runner kept: a `DeviceCanary`); and
    the same where the runner declines half its calls at random, a different draw per rank,
    so that steady calls take the Python path too. Two ranks (the suite's `plans` phase)."""
    plan = functools.partial(places._one_rank_deviates, "size")
    for rank, (exchanges, outcomes, same, served) in enumerate(
            _ranks(places._served_steps, 2, "auto", plan, (3,), "cuda", async_op, decline)):
        assert outcomes[3][1] == ("mismatch" if rank == 1 else "nan"), outcomes
        assert outcomes[4][1] == "ok" and exchanges[4] == 0, (outcomes, exchanges)
        assert outcomes[5][1] == "mismatch", outcomes
        assert same[7] and same[8] and exchanges[8] == 0, (same, exchanges)
        # the four places' steady runs (AVG: NCCL's own op), or about half of them
        assert served >= (4 * 4 if not decline else 4), served


def test_compressed_cuda_places_are_taken_by_the_device_runner():
    """Steady compressed CUDA calls have their places taken in C++ by the group's device
    runner, which hands their runs to `Reductions.run`: no descriptor exchanged after the
    agreement, results close to gloo's, every steady call's place taken. Two ranks."""
    for exchanges, _, same, served in _ranks(places._served_steps, 2, "auto",
                                             places._compressed_steps, (), "cuda", False, 0.0,
                                             True):
        assert exchanges == [2, 1, 0, 0, 0] and all(same), (exchanges, same)
        assert served >= 2 * 3, served  # two places, their steady runs


def _cuda_moves(rank, world, gloo, decline):
    """All-gathers into a tensor and a list, broadcasts, all-to-alls (equal splits and
    uneven ones) and a send to the next rank with a receive from the one before of CUDA tensors
    on a "loco" group, as the same calls on the gloo group give them on CPU tensors; the device
    runner's served data movements."""
    device = spawn.gpu_device(rank)
    pg = dist.new_group(backend="loco")
    if decline:
        pg._device_runner.decline_at_random(decline, 1000 + rank)
    same = []
    for step in range(6):
        x = torch.randn(4099, generator=torch.Generator().manual_seed(10 * rank + step))
        gathered = {}
        for group, on in ((pg, device), (gloo, torch.device("cpu"))):
            out = torch.empty(world * x.numel(), device=on)
            work = dist.all_gather_into_tensor(out, x.to(on), group=group,
                                               async_op=step % 2 == 1)
            if work is not None:
                work.wait()
            parts = [torch.empty(7, dtype=torch.int64, device=on) for _ in range(world)]
            dist.all_gather(parts, torch.arange(7, device=on) * (rank + 1) + step, group=group)
            b = x.to(on).to(torch.bfloat16)
            dist.broadcast(b, src=step % world, group=group)
            splits = [] if step % 2 == 0 else [rank + j + 1 for j in range(world)]
            sent = x[:2 * world if not splits else sum(splits)].to(on)
            received = torch.empty_like(sent)
            dist.all_to_all_single(received, sent, splits or None, splits or None, group=group)
            got = torch.empty(33, device=on)  # (even ranks send first: NCCL's sends block)
            for turn in (rank % 2, 1 - rank % 2):
                if turn == 0:
                    dist.send(x[:33].to(on), (rank + 1) % world, group=group)
                else:
                    dist.recv(got, (rank - 1) % world, group=group)
            gathered[group is pg] = [out.cpu(), *(p.cpu() for p in parts), b.cpu(),
                                     received.cpu(), got.cpu()]
        same.append(all(torch.equal(a, b) for a, b in zip(gathered[True], gathered[False],
                                                           strict=True)))
    torch.cuda.synchronize(device)
    return same, pg._device_runner.served_moves


@pytest.mark.parametrize("decline", [0.0, 0.5])
def test_cuda_data_movements_are_served_by_the_device_runner(decline):
    """CUDA all-gathers (into a tensor, synchronous or not, and into a list), broadcasts,
    all-to-alls, sends and receives are the group's device runner's
    (`backend/csrc/runner_moves.h`: NCCL's own call and Work, served in C++), NCCL's results bit
    for bit (gloo's on the same CPU tensors); and the same where the runner declines half of them
    at random, a different draw per rank. Two ranks (the suite's `plans` phase)."""
    moves = 6 * 6  # a step's all-gathers into a tensor and a list, broadcast, all-to-all, p2p
    for same, served in _ranks(_cuda_moves, 2, decline):
        assert all(same), same
        assert (served == moves) if not decline else (0 < served < moves), served


def _compressed_deviation(rank, world, gloo):
    results, _, errors, _ = schedule._passes(
        rank, world, gloo, "auto", functools.partial(schedule._one_rank_deviates, "size"),
        device="cuda", per_call=True)
    return errors, results[5]


@pytest.mark.parametrize("world", WORLDS)
def test_a_compressed_cuda_call_that_deviates_on_one_rank_raises_on_every_rank(world):
    """The deviating rank raises at once; on CUDA the others see the flagged messages as NaN
    and a set verdict word, pass 3 runs as agreed (the canary is read one run behind), and
    every rank raises at the place's run after (pass 4), never hangs; pass 5 is the same call
    everywhere again. Each rank issues every call of a pass (a call that raises ends only
    itself): rank 1 raises at its second call of pass 2 while the others go on to the third,
    which needs rank 1's."""
    ranks = _ranks(_compressed_deviation, world)
    for rank, (errors, _) in enumerate(ranks):
        assert (2 in errors) == (rank == 1) and 4 in errors and 3 not in errors, (rank, errors)
    later = [r[1] for r in ranks]
    for other in later[1:]:
        assert all(torch.equal(a, b) for a, b in zip(later[0], other, strict=True))


def _stalled_peer(rank, world, gloo):
    import datetime
    import time

    group = dist.new_group(backend="loco", timeout=datetime.timedelta(seconds=6))
    x = torch.ones(N, device=spawn.gpu_device(rank))
    for _ in range(3):  # places agreed, then compressed without an exchange
        with lowbitcc.compressed():
            dist.all_reduce(x, group=group)
        lowbitcc.end_step()
    torch.cuda.synchronize()
    if rank != 0:
        time.sleep(20)  # alive, not calling: rank 0's NCCL kernels wait for it
        return "slept"
    with lowbitcc.compressed():
        work = dist.all_reduce(x, group=group, async_op=True)
    try:
        work.wait(datetime.timedelta(seconds=1))
        first = "completed"
    except dist.DistBackendError:
        first = "timed out"
    deadline = time.monotonic() + 15
    while work.exception() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        dist.all_reduce(torch.ones(8, device=x.device), group=group)
        later = "completed"
    except dist.DistBackendError as exc:
        later = "raised" if "watchdog" in str(exc) else str(exc)
    return first, type(work.exception()).__name__, later


def test_a_stalled_peer_fails_the_call_by_the_watchdog_and_the_group_reports_dead():
    """The watchdog: rank 0's compressed call waits in NCCL for a peer that does not
    call; wait(1 s) raises; after the group's timeout (6 s) the watchdog fails the Work, aborts
    the communicator, and rank 0's next call raises naming it."""
    results = _ranks(_stalled_peer, 2, timeout=120)
    assert results[0] == ("timed out", "DistBackendError", "raised"), results
