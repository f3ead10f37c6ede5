"""The steady call in C++: `runner` builds a group's ``SteadyRunner``
(``backend/csrc/steady_runner.h``), and `install` puts the group's ``allreduce`` and
reduce-scatters, and its all-gathers, broadcast, all-to-all, sends and receives (`METHODS`), in its
instance dict as C++ callables (``backend/csrc/group_method.h``) that ask the runner first, so that
a steady call runs no Python frame between c10d's caller and the wire (``dist.all_reduce`` and
``dist.reduce_scatter_tensor`` from Python; through pybind's trampoline DDP's reducer and the
functional all-reduce and reduce-scatter, which reach ``allreduce`` and
``reduce_scatter_single_coalesced``, also put there); every other call goes on to the class's
Python method. Whoever replaces one of them on a group must use a Python callable: pybind's
trampoline takes a C function for "not overridden" and keeps that for the whole class (every
group's calls from C++ would then go to its inner gloo group).

A CPU reduction in the steady state of its place (`reductions`) is served whole by the runner,
without a Python frame, where it is:

- the place's exact entry, for an op the inner gloo group runs itself (`Reductions._run_exact`):
  the call is started on the group's direct gloo group with the GIL released, and its Work is
  the C++ `FollowedWork`;
- the place's compressed all-reduce or reduce-scatter entry, whose plan has a C++ core
  (`plan_cores`): the core encodes in the calling thread, all-gathers on the plan's own gloo
  group and decodes on gloo's thread (`Reductions._plan_run` and `CallPlan.run`, byte for
  byte), once the group's worker has run what was queued before it (`IssueQueue.wait_idle`); a
  core whose runs are whole (the tree's, the ring's, the hierarchical schedule's, an
  all-reduce's two phases on more ranks) runs on the queue's issue lane instead, and the call
  returns once the run is queued (a synchronous call's, c10d's ``asyncOp`` false, on the
  calling thread: its caller waits for it at once).

The runner reads and writes the same objects the Python path does (the schedule's index, the
entry's runs and canary, the call number, the feedback-key ordinal, the cost model's count and
times, the issuer's count, the call's tag; the statistics' counts it keeps in C++, its
``counts``, which `counters.Stats` adds when read: `Stats.watch_counts`), and starts and takes the place's
renewals as `CallSchedule.take` does. Every other call (an exchange, a deviation, a timed exact
run, a plan without a core, a policy block, a callback's call, another thread's) is answered
"not mine" with nothing changed, and the Python path takes it. Where the C++ Works cannot be
built (no compiler, or ``LOWBITCC_NATIVE_WORKS=0``), and in a group without a CPU call schedule,
the runner is a `NoRunner` and every call takes the Python path.

A data movement of one tensor (``_allgather_base``: ``dist.all_gather_into_tensor``, FSDP's
parameter gathers; ``allgather``: ``dist.all_gather``; ``broadcast``: DDP's buffers;
``alltoall_base``: ``dist.all_to_all_single``, a mixture of experts' tokens), and a
point-to-point call (``send``, ``recv``, ``recv_anysource``: a pipeline's stages) is served
whole by the runner too (``backend/csrc/runner_moves.h``), as `data_movement.DataMovements.exact`
runs it: counted in the statistics, then the inner gloo group's own call, started by the calling
thread (the main thread) with the GIL released where the group's worker would start it at once
(nothing queued on it or its issue lane: the call keeps its issue order), and its
``FollowedWork`` (a receive's waited for once: gloo's own waits for another message at each
``wait``); not where the group exchanges a descriptor before each collective data movement
(``check_all``; a point-to-point call exchanges none) nor a ``param_bits`` all-gather, nor
arguments gloo would refuse (the Python path's error then reaches the call's Work, as
before).

A CUDA group has a second runner, its *device runner* (`device_runner`, the group's
``_device_runner``; ``backend/csrc/runner_device.h``): a ``SteadyRunner`` of CUDA tensors over
the group's inner ``ProcessGroupNCCL``, which serves the exact entries of all-reduces and
reduce-scatters as `CudaIssuer` issues them (any thread but a callback's, the inner group's own
Work handed back, or where it ran the call synchronously and returned none the issuer's
`CudaIssuer.synced`; an all-reduce's `DeviceCanary` kept at its place), takes the places of
compressed entries as `CallSchedule.take` does and hands their runs to the Python path's
`Reductions.run` (`CudaIssuer.run_plan`), serves the data movements above on the inner NCCL
group (NCCL's Work, as `CudaIssuer.native` issues them), and declines every other call. The
group's methods ask the CPU runner, then the device runner; each serves only its device type's
tensors.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from lowbitcc import policy, state
from lowbitcc.backend import exact, native, plan_cores, worker_issue, works
from lowbitcc.backend.compressed_calls import CompressedCalls
from lowbitcc.backend.eager import SET_EVAL_FRAME
from lowbitcc.backend.issue_queue import IssueQueue
from lowbitcc.backend.issuer import Issuer
from lowbitcc.transports import gloo


def runner_objects(compressed: CompressedCalls, issuer: Issuer, queue: IssueQueue, inner: Any,
                   world: int) -> dict[str, Any] | None:
    """What a ``SteadyRunner`` reads and writes, by the names it uses (None: the group has no
    CPU call schedule, so no call has an exact entry):

    - ``schedule``: the CPU `CallSchedule` (``_next``, ``_period``, ``_origin``, ``_open``,
      ``_entries``, ``_renew_at``, ``_renew``); ``compressed``: the group's `CompressedCalls`
      (``_modelling``, ``cost_model``, the ordinals' ``_lock``, ``_epoch``, ``_ordinals``);
      ``agreement``: its `CallAgreement` (``next_seq``); ``issuer``: the CPU issuer (its
      ``_issued`` count where ``issuer_counts``: the worker's one timed call in
      ``timed_every``); ``queue``: the `IssueQueue` (``_issued``, ``_group_tag``: the tags;
      ``_pending``, ``wait_idle``: its worker's jobs); ``followed``: the `FollowedWork` Python
      class the queue builds; ``state``: `lowbitcc.state` (its ``STATS``, read at each call);
    - ``logical_bytes``: `exact._logical_bytes`; ``mode_stack``, ``key_stack``: `policy`'s
      blocks, and ``policy_lock`` the lock of its ``key_stack``; ``callback_context``:
      `works`' per-thread callback parent; ``main_thread``: the main thread's ident;
      ``tensor_type``, ``allreduce_options_type``,
      ``reduce_scatter_options_type``: the exact types a served call's arguments have;
      ``plan_core``: `plan_cores.make_core`; ``cpu_device``: the CPU's ``torch.device`` and
      ``encoder_thread``: the ident of the thread the Python path encodes on (the worker, or
      inline the main thread), whose statistics' accumulator a plan core adds its sums to
      (`counters.Stats.accumulator`); ``lane``: the queue's issue lane, where the worker
      issues (`issue_queue`: a plan core's whole runs go there), else None (inline, the calling
      thread issues every call);
    - ``policy``, ``min_size``, ``world``, ``native_ops``: the group's settings and the ops the
      inner gloo group runs itself;
    - ``device``: the device type it serves ("cpu"); ``own_work``: False (it hands back a
      ``FollowedWork``); ``canary``, ``watchdog``, ``synced``, ``reductions``: None (a device
      runner's, `device_runner_objects`);
    - ``inner``: the group's inner gloo group (a ``ProcessGroupGloo``, where its worker issues
      its calls), which the data movements it serves go to (``backend/csrc/runner_moves.h``);
      ``allgather_options_type``, ``broadcast_options_type``, ``alltoall_options_type``: their
      options' exact types;
      ``moves_checked``: whether the group exchanges a descriptor before each CPU data movement
      (`CompressedCalls.checks_data_movement`) and ``param_bits`` its setting (neither is
      served then);
    - ``retain_s``, ``retain_last``: how long it keeps the gloo Works of the calls it served
      (``backend/csrc/retired_works.h``), as `GlooTransport.retire` keeps the Python path's
      (`gloo.RETAIN_S`, `gloo.RETAIN_LAST`).
    """
    schedule = compressed.call_schedules.get("cpu")
    followed = queue._native  # the class `IssueQueue.follow` builds (`works.native_followed`)
    if schedule is None or followed is None:
        return None
    worker = isinstance(issuer, worker_issue.WorkerIssuer)
    return _objects(compressed, issuer, schedule, world) | {
        "device": "cpu", "own_work": False, "canary": None, "watchdog": None, "synced": None,
        "reductions": None, "inner": inner,
        "queue": queue, "followed": followed,
        "timed_every": worker_issue.EXACT_TIMED, "issuer_counts": worker,
        "plan_core": plan_cores.make_core, "cpu_device": torch.device("cpu"),
        "encoder_thread": queue._worker.ident if worker else threading.main_thread().ident,
        "lane": queue.lane if worker else None,
    }


def device_runner_objects(compressed: CompressedCalls, issuer: Issuer, reductions: Any, inner: Any,
                          device: str, world: int,
                          queue: IssueQueue | None = None) -> dict[str, Any] | None:
    """What the ``SteadyRunner`` of ``device``'s calls reads and writes (None: the group has
    no call schedule for ``device``): `runner_objects`' shared names, with ``device``,
    ``own_work`` True (it hands back the inner backend's own Work), ``schedule`` its
    `CallSchedule`, ``issuer`` its issuer (a `CudaIssuer`), ``canary`` the
    issuer's ``canary`` (kept at an exact all-reduce's place), ``watchdog`` the issuer's
    `watchdog.Watchdog` and ``synced`` its `CudaIssuer.synced` (the Work of a call the inner
    backend ran synchronously and returned none for; None: it has neither), ``reductions``
    the group's `Reductions` (whose ``run`` runs a compressed entry), ``inner`` the backend
    its data movements go to (a CUDA group's inner ``ProcessGroupNCCL``), ``queue`` None (the
    calling thread issues the Python path's data movements too, as `CudaIssuer` does; the CPU
    test bed's: the group's `IssueQueue`, whose worker issues them, and ``lane`` its lane); none
    of the compressed entries' (``plan_core``, ``followed``, ``cpu_device``,
    ``encoder_thread``: None) nor the worker's timing (``timed_every`` 0, ``issuer_counts``
    False)."""
    schedule = compressed.call_schedules.get(device)
    if schedule is None:
        return None
    return _objects(compressed, issuer, schedule, world) | {
        "device": device, "own_work": True, "canary": issuer.canary,
        "watchdog": getattr(issuer, "watchdog", None), "synced": getattr(issuer, "synced", None),
        "reductions": reductions, "inner": inner, "queue": queue, "followed": None,
        "timed_every": 0, "issuer_counts": False, "plan_core": None, "cpu_device": None,
        "encoder_thread": None, "lane": None if queue is None else queue.lane,
    }


def _objects(compressed: CompressedCalls, issuer: Issuer, schedule: Any,
             world: int) -> dict[str, Any]:
    """The names `runner_objects` and `device_runner_objects` share."""
    return {
        "schedule": schedule, "compressed": compressed, "agreement": compressed.agreement,
        "issuer": issuer, "state": state,
        "logical_bytes": exact._logical_bytes, "mode_stack": policy._mode_stack,
        "key_stack": policy._key_stack, "policy_lock": policy._lock, "callback_context": works._context,
        "main_thread": threading.main_thread().ident, "tensor_type": torch.Tensor,
        "allreduce_options_type": dist.AllreduceOptions,
        "reduce_scatter_options_type": dist.ReduceScatterOptions,
        "allgather_options_type": AllgatherOptions, "broadcast_options_type": dist.BroadcastOptions,
        "alltoall_options_type": dist.AllToAllOptions,
        "moves_checked": compressed.checks_data_movement(),
        "param_bits": compressed.config.param_bits,
        "retain_s": gloo.RETAIN_S, "retain_last": gloo.RETAIN_LAST,
        "policy": compressed.config.policy, "min_size": compressed.config.min_size,
        "world": world, "native_ops": sorted(int(op) for op in issuer.native_ops),
    }


class NoRunner:
    """The runner of a group without one (see the module docstring): every call is "not
    mine"."""

    served = served_compressed = served_moves = 0

    @staticmethod
    def fold_timings() -> None:
        return None


METHODS = ({"allreduce": "AllReduceMethod"},
           {"reduce_scatter_single": "ReduceScatterMethod",
            "_reduce_scatter_base": "ReduceScatterMethod",
            "reduce_scatter_single_coalesced": "ReduceScatterCoalescedMethod",
            "reduce_scatter_tensor_coalesced": "ReduceScatterCoalescedMethod"},
           {"all_gather_single": "AllGatherBaseMethod", "_allgather_base": "AllGatherBaseMethod"},
           {"allgather": "AllGatherMethod"},
           {"broadcast": "BroadcastMethod"},
           {"all_to_all_single": "AllToAllMethod", "alltoall_base": "AllToAllMethod"},
           {"send": "SendMethod"},
           {"recv": "RecvMethod"},
           {"recv_anysource": "RecvAnysourceMethod"})
"""The group's methods `install` puts in C++, by name: the C++ class of each
(``backend/csrc/group_method.h``), in families whose Python methods route through one another
(the class's ``reduce_scatter_single`` through its ``reduce_scatter_single_coalesced``) or are
one method by two names (``all_gather_single`` and ``_allgather_base``, ``all_to_all_single``
and ``alltoall_base``)."""


def install(group: Any, base: type) -> None:
    """Put ``group``'s reduction methods in C++ (`METHODS`; the coalesced reduce-scatter's
    serves one tensor) in its instance dict (see the module docstring), each falling back to
    the class's Python method of its name (``_reduce_scatter_base``'s is the class's alias of
    ``reduce_scatter_single``, which `eager.eager_methods` leaves unwrapped: the C++ method
    turns frame evaluation off itself); nothing where neither of the group's runners
    (``_runner``, ``_device_runner``) is a ``SteadyRunner`` (the class's methods then take every
    call), and no method of a family of which a subclass of ``base`` (the group's class,
    `LocoProcessGroup`) defines one anew: the subclass's then takes every call that would reach
    it."""
    module = native.load()
    if module is None or (isinstance(group._runner, NoRunner)
                          and isinstance(group._device_runner, NoRunner)):
        return
    cls, ref = type(group), weakref.ref(group)
    for family in METHODS:
        if any(getattr(cls, name) is not getattr(base, name) for name in family):
            continue
        for name, kind in family.items():
            setattr(group, name, getattr(module, kind)(ref, getattr(cls, name),
                                                       module.SteadyRunner, SET_EVAL_FRAME))


def runner(direct: Any, inner: Any, compressed: CompressedCalls, issuer: Issuer,
           queue: IssueQueue, world: int) -> Any:
    """The group's ``SteadyRunner`` over its ``direct`` gloo group (a ``ProcessGroupGloo``,
    which the calling thread alone uses for exact entries; its data movements go to ``inner``,
    the group's inner gloo group), or a `NoRunner` (see the module docstring)."""
    module = native.load()
    objects = runner_objects(compressed, issuer, queue, inner, world)
    if module is None or objects is None:
        return NoRunner()
    return module.SteadyRunner(direct, objects)


def device_runner(inner: Any, compressed: CompressedCalls, issuer: Issuer, reductions: Any,
                  device: str, world: int, *, moves_to: Any = None,
                  queue: IssueQueue | None = None) -> Any:
    """The group's ``SteadyRunner`` of ``device``'s calls (a CUDA group's: ``inner`` its
    ``ProcessGroupNCCL``, ``issuer`` its `CudaIssuer`, ``reductions`` its `Reductions`), which
    serves their exact entries and data movements and takes the places of their compressed
    ones (``backend/csrc/runner_device.h``, ``runner_moves.h``), or a `NoRunner` (no C++ module,
    or no call schedule for ``device``). Tests make one of "cpu" over a group's direct gloo
    group and its CPU issuer: the same code, on CPU tensors, its data movements going to
    ``moves_to`` (the group's inner gloo group; None: ``inner``) once ``queue``'s worker is
    idle (`device_runner_objects`)."""
    module = native.load()
    objects = device_runner_objects(compressed, issuer, reductions,
                                    inner if moves_to is None else moves_to, device, world, queue)
    if module is None or objects is None:
        return NoRunner()
    return module.SteadyRunner(inner, objects)
