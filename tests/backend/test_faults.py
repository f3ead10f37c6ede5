"""Fault and hostile-input scenarios: each must end in the right result or a clear
Python exception on every rank within a hard time limit (``run_ranks``' timeout: a hang fails).

docs/reliability.md lists the scenarios with loco's and gloo's behaviour.
"""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import lowbitcc
import lowbitcc.backend.call_agreement
import lowbitcc.backend.process_group
import lowbitcc.codec.exchange_frame
import lowbitcc.codec.wire
import lowbitcc.cost_model
from lowbitcc.backend import native
from tests.support.corrupt_calls import (
    corrupt_first_codes,
    sending_changed,
    served_by_cores,
    served_group,
    steady_all_reduce,
)
from tests.support.ranks import run_ranks


def _collective_waited_in_a_callback(rank, world, gloo):
    results = []
    for group in (None, gloo):
        a, b = torch.ones(10), torch.full((10,), float(rank))
        fut = dist.all_reduce(a, group=group, async_op=True).get_future().then(
            lambda _, b=b, group=group: dist.all_reduce(b, group=group, async_op=True)
            .get_future().wait())
        fut.wait()
        results.append(b)
    return torch.equal(*results), results[0][0].item()


def test_a_callback_may_issue_a_collective_and_wait_for_it():
    """Callbacks run on a completer thread, not the worker or waiter the nested call needs."""
    assert run_ranks(_collective_waited_in_a_callback, 2, timeout=60) == [(True, 1.0)] * 2


def _callbacks_issue_calls(rank, world, gloo, order):
    """Two all-reduces; a callback of each issues an all-reduce of 1000 floats and waits for it.
    ``order="swapped"``: once both calls completed (so that each callback runs inline, when
    it is added), rank 0 adds A's callback first, rank 1 B's: the two nested calls are issued
    in opposite orders, as concurrent callbacks may issue them. ``order="same"``: both add A's
    first; rank 0 after both calls completed (inline), rank 1 at once (its callbacks may run
    on a completer)."""
    futures = {name: dist.all_reduce(torch.ones(8), async_op=True).get_future()
               for name in "AB"}
    nested = {name: torch.full((1000,), float(rank + 1)) * (1 if name == "A" else 10)
              for name in "AB"}
    if order == "swapped" or rank == 0:
        torch.futures.wait_all(list(futures.values()))
    names = "BA" if order == "swapped" and rank == 1 else "AB"
    try:
        done = [futures[name].then(
                    lambda _, name=name: dist.all_reduce(nested[name], async_op=True)
                    .get_future().wait())
                for name in names]
        torch.futures.wait_all(done)
        raised = "nothing"
    except RuntimeError as exc:
        raised = "mismatch" if "issued different collectives" in str(exc) else str(exc)
    expected = {name: torch.full((1000,), 3.0) * (1 if name == "A" else 10) for name in "AB"}
    right = all(torch.equal(nested[name], expected[name]) for name in "AB")
    after = torch.ones(3)
    dist.all_reduce(after)  # the group is still in step
    return raised, right, after.tolist() == [2.0] * 3


def test_calls_issued_by_callbacks_of_different_calls_in_different_orders_raise():
    """Before, the two nested all-reduces (same size, dtype and op) were paired across ranks
    in issue order: each rank summed its A with the other's B, and the ranks' results differed
    silently (what torch's PowerSGD hook with several buckets did over loco: replicas diverged,
    where gloo hangs). Now each call's descriptor names the call whose callback issued it, and
    every rank raises `CollectiveMismatchError`; the group stays usable."""
    results = run_ranks(_callbacks_issue_calls, 2, "swapped", timeout=60)
    assert [r[0] for r in results] == ["mismatch", "mismatch"] and all(r[2] for r in results)


def test_calls_issued_by_callbacks_match_whether_the_callbacks_ran_inline_or_not():
    """A callback added to a completed future runs inline in the caller's thread, else on a
    completer: either way the calls it issues name the same parent, so the ranks agree."""
    assert run_ranks(_callbacks_issue_calls, 2, "same", timeout=60) == [
        ("nothing", True, True)] * 2


def _train_with_hook(rank, world, gloo, hook_name):
    hooks = {
        "fp16": (default_hooks.fp16_compress_hook, lambda g: g),
        "bf16": (default_hooks.bf16_compress_hook, lambda g: g),
        "powerSGD": (powerSGD_hook.powerSGD_hook,
                     lambda g: powerSGD_hook.PowerSGDState(g, matrix_approximation_rank=1,
                                                           start_powerSGD_iter=2)),
        "batched_powerSGD": (powerSGD_hook.batched_powerSGD_hook,
                             lambda g: powerSGD_hook.PowerSGDState(g, matrix_approximation_rank=1,
                                                                   start_powerSGD_iter=2)),
        "noop": (lambda _state, bucket: _noop(bucket), lambda g: None),
    }
    hook, make_state = hooks[hook_name]
    outcomes = []
    for group in (dist.group.WORLD, gloo):
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                        torch.nn.Linear(64, 8)),
                    process_group=group,
                    # PowerSGD issues its all-reduces from future callbacks, which gloo (2
                    # threads) and loco (a completer pool) may run concurrently: with several
                    # buckets, ranks can issue them in different orders, over gloo too
                    bucket_cap_mb=25 if "powerSGD" in hook_name else 0.005)
        model.register_comm_hook(make_state(group), hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(rank)
        try:
            for _ in range(5):
                opt.zero_grad()
                model(torch.randn(16, 32, generator=gen)).square().mean().backward()
                opt.step()
        except Exception as exc:  # noqa: BLE001 (compared with gloo's outcome)
            outcomes.append(("raised", type(exc).__name__))
            continue
        outcomes.append(("trained", torch.cat([p.detach().flatten() for p in model.parameters()])))
    (kind, ours), (_, theirs) = outcomes
    same = outcomes[0][0] == outcomes[1][0] and (
        torch.equal(ours, theirs) if kind == "trained" else ours == theirs)
    return same, kind


def _noop(bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


BF16_REFUSED = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="torch refuses bf16_compress_hook without CUDA 11+ and NCCL 2.10+, over gloo too")


@pytest.mark.parametrize("hook_name", ["fp16", pytest.param("bf16", marks=BF16_REFUSED),
                                       "powerSGD", "batched_powerSGD", "noop"])
def test_every_ddp_communication_hook_torch_ships_trains_as_over_gloo(hook_name):
    """Below min_size nothing is compressed: DDP with each of torch's hooks must end with the
    parameters it ends with over gloo, bit for bit (PowerSGD waits on collectives inside
    future callbacks: it hung before the completer threads). torch 2.13's batched PowerSGD hook
    fails its own shape assertion on this model over gloo too; it must fail the same way."""
    expected = "raised" if hook_name == "batched_powerSGD" else "trained"
    assert run_ranks(_train_with_hook, 2, hook_name, timeout=120) == [(True, expected)] * 2


def _average_a_parameter_under_no_grad(rank, world, gloo):
    param = torch.nn.Parameter(torch.full((100_000,), float(rank + 1)))
    with torch.no_grad():
        dist.all_reduce(param, op=dist.ReduceOp.AVG)
        with lowbitcc.exact():
            dist.all_reduce(param, op=dist.ReduceOp.AVG)
    return param.requires_grad, param.detach()[:3].tolist()


def test_average_of_a_parameter_in_place_under_no_grad():
    """The in-place division of AVG runs on the worker, whose grad mode is not the caller's."""
    for requires_grad, values in run_ranks(_average_a_parameter_under_no_grad, 2):
        assert requires_grad and values == [1.5, 1.5, 1.5]


def _complex_is_exact(rank, world, gloo):
    x = (torch.arange(100_000) % 7 + 1j * (torch.arange(100_000) % 5)).to(torch.complex64)
    x = x * (rank + 1)
    ours, theirs = x.clone(), x.clone()
    with lowbitcc.compressed():
        dist.all_reduce(ours)
        dist.all_reduce(theirs, group=gloo)
    return torch.equal(ours, theirs), lowbitcc.stats()["compressed"]["calls"]


def test_complex_tensors_travel_exact_even_when_compression_is_forced():
    """c10d hands a complex tensor over as its real view; 4-bit codes would round the imaginary
    parts of small entries to zero."""
    assert run_ranks(_complex_is_exact, 2) == [(True, 0)] * 2


def _wait_with_timeout(rank, world, gloo):
    if rank == 1:
        time.sleep(4)
    work = dist.all_reduce(torch.ones(10), async_op=True)
    started = time.monotonic()
    try:
        work.wait(datetime.timedelta(seconds=1))
        outcome = "completed"
    except dist.DistBackendError as exc:
        outcome = "timed out" if "timed out after 1 s" in str(exc) else str(exc)
    waited = time.monotonic() - started
    work.wait()
    dist.barrier()
    return outcome, waited < 3


INLINE = os.environ.get("LOCO_ISSUER") == "inline"
"""The suite runs under ``LOCO_ISSUER=inline`` too: the CUDA path's issuing logic on CPU."""


@pytest.mark.skipif(INLINE, reason=(
    "an inline route (CUDA; CPU under LOCO_ISSUER=inline) waits for its peers in the calling "
    "thread while a call's place agrees (its first run, then one in 64): the call returns "
    "once the exchange is done, so wait(timeout) bounds only what comes after. CUDA users "
    "get the group's timeout (the watchdog) there, and wait(timeout) on every steady-state "
    "call: test_work_wait_honours_its_timeout_in_steady_state"))
def test_work_wait_honours_its_timeout():
    assert run_ranks(_wait_with_timeout, 2)[0] == ("timed out", True)


def _wait_with_timeout_in_steady_state(rank, world, gloo):
    group = dist.new_group(backend="loco")
    for _ in range(3):  # the call's place agrees, then runs as agreed: no exchange
        dist.all_reduce(torch.ones(10), group=group)
        lowbitcc.end_step()
    if rank == 1:
        time.sleep(4)
    work = dist.all_reduce(torch.ones(10), group=group, async_op=True)
    started = time.monotonic()
    try:
        work.wait(datetime.timedelta(seconds=1))
        outcome = "completed"
    except RuntimeError as exc:
        outcome = "timed out" if "time" in str(exc).lower() else str(exc)
    waited = time.monotonic() - started
    dist.barrier(group=gloo)
    return outcome, waited < 3


def test_work_wait_honours_its_timeout_in_steady_state():
    """On every route, also where a call runs as its place agreed (the inner group's own call
    and Work): rank 1 calls 4 s late, rank 0's wait(1 s) raises in time."""
    assert run_ranks(_wait_with_timeout_in_steady_state, 2)[0] == ("timed out", True)


def _state_of_another_group_size(rank, world, gloo):
    from lowbitcc import state

    coarse = dist.new_group(pg_options=lowbitcc.LocoConfig(group_size=128))
    fine = dist.new_group(pg_options=lowbitcc.LocoConfig(group_size=64))
    x = torch.linspace(-1, 1, 128 * 1024) * (rank + 1)
    with lowbitcc.compressed(), lowbitcc.feedback_key("k"):
        dist.all_reduce(x.clone(), group=coarse)
    # as if ``fine`` were ``coarse`` re-created under the same name with a smaller group size
    coarse_prefix, fine_prefix = f"{coarse.group_name}|k|", f"{fine.group_name}|k|"
    saved = {key.replace(coarse_prefix, fine_prefix): entry
             for key, entry in state.FEEDBACK.state_dict()["states"].items()
             if key.startswith(coarse_prefix)}
    assert saved and all(entry["group_size"] == 128 for entry in saved.values())
    state.FEEDBACK.load_state_dict({"version": 1, "states": saved})
    out = x.clone()
    with lowbitcc.compressed(), lowbitcc.feedback_key("k"):
        dist.all_reduce(out, group=fine)
    kept = [entry for key, entry in state.FEEDBACK.state_dict()["states"].items()
            if key in saved]
    return (len(kept) == len(saved), {(e["group_size"], e["scales"].numel() * 64 == e["data"].numel())
                                      for e in kept}, bool(torch.isfinite(out).all()))


def test_error_state_made_for_another_group_size_is_dropped_not_used():
    """It aborted both ranks in free() (the kernels read scales per 64 from a per-128 state)."""
    assert run_ranks(_state_of_another_group_size, 2) == [(True, {(64, True)}, True)] * 2


def _saved_entry(**changes):
    from lowbitcc.codec.error_state import ErrorState

    e = ErrorState.encode(torch.linspace(-1, 1, 256), "int8", 128)
    entry = {"uses": 3, "dtype": "int8", "group_size": 128, "data": e.data, "scales": e.scales}
    entry.update(changes)
    return {"version": 1, "rank": 0, "states": {"g|k": entry}}


@pytest.mark.parametrize("saved, match", [
    (_saved_entry(scales=torch.ones(1)), "needs 2 contiguous fp32 scales"),
    (_saved_entry(group_size=64), "needs 4 contiguous fp32 scales"),
    (_saved_entry(group_size=0), "group size 0 is not a positive int"),
    (_saved_entry(scales=torch.tensor([1.0, float("nan")])), "scales are not finite"),
    (_saved_entry(data=torch.zeros(256)), "data is not a torch.int8 tensor"),
    (_saved_entry(data=torch.zeros(2, 128, dtype=torch.int8)), "not a contiguous 1-D tensor"),
    (_saved_entry(dtype="fp32", data=torch.full((256,), float("inf")), scales=None),
     "data is not finite"),
    (_saved_entry(dtype="fp8"), "storage 'fp8' is not one of"),
    (_saved_entry(uses=-1), "uses -1 is not a non-negative int"),
    ({"version": 1, "rank": 0, "states": {"g|k": {"data": 1}}}, "an entry is a dict with"),
    ({"version": 1, "rank": 1, "states": {}}, "saved by rank 1, loaded on rank 0"),
    ([1, 2], "version"),
])
def test_load_state_dict_refuses_what_the_codec_cannot_use(saved, match):
    """Each of these loaded silently (then segfaulted, or gave all-NaN results)."""
    from lowbitcc.feedback import FeedbackStore

    store = FeedbackStore()
    store.load_state_dict(_saved_entry(), rank=0)
    with pytest.raises(ValueError, match=match):
        store.load_state_dict(saved, rank=0)
    assert store.keys() == ["g|k"] and store.uses("g|k") == 3


def _two_groups(rank, world):
    return "created"


@pytest.mark.parametrize("setting, values, match", [
    ("LOCO_SCHEDULE", ("direct", "ring"), r"schedule \(rank 0: 'direct', rank 1: 'ring'\)"),
    ("LOCO_CHUNK_SIZE", ("262144", "4096"), r"chunk_size \(rank 0: 262144, rank 1: 4096\)"),
    ("LOCO_POLICY", ("backward", "always"), r"policy \(rank 0: 'backward', rank 1: 'always'\)"),
    ("LOCO_BITS", ("4", "8"), r"bits \(rank 0: 4, rank 1: 8\)"),
    ("LOCO_CHECKSUM", ("1", "0"), r"checksum \(rank 0: True, rank 1: False\)"),
    # rank 1 raises its own error, rank 0 says that rank 1's settings are invalid, and why
    ("LOCO_BITS", ("4", "5"), r"invalid bits=5 \(LOCO_BITS\)"),
])
def test_settings_that_differ_between_ranks_raise_on_every_rank_at_init(setting, values, match):
    """Different schedules hung, different chunk sizes aborted gloo, and an invalid setting on
    one rank left the others blocked until the init timeout."""
    import re

    from lowbitcc.tools import spawn

    started = time.monotonic()
    with pytest.raises(RuntimeError) as raised:
        spawn.run_ranks(_two_groups, 2, backend="loco", timeout_s=60, pg_timeout_s=60,
                        rank_env=[{setting: v} for v in values])
    assert time.monotonic() - started < 40
    errors = str(raised.value)
    assert len(re.findall(match, errors)) == 2, errors
    if values[1] == "5":
        assert "rank 1's 'loco' settings are invalid" in errors


@pytest.mark.parametrize("other", [
    {"wire format": 2, "descriptor exchange bytes": 136},  # an older build
    None,  # a build that publishes no protocol at all
])
def test_builds_that_speak_different_protocols_raise_on_every_rank_at_init(other):
    """Two builds whose descriptor exchanges differ in size made gloo abort the process at the
    first call (an all-gather of 272 bytes against one of 136). Now group creation raises a
    ValueError naming each rank's protocol, on every rank. Two ranks as threads on one store."""
    import threading

    from lowbitcc.backend import agreement
    from lowbitcc.config import LocoConfig

    store, config = dist.HashStore(), LocoConfig.from_env({})
    outcome: dict[int, str] = {}

    def rank(r: int) -> None:
        if r == 1 and other is None:  # publish as a build without the protocol field would
            store.set("lowbitcc/config/1", '{"config": {}}')
            outcome[r] = "old build"
            return
        try:
            agreement.agree(store, r, 2, datetime.timedelta(seconds=20), config,
                            protocol=other if r == 1 else None)
            outcome[r] = "agreed"
        except ValueError as exc:
            outcome[r] = str(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    mine = ", ".join(f"{k} {v}" for k, v in agreement.PROTOCOL.items())
    theirs = "unknown" if other is None else "wire format 2, descriptor exchange bytes 136"
    raising = [0] if other is None else [0, 1]
    for r in raising:
        assert "speak different protocols" in outcome[r], outcome
        assert f"rank 0: {mine}; rank 1: {theirs}" in outcome[r], outcome


def test_ranks_whose_settings_resolve_differently_raise_at_init():
    """A build whose defaults resolve the same settings to another wire (MXFP4 with feedback,
    the default before 2026-11-27) raises at group creation, naming what each rank resolves
    to. Rank 1 publishes as such a build would; rank 0 agrees."""
    import dataclasses
    import json

    from lowbitcc.backend import agreement
    from lowbitcc.config import LocoConfig

    store, config = dist.HashStore(), LocoConfig.from_env({})
    store.set("lowbitcc/config/1", json.dumps({
        "config": {f.name: getattr(config, f.name) for f in dataclasses.fields(LocoConfig)},
        "resolved": {"wire_format": "mxfp4", "wire_group_size": 32, "wire_feedback": True},
        "protocol": agreement.PROTOCOL}))
    with pytest.raises(ValueError, match=r"wire_format, what the settings resolve to \(rank 0: "
                                         r"'nvfp4', rank 1: 'mxfp4'\).*wire_feedback"):
        agreement.agree(store, 0, 2, datetime.timedelta(seconds=20), config)


def test_codec_implementation_is_each_ranks_own():
    from lowbitcc.tools import spawn

    assert spawn.run_ranks(_two_groups, 2, backend="loco", timeout_s=60,
                           rank_env=[{"LOCO_CODEC": "reference"}, {"LOCO_CODEC": "auto"}],
                           ) == ["created"] * 2


BIG = 1 << 17  # elements: above min_size (65536), so every rank exchanges a call descriptor


def _one_rank_compresses(rank, world, gloo):
    x = torch.linspace(-1, 1, BIG) * (rank + 1)
    ours, theirs = x.clone(), x.clone()
    if rank == 0:
        with lowbitcc.compressed():
            dist.all_reduce(ours)
    else:
        dist.all_reduce(ours)
    dist.all_reduce(theirs, group=gloo)
    return torch.equal(ours, theirs), lowbitcc.stats()["compressed"]["calls"]


def test_compressed_on_one_rank_only_runs_exact_on_every_rank():
    """It hung until the timeout: one rank ran the compressed schedule, the other gloo's
    all-reduce. Now the ranks settle it in the descriptor exchange: exact unless all would."""
    assert run_ranks(_one_rank_compresses, 2, timeout=60) == [(True, 0)] * 2


def _mismatched_reductions(rank, world, gloo, kind):
    x = torch.ones(BIG)
    op = dist.ReduceOp.SUM
    if rank == 1 and kind == "dtype":
        x = torch.ones(BIG, dtype=torch.int32)
    if rank == 1 and kind == "op":
        op = dist.ReduceOp.MAX
    started = time.monotonic()
    with (pytest.raises(lowbitcc.backend.process_group.CollectiveMismatchError,
                        match="issued different collectives"), lowbitcc.compressed()):
        dist.all_reduce(x, op=op)
    dist.all_reduce(torch.ones(10))  # the group is still usable
    return time.monotonic() - started < 10


@pytest.mark.parametrize("kind", ["dtype", "op"])
def test_exact_against_compressed_mismatch_raises_on_every_rank(kind):
    """fp32 against int32, SUM against MAX: the ineligible rank's call exchanges a descriptor
    too (it is above min_size), so both raise CollectiveMismatchError at once."""
    assert run_ranks(_mismatched_reductions, 2, kind, timeout=60) == [True, True]


def _join_uneven_inputs(rank, world, gloo):
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                    torch.nn.Linear(512, 256)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    with model.join():
        for _ in range(3 + 2 * rank):
            opt.zero_grad()
            model(torch.randn(8, 256, generator=gen)).square().mean().backward()
            opt.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    return (all(torch.equal(g, gathered[0]) for g in gathered),
            bool(torch.isfinite(flat).all()), lowbitcc.stats()["compressed"]["calls"] > 0)


def test_ddp_join_with_uneven_inputs_completes():
    """The joined rank's shadow all-reduces (outside backward, so exact) met the active rank's
    compressed ones: stuck until the timeout, then a segfault."""
    assert run_ranks(_join_uneven_inputs, 2, timeout=120) == [(True, True, True)] * 2


def test_codec_build_cache_is_keyed_by_what_changes_the_binary(monkeypatch, tmp_path):
    """Two checkouts shared one cache entry and rebuilt each other's (torch's rebuild check
    hashes the absolute include path): 45-80 s inside init_process_group each time."""
    from lowbitcc.codec import cpu

    extension = cpu.EXTENSION
    here = extension.name()
    assert extension.name() == here
    monkeypatch.setattr(extension, "include_dirs", [tmp_path])
    assert extension.name() != here
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert extension.name() != here
    monkeypatch.undo()
    monkeypatch.setenv("CXX", "clang++")
    assert extension.name() != here


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    """A compressed all-reduce's result near the exact one: within 4-bit codes' error."""
    return bool((ours - theirs).norm() / theirs.norm() < 0.3)


class _Corrupted:
    """A transfer whose received row ``row`` gets one byte flipped (as a bad NIC or a stray
    write would): a header byte (``how="header"``) or one bit of a code (``"payload"``); or
    whose rows arrive 4 bytes short (``"truncate"``)."""

    def __init__(self, pending, row, how="header"):
        self.pending, self.row, self.how = pending, row, how

    def wait(self):
        got = self.pending.wait()
        if got.shape[-1] <= lowbitcc.codec.exchange_frame.EXCHANGE_BYTES:  # the descriptor frames' all-gather
            return got
        if self.how == "truncate":
            return got[:, :-4].contiguous()
        if self.how == "payload":
            got[self.row, got.shape[-1] // 2] ^= 0x04  # one code moves by 4 steps
        else:
            got[self.row, 28] ^= 0xFF  # the call signature: the message no longer fits the call
        return got


def _corrupt_message_on_one_rank(rank, world, gloo, phase):
    from lowbitcc.transports import gloo as gloo_transport

    x = torch.linspace(-1, 1, BIG) * (rank + 1)
    method = "all_gather_async" if phase.endswith("gather") else "all_to_all_async"
    how = {"truncated": "truncate", "payload-scatter": "payload",
           "payload-gather": "payload"}.get(phase, "header")
    original = getattr(gloo_transport.GlooTransport, method)
    if rank == 1:
        setattr(gloo_transport.GlooTransport, method, lambda self, send, *out: _Corrupted(
            original(self, send, *out), 0, how))
    try:
        with lowbitcc.compressed():
            dist.all_reduce(x.clone())
        raised = "nothing"
    except lowbitcc.codec.wire.PeerWireFormatError as exc:
        raised = "peer" if "another rank received a corrupt" in str(exc) else str(exc)
    except lowbitcc.codec.wire.WireFormatError as exc:
        raised = "own" if f"rank {rank} received a corrupt" in str(exc) else str(exc)
    setattr(gloo_transport.GlooTransport, method, original)
    ours, theirs = x.clone(), x.clone()
    with lowbitcc.compressed():
        dist.all_reduce(ours)  # the group is still in step
    dist.all_reduce(theirs, group=gloo)
    return raised, bool(torch.isfinite(ours).all()), _close(ours, theirs)


PEER, OWN, NOTHING = ("peer", True, True), ("own", True, True), ("nothing", True, True)


@pytest.mark.parametrize("phase, expected", [
    # rank 1's reduced shard is built from the bad message: ranks 0 and 2 learn it from the flag
    ("scatter", [PEER, OWN, PEER]),
    # the bad all-gathered message hurts rank 1's result only
    ("gather", [NOTHING, OWN, NOTHING]),
    # messages 4 bytes short: the size check, deferred like the header check
    ("truncated", [PEER, OWN, PEER]),
    # one code bit flipped: the checksum refuses what the header check lets through
    ("payload-scatter", [PEER, OWN, PEER]),
    ("payload-gather", [NOTHING, OWN, NOTHING]),
])
def test_a_corrupt_message_on_one_rank_raises_where_it_matters_and_the_group_survives(
        phase, expected):
    """The receiver raised WireFormatError mid-schedule, the sender carried on, and the next
    call aborted. Now every rank finishes the call's transfers, the receiver raises, ranks whose
    result depends on the bad message raise too, and the next call works. Three ranks: on two,
    direct's all-reduce is one all-gather (no scatter phase; the gather cases cover it)."""
    env = {"LOCO_CHECKSUM": "1"} if phase.startswith("payload") else None
    assert run_ranks(_corrupt_message_on_one_rank, 3, phase, timeout=60, env=env) == expected


def _corrupt_chunks_of_a_reduce_scatter(rank, world, gloo, served):
    from lowbitcc.backend import steady_runner
    from lowbitcc.transports import gloo as gloo_transport

    # rows of 4 chunks; each call a step, so that its place is steady from the third call on
    pg = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(
        min_size=2, cost_model=False, chunk_size=1024, max_chunks=0))
    if rank == 1 or not served:  # rank 1 receives through the Python path, where it is patched
        pg._runner = steady_runner.NoRunner()
    x = torch.linspace(-1, 1, 3 * 4096) * (rank + 1)

    def call():
        out = torch.empty(4096)
        with lowbitcc.compressed():
            dist.reduce_scatter_tensor(out, x.clone(), group=pg)
        lowbitcc.end_step()
        return out

    for _ in range(12):
        call()
    original = gloo_transport.GlooTransport.all_to_all_async
    if rank == 1:
        gloo_transport.GlooTransport.all_to_all_async = lambda self, send, *out: _Corrupted(
            original(self, send, *out), 0)
    try:
        call()
        raised = "nothing"
    except lowbitcc.codec.wire.PeerWireFormatError:
        raised = "peer"
    except lowbitcc.codec.wire.WireFormatError as exc:
        raised = "own" if f"rank {rank} received a corrupt" in str(exc) else str(exc)
    gloo_transport.GlooTransport.all_to_all_async = original
    after = call()
    return raised, bool(torch.isfinite(after).all()), pg._runner.served_compressed > 0


@pytest.mark.parametrize("served", [False, True])
def test_a_corrupt_chunk_of_a_reduce_scatter_raises_only_where_it_was_received(served):
    """Rank 1 receives every chunk of a chunked reduce-scatter corrupt: it raises, and ranks 0
    and 2, whose rows do not depend on what rank 1 received, complete (its later chunks' messages
    carry no peer flag, whichever path each rank takes: ranks 0 and 2 through the plan's C++
    core where ``served``); the next call works everywhere."""
    results = run_ranks(_corrupt_chunks_of_a_reduce_scatter, 3, served, timeout=120)
    assert [raised for raised, _, _ in results] == ["nothing", "own", "nothing"], results
    assert all(finite for _, finite, _ in results), results
    if native.load() is not None:
        assert [core for _, _, core in results] == [served, False, served], results


def _corrupt_second_phase_message(rank, world, gloo, served):
    # rank 2's first all-gather of codes: chunk 0's sum, in the second phase
    return corrupt_first_codes(rank, 2, "all_gather_async", served)[:3]


def test_a_corrupt_second_phase_message_raises_the_same_on_either_path():
    """Rank 2's sum of chunk 0 travels corrupt in the all-reduce's second phase (3 ranks, 4
    chunks): every rank received it and raises `WireFormatError` with NaN in that row's chunk
    alone, whether ranks 0 and 1 run the call in Python or through the plan's C++ core; what
    they send after it carries no peer flag on either path (the Python path flagged it, the core
    did not, so their later chunks came out NaN on one path only), and the next call works."""
    python, served = (run_ranks(_corrupt_second_phase_message, 3, way, timeout=120)
                      for way in (False, True))
    only = [[False] * 4, [False] * 4, [True, False, False, False]]  # rank 2's chunk 0
    assert python == served == [("WireFormatError", only, True)] * 3, (python, served)


def _unknown_flag_in_the_first_phase(rank, world, gloo, served):
    pg = served_group(rank, 2, served)  # rank 2 sends through the Python path, patched
    x = torch.linspace(-1, 1, 3 * 4096) * (rank + 1)

    def call():
        out = x.clone()
        with lowbitcc.compressed():
            dist.all_reduce(out, group=pg)
        lowbitcc.end_step()
        return out

    for _ in range(12):
        call()
    before = served_by_cores(pg)

    def flagged(send, rest):  # a flag bit no version uses, on every row rank 2 sends
        send[:, lowbitcc.codec.wire.FLAGS_OFFSET] |= 0x08

    with sending_changed(rank == 2, "all_to_all_async", flagged):
        out = call()
    return out, served_by_cores(pg) - before


def test_a_first_phase_message_the_python_check_accepts_is_summed_by_the_core_too():
    """The plan's C++ core refuses what its whole-header `verify` does not match, which the
    Python path's field-by-field check accepts (an unknown flag bit): on three ranks, where the
    all-reduce's first phase feeds what each rank sends next, the core asks the Python check
    before it treats a message as foreign, and sums it as the Python path does."""
    python, served = (run_ranks(_unknown_flag_in_the_first_phase, 3, way, timeout=120)
                      for way in (False, True))
    for rank, ((want, _), (got, cores)) in enumerate(zip(python, served, strict=True)):
        assert torch.isfinite(want).all() and torch.equal(got, want), rank
        if native.load() is not None:
            assert cores == (0 if rank == 2 else 1), (rank, cores)


FINAL_MESSAGES = {"direct": (2, "all_gather_async", None), "tree": (0, "send_async", 1),
                  "ring": (0, "send_async", 2)}
"""Per schedule, the rank whose messages of a 3-rank all-reduce's last decodes get flagged, the
`GlooTransport` method that sends them, and the first tag they travel under (None: every
message the method sends): the direct schedule's all-gather of rank 2's reduced row; the tree
root's codes going down (`tree.DOWN`); rank 0's all-gather on the ring (one chunk: its tags
follow the two steps' 0 and 1)."""


def _unknown_flag_in_a_final_decode(rank, world, gloo, served, schedule):
    sender, method, final_tag = FINAL_MESSAGES[schedule]
    # (the sender runs in Python, where it is patched)
    pg = served_group(rank, sender, served, schedule=schedule, feedback=True, beta=0.8)
    call = steady_all_reduce(pg, torch.linspace(-1, 1, 3 * 4096) * (rank + 1))
    before = served_by_cores(pg)
    rows = world if schedule == "tree" else 1  # the messages one send carries

    def flagged(send, rest):  # a flag bit no version uses
        if send.numel() > lowbitcc.codec.exchange_frame.EXCHANGE_BYTES and (
                final_tag is None or rest[1] >= final_tag):
            send.view(rows, -1)[:, lowbitcc.codec.wire.FLAGS_OFFSET] |= 0x08

    with sending_changed(rank == sender, method, flagged):
        out = call(12)
    cores = served_by_cores(pg) - before
    return out, call(13), cores


@pytest.mark.parametrize("schedule", ["direct", pytest.param("tree", marks=pytest.mark.slow),
                                      pytest.param("ring", marks=pytest.mark.slow)])
def test_a_final_message_the_python_check_accepts_keeps_the_error_states_on_either_path(schedule):
    """A message of the call's last decodes with a flag bit no version uses (`FINAL_MESSAGES`),
    3 ranks, with LoCo: the core's `verify` refuses it and hands the decode to the Python plan,
    which accepts it as the Python path does; the call's error states are then kept, as the
    Python path keeps them, so the next call, which applies them, is bit for bit the same on
    either path."""
    python, served = (run_ranks(_unknown_flag_in_a_final_decode, 3, way, schedule, timeout=120)
                      for way in (False, True))
    sender = FINAL_MESSAGES[schedule][0]
    for rank, (want, got) in enumerate(zip(python, served, strict=True)):
        assert torch.isfinite(want[0]).all() and torch.equal(got[0], want[0]), rank
        assert torch.equal(got[1], want[1]), rank  # the call after it
        if native.load() is not None:
            assert got[2] == (0 if rank == sender else 1), (rank, got[2])


def _rail_message_changed(rank, world, gloo, served, change):
    # two nodes of two ranks; rank 2 (node 1's first) sends through the Python path, patched:
    # its rail all-gather's codes of the call after the place is steady
    pg = served_group(rank, 2, served, schedule="hierarchical", node_size=2, feedback=True)
    call = steady_all_reduce(pg, torch.linspace(-1, 1, 4 * 4096) * (rank + 1))
    before = served_by_cores(pg)

    def changed(send, rest):  # (the rail's codes; not the node's fp32 nor an exchange frame)
        codes = send.view(-1)
        if codes[:4].numpy().tobytes() == lowbitcc.codec.wire.SHARD_MAGIC:
            if change == "flag":  # a flag bit no version uses: the Python check accepts it
                send.view(2, -1)[:, lowbitcc.codec.wire.FLAGS_OFFSET] |= 0x08
            else:  # another call's number: foreign everywhere
                send.view(2, -1)[:, lowbitcc.codec.wire.SEQ_OFFSET] ^= 0x01

    try:
        with sending_changed(rank == 2, "all_gather_async", changed):
            out = call(12)
        raised = None
    except Exception as exc:  # noqa: BLE001 (the test reads its type)
        raised, out = type(exc).__name__, None
    cores = served_by_cores(pg) - before
    return raised, out, call(13), cores


@pytest.mark.parametrize("change", ["flag", "seq"])
def test_a_hierarchical_rail_message_the_cpp_check_refuses_decodes_as_in_python(change):
    """Rank 2's rail codes of a steady hierarchical all-reduce (two nodes of two ranks, LoCo)
    carry a flag bit no version uses ("flag": the C++ ``verify`` refuses them, the Python check
    accepts them) or another call's number ("seq": foreign): ranks 0, 1 and 3 run the call
    through the plan's C++ core or through Python, and leave the same outputs and errors, bit
    for bit (the core hands the rail's decodes to the Python plan before the node's all-gather,
    so that what the node gathers is the Python path's sums); the next call, which applies the
    error states, is the same too."""
    python, served = (run_ranks(_rail_message_changed, 4, way, change, timeout=180)
                      for way in (False, True))
    for rank, (want, got) in enumerate(zip(python, served, strict=True)):
        assert got[0] == want[0], (rank, got[0], want[0])
        if change == "flag":
            assert want[0] is None and torch.isfinite(want[1]).all(), (rank, want[0])
        elif rank in (0, 2):  # rail 0's ranks received them (1 and 3: NaN, from the node)
            assert want[0] == "WireFormatError", (rank, want[0])
        else:
            assert want[0] is None and torch.isnan(want[1]).any(), (rank, want[0])
        assert (got[1] is None and want[1] is None) or torch.equal(
            got[1].view(torch.int32), want[1].view(torch.int32)), rank  # (NaN included)
        assert torch.equal(got[2], want[2]), rank  # the call after it
        if native.load() is not None:
            assert got[3] == (0 if rank == 2 else 1), (rank, got[3])


def _with_rank_0s_frame_corrupt_on_rank_1(rank, offset, call,
                                          copies=lowbitcc.codec.exchange_frame.FRAME_COPIES):
    """Run ``call()``; in the first exchange, byte ``offset`` of the first ``copies`` copies of
    rank 0's descriptor frame gets flipped as rank 1 receives it (every copy by default).
    Returns "nothing", "raised" (the `WireFormatError` naming that frame) or the text of
    another such error."""
    from lowbitcc.transports import gloo as gloo_transport

    original = gloo_transport.GlooTransport.all_gather
    state = {"done": False}

    def corrupting(self, send):
        got = original(self, send)
        if not state["done"]:
            state["done"] = True
            for copy in range(copies):
                got[0, copy * lowbitcc.codec.exchange_frame.FRAME_BYTES + offset] ^= 0x01
        return got

    if rank == 1:
        gloo_transport.GlooTransport.all_gather = corrupting
    try:
        call()
        return "nothing"
    except lowbitcc.codec.wire.WireFormatError as exc:
        return "raised" if "frame of rank 0 arrived corrupt on rank 1" in str(exc) else str(exc)
    finally:
        gloo_transport.GlooTransport.all_gather = original


def _corrupt_frame_on_one_rank(rank, world, gloo, offset, numel):
    """Rank 1's copy of rank 0's descriptor frame gets byte ``offset`` flipped in the first
    exchange, of an exact all-reduce of ``numel`` floats (3: it travels in the frames)."""
    x = torch.arange(1.0, numel + 1) * (rank + 1)
    y = x.clone()
    raised = _with_rank_0s_frame_corrupt_on_rank_1(rank, offset, lambda: dist.all_reduce(y))
    expected = sum(torch.arange(1.0, numel + 1) * (r + 1) for r in range(world))
    after = x.clone()
    dist.all_reduce(after)  # the group is still in step
    return raised, torch.equal(y, expected), torch.equal(after, expected)


@pytest.mark.parametrize("offset", [
    4,  # the descriptor's version byte
    28,  # its flags: "would compress"
    40,  # the input it carries, or zeros
    140,  # the check itself
])
@pytest.mark.parametrize("numel", [3, 1000])
def test_a_corrupt_descriptor_frame_raises_on_the_rank_that_received_it(offset, numel):
    """Before frames carried a check, a flipped flag sent that rank alone down another path (a
    hang) and a flipped input bit summed into a wrong value on that rank only. Now that rank
    raises naming the sender. The others received every frame intact and complete the call;
    for 3 floats it travels in the frames, so the raising rank has no result. For 1000 floats
    the raising rank's own descriptor says the call is exact on every rank: it takes part in
    the exact all-reduce, then raises, with the sum in its tensor. The group stays in step."""
    # through the worker 3 floats travel in the frames, so the raising rank has no result;
    # an inline route sends no call in its frames: that rank takes the exact path
    rank1 = ("raised", numel > 3 or INLINE, True)
    assert run_ranks(_corrupt_frame_on_one_rank, 3, offset, numel, timeout=60) == [
        ("nothing", True, True), rank1, ("nothing", True, True)]


def _corrupt_frame_where_another_rank_declines(rank, world, gloo):
    """Ranks 0 and 1 would compress a large all-reduce, rank 2 would not (so every rank runs it
    exact); rank 1's copy of rank 0's frame arrives corrupt. Rank 2's intact frame settles the
    path: rank 1 joins the exact call, then raises."""
    x = torch.linspace(-1, 1, BIG) * (rank + 1)
    y, expected = x.clone(), x.clone()

    def call() -> None:
        if rank < 2:
            with lowbitcc.compressed():
                dist.all_reduce(y)
        else:
            dist.all_reduce(y)

    raised = _with_rank_0s_frame_corrupt_on_rank_1(rank, 40, call)
    dist.all_reduce(expected, group=gloo)
    after = x.clone()
    dist.all_reduce(after)  # the group is still in step
    return raised, torch.equal(y, expected), torch.equal(after, expected)


def test_a_corrupt_frame_where_another_rank_declines_compression_still_runs_exact():
    assert run_ranks(_corrupt_frame_where_another_rank_declines, 3, timeout=60) == [
        ("nothing", True, True), ("raised", True, True), ("nothing", True, True)]


def _one_copy_of_a_frame_corrupt(rank, world, gloo, offset, kind):
    """Rank 1 receives the first copy of rank 0's frame with byte ``offset`` flipped; the
    second copy arrives intact. Returns what raised, whether the result is right (the exact sum;
    for a compressed call, near it and bitwise the same on every rank) and whether rank 1 logged
    the corrected copy."""
    import logging

    numel = {"framed": 3, "exact": 1000, "compressed": BIG}[kind]
    x = torch.linspace(-1, 1, numel) * (rank + 1)
    y, expected = x.clone(), x.clone()
    dist.all_reduce(expected, group=gloo)
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logger = logging.getLogger("lowbitcc.backend.call_agreement")
    logger.addHandler(handler)

    def call() -> None:
        if kind == "compressed":
            with lowbitcc.compressed():
                dist.all_reduce(y)
        else:
            dist.all_reduce(y)

    try:
        raised = _with_rank_0s_frame_corrupt_on_rank_1(rank, offset, call, copies=1)
    finally:
        logger.removeHandler(handler)
    if kind == "compressed":
        everyone = [torch.empty_like(y) for _ in range(world)]
        dist.all_gather(everyone, y, group=gloo)
        right = all(torch.equal(everyone[0], t) for t in everyone) and _close(y, expected)
    else:
        right = torch.equal(y, expected)
    logged = any("a copy of rank 0's call descriptor frame arrived corrupt on rank 1" in w
                 for w in warnings)
    return raised, right, logged


@pytest.mark.parametrize("offset", [
    4,  # the descriptor's version byte
    28,  # its flags: "would compress"
    40,  # the input it carries, or zeros
    140,  # the check itself
])
@pytest.mark.parametrize("kind", ["framed", "exact", "compressed"])
def test_a_frame_with_one_intact_copy_settles_the_call_on_every_rank(offset, kind):
    """Every rank sends its frame twice in one exchange. With one copy corrupt, rank 1 takes the
    other, logs it, and completes the call with the others. Before, rank 1 raised, and for a
    compressed call the others waited for it until the group's timeout."""
    assert run_ranks(_one_copy_of_a_frame_corrupt, 3, offset, kind, timeout=60) == [
        ("nothing", True, False), ("nothing", True, True), ("nothing", True, False)]


def _invalid_arguments_on_one_rank(rank, world, gloo, case):
    """Rank 0 calls a reduction with arguments it refuses; the other ranks' are valid."""
    bad = rank == 0
    started = time.monotonic()
    try:
        if case == "list of wrong shapes":
            inputs = [torch.ones(10) for _ in range(world)]
            if bad:
                inputs[1] = torch.ones(12)
            dist.reduce_scatter(torch.empty(10), inputs)
        elif case == "list of wrong length":
            count = world + 1 if bad else world
            dist.reduce_scatter(torch.empty(10), [torch.ones(10) for _ in range(count)])
        elif case == "uneven tensor":
            dist.reduce_scatter_tensor(torch.empty(10), torch.ones(world * 10 + (3 if bad else 0)))
        elif case == "premul on integers":
            dist.all_reduce(torch.ones(10, dtype=torch.int64 if bad else torch.float32),
                            op=dist._make_nccl_premul_sum(0.5))
        elif case == "coalesced, one uneven":
            outputs = [torch.empty(10), torch.empty(BIG)]
            inputs = [torch.ones(world * 10), torch.ones(world * BIG + (1 if bad else 0))]
            with dist._coalescing_manager():
                for out, inp in zip(outputs, inputs):
                    dist.reduce_scatter_tensor(out, inp)
        raised = "nothing"
    except lowbitcc.backend.call_agreement.InvalidPeerCallError as exc:
        raised = "peer" if "rank 0 of group" in str(exc) else str(exc)
    except (ValueError, TypeError) as exc:
        raised = "own" if str(exc).startswith("lowbitcc: ") else str(exc)
    in_time = time.monotonic() - started < 10
    x = torch.linspace(-1, 1, BIG) * (rank + 1)
    exact, compressed, theirs = x.clone(), x.clone(), x.clone()
    dist.all_reduce(exact)  # the group is still in step, for either path
    with lowbitcc.compressed():
        dist.all_reduce(compressed)
    dist.all_reduce(theirs, group=gloo)
    return raised, in_time, torch.equal(exact, theirs), _close(compressed, theirs)


@pytest.mark.parametrize("case", ["list of wrong shapes", "list of wrong length",
                                  "uneven tensor", "coalesced, one uneven",
                                  "premul on integers"])
def test_invalid_arguments_on_one_rank_raise_on_every_rank_and_the_group_survives(case):
    """Rank 0 raised its ValueError and issued nothing, so the others' descriptor exchange
    paired with rank 0's next call: each rank raised a CollectiveMismatchError about other
    calls, and the group stayed out of step (every later call failed). Now rank 0 takes part in
    the exchange with its call flagged invalid: it raises its own error, the others
    `InvalidPeerCallError` naming it, and the next calls work."""
    expected = [("own", True, True, True)] + [("peer", True, True, True)] * 2
    assert run_ranks(_invalid_arguments_on_one_rank, 3, case, timeout=60) == expected


def invalid_inline_call_on_one_rank(rank, world, gloo, case, device="cpu"):
    """Rank 0 calls a reduction of at least ``min_size`` elements with arguments it refuses, on
    an inline route (CUDA tensors; CPU ones under ``LOCO_ISSUER=inline``); the others' are
    valid. Then an exact and a compressed all-reduce show whether the group is in step."""
    if device == "cuda":
        from lowbitcc.tools import spawn

        device = spawn.gpu_device(rank)
    bad = rank == 0
    try:
        if case == "uneven tensor":
            dist.reduce_scatter_tensor(torch.empty(BIG, device=device),
                                       torch.ones(world * BIG + (3 if bad else 0), device=device))
        else:  # a list of the wrong length
            count = world + 1 if bad else world
            dist.reduce_scatter(torch.empty(BIG, device=device),
                                [torch.ones(BIG, device=device) for _ in range(count)])
        raised = "nothing"
    except lowbitcc.backend.call_agreement.InvalidPeerCallError as exc:
        raised = "peer" if "rank 0 of group" in str(exc) else str(exc)
    except (ValueError, TypeError) as exc:
        raised = "own" if str(exc).startswith("lowbitcc: ") else str(exc)
    x = torch.linspace(-1, 1, BIG) * (rank + 1)
    exact, compressed, theirs = x.to(device, copy=True), x.to(device, copy=True), x.clone()
    dist.all_reduce(exact)
    with lowbitcc.compressed():
        dist.all_reduce(compressed)
    dist.all_reduce(theirs, group=gloo)
    return raised, torch.equal(exact.cpu(), theirs), _close(compressed.cpu(), theirs)


INLINE_INVALID_CASES = ["uneven tensor", "list of wrong length"]


@pytest.mark.parametrize("case", INLINE_INVALID_CASES)
def test_invalid_arguments_on_one_rank_of_an_inline_route_raise_on_every_rank(case):
    """The inline issuer (the CUDA path's logic, on CPU tensors): as through the worker, for
    calls of at least ``min_size`` elements, which exchange a descriptor. (Calls under it go
    to the inner group without one, docs/reliability.md: a rank's own refusal then leaves the
    others in the call until the group's timeout.) tests/gpu/test_multirank.py runs this on
    CUDA tensors."""
    results = run_ranks(invalid_inline_call_on_one_rank, 2, case, timeout=60,
                        env={"LOCO_ISSUER": "inline"})
    assert results == [("own", True, True), ("peer", True, True)], results


def _invalid_data_movement_on_one_rank(rank, world, gloo, case):
    """With ``LOCO_CHECK_ALL``, rank 0 (the root where there is one) calls a data movement
    with arguments gloo would refuse; the other ranks' are valid."""
    bad = rank == 0
    t = torch.ones(5)
    try:
        if case == "gather list":
            dist.gather(t, [torch.empty(5)] * (world - 1 if bad else world) if rank == 0
                        else None, dst=0)
        elif case == "scatter list":
            dist.scatter(t, [torch.ones(5)] * (world + 1) if rank == 0 else None, src=0)
        elif case == "all-gather list":
            dist.all_gather([torch.empty(5) for _ in range(world + (1 if bad else 0))], t)
        elif case == "all-gather tensor":
            dist.all_gather_into_tensor(torch.empty(world * 5 + (1 if bad else 0)), t)
        elif case == "broadcast root":
            dist.broadcast(t, src=world + 2 if bad else 0)
        elif case == "reduce root":
            dist.reduce(t, dst=world + 2 if bad else 0)
        raised = "nothing"
    except lowbitcc.backend.call_agreement.InvalidPeerCallError as exc:
        raised = "peer" if "rank 0 of group" in str(exc) else str(exc)
    except ValueError as exc:
        raised = "own" if str(exc).startswith("lowbitcc: ") else str(exc)
    after, theirs = torch.full((3,), float(rank)), torch.full((3,), float(rank))
    dist.broadcast(after, src=1)  # the group is still in step
    dist.broadcast(theirs, src=1, group=gloo)
    return raised, torch.equal(after, theirs)


@pytest.mark.parametrize("case", ["gather list", "scatter list", "all-gather list",
                                  "all-gather tensor", "broadcast root", "reduce root"])
def test_invalid_data_movement_on_one_rank_raises_on_every_rank_with_check_all(case):
    """Before, the descriptors agreed, gloo refused the call on rank 0 alone, and the others
    waited in gloo until the group's timeout. Now rank 0 refuses the call in the exchange."""
    assert run_ranks(_invalid_data_movement_on_one_rank, 3, case, timeout=60,
                     env={"LOCO_CHECK_ALL": "1"}) == [("own", True)] + [("peer", True)] * 2


def _late_peer(rank, world, gloo, kind):
    if rank == 1:
        time.sleep(1.5)
    x = torch.linspace(-1, 1, BIG) * (rank + 1)
    ours, theirs = x.clone(), x.clone()
    if kind == "compressed all-reduce":
        with lowbitcc.compressed():
            dist.all_reduce(ours)
    elif kind == "exact all-reduce":  # outside backward: exact, after the descriptor exchange
        dist.all_reduce(ours)
    elif kind == "framed all-reduce":  # 3 floats: reduced from the descriptor frames
        ours, theirs = ours[:3].clone(), theirs[:3].clone()
        dist.all_reduce(ours)
    elif kind in ("broadcast", "checked broadcast"):
        dist.broadcast(ours, src=0)
        dist.broadcast(theirs, src=0, group=gloo)
        return torch.equal(ours, theirs)
    else:  # barrier, then an all-reduce to see the group in step
        dist.barrier()
        dist.all_reduce(ours)
    dist.all_reduce(theirs, group=gloo)
    return _close(ours, theirs) if kind == "compressed all-reduce" else torch.equal(ours, theirs)


@pytest.mark.parametrize("kind", ["compressed all-reduce", "exact all-reduce", "checked broadcast",
                                  *[pytest.param(k, marks=pytest.mark.slow)
                                    for k in ("framed all-reduce", "broadcast", "barrier")]])
def test_a_late_peer_only_delays_the_call(kind):
    """Rank 1 calls 1.5 s after rank 0, on every path: the descriptor exchange (and the call
    after it) waits, and both ranks get the exact result (the compressed one's within 4-bit
    error). "checked broadcast" exchanges a descriptor first (``LOCO_CHECK_ALL``)."""
    env = {"LOCO_CHECK_ALL": "1"} if kind == "checked broadcast" else None
    assert run_ranks(_late_peer, 2, kind, timeout=60, env=env) == [True, True]


def _absent_peer(rank, world, gloo):
    if rank == 1:  # alive, never calling, past rank 0's timeout (exiting would close the
        time.sleep(8)  # connections and end rank 0's call sooner, or rank 0's own setup)
        return "absent"
    started = time.monotonic()
    try:
        with lowbitcc.compressed():
            dist.all_reduce(torch.ones(BIG))
    except RuntimeError as exc:
        return ("raised", time.monotonic() - started < 15, type(exc).__name__)
    return "completed"


def test_a_peer_that_never_calls_makes_the_call_raise_within_the_group_timeout():
    """pg timeout 5 s: the waiting rank raises a Python exception within it, no hang. Rank 1
    stays alive without calling: it used to return at once, and its exit sometimes closed
    the reference gloo group's connections while rank 0 was still making them (1 failure in
    about 75 runs, "Gloo connectFullMesh failed ... Connection closed by peer")."""
    outcome = run_ranks(_absent_peer, 2, timeout=60, pg_timeout_s=5)[0]
    assert outcome[:2] == ("raised", True), outcome  # the whole outcome if it fails (seen once)


def _two_threads_two_groups(rank, world, gloo):
    import threading

    groups = [dist.new_group(), dist.new_group()]
    results = [None, None]

    def train(i):
        ours = torch.linspace(-1, 1, BIG) * (rank + 1 + i)
        for _ in range(3):
            with lowbitcc.compressed():
                dist.all_reduce(ours, group=groups[i])
        results[i] = ours

    threads = [threading.Thread(target=train, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    gathered = [[torch.empty(BIG) for _ in range(world)] for _ in range(2)]
    for i in range(2):
        dist.all_gather(gathered[i], results[i], group=gloo)
    return all(torch.equal(g[0], g[1]) and bool(torch.isfinite(g[0]).all()) for g in gathered)


def test_two_threads_on_two_groups_at_once():
    """Each group has its own worker; concurrent compressed calls on two groups finish with
    bitwise-identical values on every rank."""
    assert run_ranks(_two_threads_two_groups, 2, timeout=120) == [True, True]


DEAD_PEER_CALL = r"""
import os, sys, time, datetime, torch, torch.distributed as dist, lowbitcc
dist.init_process_group("loco", timeout=datetime.timedelta(seconds=4), pg_options=lowbitcc.LocoConfig(
    cost_model=False, min_size=1024))
dist.barrier()
if dist.get_rank() == 2:
    os._exit(3)
kind, n = sys.argv[1], 100_000
calls = {
    "compressed all_reduce": lambda: dist.all_reduce(torch.ones(n)),
    "compressed reduce_scatter": lambda: dist.reduce_scatter_tensor(torch.empty(n), torch.ones(3 * n)),
    "exact all_reduce": lambda: dist.all_reduce(torch.ones(n, dtype=torch.int32)),
    "all_gather": lambda: dist.all_gather_into_tensor(torch.empty(3 * n), torch.ones(n)),
    "broadcast": lambda: dist.broadcast(torch.ones(n), src=2),
    "barrier": lambda: dist.barrier(),
    "recv": lambda: dist.recv(torch.empty(n), src=2),
}
start = time.monotonic()
try:
    with lowbitcc.compressed():
        calls[kind]()
    print("no error", flush=True)
except Exception as exc:
    print(f"raised after {time.monotonic() - start:.1f} s: {type(exc).__name__}", flush=True)
os._exit(0)
"""


@pytest.mark.parametrize("kind", ["compressed all_reduce", "compressed reduce_scatter",
                                  "exact all_reduce", "broadcast", "recv",
                                  *[pytest.param(k, marks=pytest.mark.slow)
                                    for k in ("all_gather", "barrier")]])
def test_a_dead_peer_makes_every_kind_of_call_raise_on_the_others(kind):
    """Rank 2 exits after the first barrier; ranks 0 and 1 then issue one call of ``kind``
    (group timeout 4 s) and must raise a Python exception within it, whatever the call."""
    from tests.support.ranks import run_script_ranks

    ranks = run_script_ranks(DEAD_PEER_CALL, kind, world=3,
                             port=20000 + (os.getpid() + 7 * len(kind)) % 20000)
    assert ranks[2][0] == 3
    for code, out, err in ranks[:2]:
        assert code == 0 and out.startswith("raised after"), out + err[-2000:]
        assert float(out.split()[2]) < 4 + 6, out


class _FirstCorrupted:
    """A transfer of which only the first shard message received gets a header byte flipped
    (the call signature), whatever its shape: for point-to-point receives (ring, tree)."""

    hit = False

    def __init__(self, pending):
        self.pending = pending

    def wait(self):
        got = self.pending.wait()
        if not _FirstCorrupted.hit and got.shape[-1] > lowbitcc.codec.exchange_frame.EXCHANGE_BYTES:
            _FirstCorrupted.hit = True
            got.view(-1)[28] ^= 0xFF
        return got


def _corrupt_on_another_schedule(rank, world, gloo, schedule):
    from lowbitcc.transports import gloo as gloo_transport

    # hierarchical over two nodes of one rank: direct's two-rank all-reduce, one all-gather
    method = "all_gather_async" if schedule == "hierarchical" else "recv_async"
    original = getattr(gloo_transport.GlooTransport, method)
    if rank == 1:
        setattr(gloo_transport.GlooTransport, method,
                lambda self, *a: _FirstCorrupted(original(self, *a)))
    x = torch.linspace(-1, 1, BIG) * (rank + 1)
    try:
        with lowbitcc.compressed():
            dist.all_reduce(x.clone())
        raised = "nothing"
    except lowbitcc.codec.wire.PeerWireFormatError:
        raised = "peer"
    except lowbitcc.codec.wire.WireFormatError as exc:
        raised = "own" if f"rank {rank} received a corrupt" in str(exc) else str(exc)
    setattr(gloo_transport.GlooTransport, method, original)
    ours, theirs = x.clone(), x.clone()
    with lowbitcc.compressed():
        dist.all_reduce(ours)
    dist.all_reduce(theirs, group=gloo)
    return raised, bool(torch.isfinite(ours).all()), _close(ours, theirs)


@pytest.mark.parametrize("schedule", ["ring", "tree", "hierarchical"])
def test_a_corrupt_message_on_the_other_schedules_raises_and_the_group_survives(schedule):
    """The compressor defers the error on every schedule: rank 1, which received the corrupt
    message, raises; rank 0 raises only if its result was built from rank 1's (peer flag);
    the next call is correct on both."""
    env = {"LOCO_SCHEDULE": schedule, "LOCO_NODE_SIZE": "1"}
    (r0, *rest0), (r1, *rest1) = run_ranks(_corrupt_on_another_schedule, 2, schedule,
                                           timeout=60, env=env)
    assert r1 == "own" and r0 in ("nothing", "peer"), (r0, r1)
    assert rest0 == rest1 == [True, True]


def _all_reduce_against_reduce_scatter(rank, world, gloo):
    started = time.monotonic()
    with (pytest.raises(lowbitcc.backend.process_group.CollectiveMismatchError,
                        match="issued different collectives"), lowbitcc.compressed()):
        if rank == 0:
            dist.all_reduce(torch.ones(2 * BIG))
        else:
            dist.reduce_scatter_tensor(torch.empty(BIG), torch.ones(2 * BIG))
    dist.all_reduce(torch.ones(10))  # the group is still usable
    return time.monotonic() - started < 10


def test_an_all_reduce_against_a_reduce_scatter_raises_on_every_rank():
    """Two compressible calls of different kinds (the same input size): the descriptors name
    the collective, so both ranks raise at once."""
    assert run_ranks(_all_reduce_against_reduce_scatter, 2, timeout=60) == [True, True]


def _mismatched_exact_reductions(rank, world, gloo, kind):
    x = {"across min_size": torch.ones(BIG if rank == 0 else 10),
         "small sizes": torch.ones(10 + rank),
         "small dtypes": torch.ones(10, dtype=torch.int32 if rank == 0 else torch.int64),
         "integer dtypes": torch.ones(BIG, dtype=torch.int32 if rank == 0 else torch.int64),
         }[kind]
    started = time.monotonic()
    with pytest.raises(lowbitcc.backend.process_group.CollectiveMismatchError,
                       match="issued different collectives"):
        dist.all_reduce(x)
    dist.all_reduce(torch.ones(10))  # the group is still usable
    return time.monotonic() - started < 10


@pytest.mark.parametrize("kind", ["across min_size", "small sizes", "small dtypes",
                                  "integer dtypes"])
def test_exact_reductions_that_differ_raise_on_every_rank(kind):
    """Calls that neither rank compresses: one above min_size and one below (the first used to
    exchange a descriptor and the second not: stuck until the timeout), two small calls of
    different sizes or dtypes (gloo's garbage or abort), int32 against int64 (their descriptors
    named both "not a float type"). Every reduction now exchanges a frame of one size."""
    assert run_ranks(_mismatched_exact_reductions, 2, kind, timeout=60) == [True, True]


def _issue(kind: str, rank: int, world: int) -> None:
    """One collective of ``kind`` on the default group (the same call on every rank)."""
    t = torch.ones(2 * BIG if kind.startswith("compressed") else 8)
    if kind == "small all_reduce":
        dist.all_reduce(t)
    elif kind == "compressed all_reduce":
        with lowbitcc.compressed():
            dist.all_reduce(t)
    elif kind == "compressed reduce_scatter":
        with lowbitcc.compressed():
            dist.reduce_scatter_single(torch.empty(t.numel() // world), t)
    elif kind == "reduce":
        dist.reduce(t, dst=0)
    elif kind == "broadcast":
        dist.broadcast(t, src=0)
    elif kind == "all_gather":
        dist.all_gather([torch.empty_like(t) for _ in range(world)], t)
    elif kind == "all_gather_single":
        dist.all_gather_single(torch.empty(world * t.numel()), t)
    elif kind == "gather":
        dist.gather(t, [torch.empty_like(t) for _ in range(world)] if rank == 0 else None, dst=0)
    elif kind == "scatter":
        dist.scatter(t, [torch.ones(8) for _ in range(world)] if rank == 0 else None, src=0)
    elif kind == "all_to_all":
        dist.all_to_all_single(torch.empty_like(t), t)
    elif kind == "barrier":
        dist.barrier()
    else:
        raise AssertionError(kind)


CALL_KINDS = ("small all_reduce", "compressed all_reduce", "compressed reduce_scatter", "reduce",
              "broadcast", "all_gather", "all_gather_single", "gather", "scatter",
              "all_to_all", "barrier")
SAME_CALL = {"all_gather_single": "all_gather"}
"""Kinds that are one call in two forms (list or flat output: the same bytes move)."""


def _every_pair_of_call_kinds(rank, world, gloo):
    outcomes = {}
    for mine in CALL_KINDS:
        for theirs in CALL_KINDS:
            started = time.monotonic()
            try:
                _issue(mine if rank == 0 else theirs, rank, world)
                outcome = "ok"
            except lowbitcc.backend.process_group.CollectiveMismatchError as exc:
                outcome = "mismatch" if "issued different collectives" in str(exc) else str(exc)
            t = torch.ones(3)
            dist.all_reduce(t)  # the group is still usable
            outcomes[mine, theirs] = (outcome, bool((t == world).all()),
                                      time.monotonic() - started < 10)
    return outcomes


def test_every_pair_of_call_kinds_that_differ_raises_on_every_rank():
    """Rank 0 issues one kind of collective and rank 1 another, for every ordered pair of
    eleven kinds (reductions small and compressed, and every exact data movement, which
    exchange a descriptor first under ``LOCO_CHECK_ALL``): both raise CollectiveMismatchError, within
    seconds, and the group goes on; the same call on both ranks completes (an all-gather into
    a list and into one tensor are the same call)."""
    for outcomes in run_ranks(_every_pair_of_call_kinds, 2, timeout=120,
                              env={"LOCO_CHECK_ALL": "1"}):
        for (mine, theirs), (outcome, usable, quick) in outcomes.items():
            same = SAME_CALL.get(mine, mine) == SAME_CALL.get(theirs, theirs)
            assert outcome == ("ok" if same else "mismatch"), (mine, theirs, outcome)
            assert usable and quick, (mine, theirs)
