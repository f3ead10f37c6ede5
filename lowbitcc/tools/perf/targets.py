"""The backends `lowbitcc perf` compares, side by side in the same processes.

Every backend answers the same three calls on CPU tensors: ``all_reduce(out, inp, op)``,
``reduce_scatter(out, inp, op)`` and ``all_gather(out, inp)``; ``out`` may alias ``inp`` (the
in-place variants). Names:

- ``loco4``, ``loco8``, ``loco2`` (``loco`` expands to the ``--bits`` given): a "loco" group
  whose eligible calls are all compressed (policy "always"), the rest of its config from
  ``LOCO_*``;
- ``loco-exact``: a "loco" group with the environment's config (by default: policy
  "backward", call schedule on), whose calls, issued outside backward, stay exact: what a
  user pays for a call that "loco" does not compress (descriptor agreement, schedule);
- ``gloo``: torch's gloo group, exact;
- ``gloo-bf16``: each tensor cast to bf16, reduced by gloo, cast back (what a bf16 compression
  hook does; the error column shows its rounding);
- ``mpi``: MPI through mpi4py (needs ``pip install 'lowbitcc[mpi]'`` and a start under
  ``mpiexec``), exact;
- ``nccl``: torch's NCCL group on CUDA copies of the tensors (needs a GPU).

The wire column is what this rank sends per call: measured from `lowbitcc.stats()` for loco's
compressed calls (headers and scales included), the ring volume ``bus_factor * size`` scaled by
the wire dtype for every exact call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

import lowbitcc
from lowbitcc.config import SCHEDULES, LocoConfig

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@dataclasses.dataclass(frozen=True)
class WireBytes:
    """The bytes one call of this rank sent, as its backend counts them: ``total``, and
    ``intra_node``/``inter_node`` to ranks of its node and of other nodes (`lowbitcc.counters`);
    None where the backend does not count them."""

    total: int | None = None
    intra_node: int | None = None
    inter_node: int | None = None


class Backend:
    """A torch process group answering the calls; subclasses change how tensors travel.
    ``exact``: results equal the exact reduction (a baseline for the footer's ratios)."""

    exact = True
    wire_itemsize: int | None = None  # None: the tensor's own

    def __init__(self, name: str, group: Any) -> None:
        self.name = name
        self.group = group

    def context(self, key: str) -> contextlib.AbstractContextManager:
        """What each call runs in (``key``: the same for every timed call of one size)."""
        return contextlib.nullcontext()

    def end_step(self) -> None:
        """One timed call is one training step."""

    def busy_seconds(self) -> float | None:
        """Codec and wire seconds counted so far (None: the backend does not count them)."""
        return None

    def all_reduce(self, out: torch.Tensor, inp: torch.Tensor, op: str) -> None:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)  # torch's all_reduce has no separate output
        dist.all_reduce(out, op=self._op(op), group=self.group)
        self._finish_avg(out, op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str) -> None:
        dist.reduce_scatter_single(out, inp, op=self._op(op), group=self.group)
        self._finish_avg(out, op)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        dist.all_gather_single(out, inp, group=self.group)

    def _op(self, op: str) -> dist.ReduceOp:
        return dist.ReduceOp.SUM if op == "avg" else _OPS[op]

    def _finish_avg(self, out: torch.Tensor, op: str) -> None:
        if op == "avg":  # gloo has no AVG; c10d users divide, as DDP does
            out.div_(dist.get_world_size(self.group))

    def measured_wire_bytes(self, run: Callable[[], None]) -> WireBytes:
        """Run one call; return the bytes this rank sent, where the backend counts them."""
        run()
        return WireBytes()


class LocoBackend(Backend):
    """A "loco" group; ``forced``: every call compressed (`lowbitcc.compressed()`), else its
    cost model chooses per call (the ``loco{b}-model`` backends)."""

    exact = False

    def __init__(self, name: str, group: Any, forced: bool = True, exact: bool = False) -> None:
        super().__init__(name, group)
        self.forced = forced
        self.exact = exact

    def _op(self, op: str) -> dist.ReduceOp:
        return dist.ReduceOp.AVG if op == "avg" else _OPS[op]

    def _finish_avg(self, out: torch.Tensor, op: str) -> None:
        pass

    def context(self, key: str) -> contextlib.AbstractContextManager:
        if not self.forced:
            return lowbitcc.feedback_key(f"perf|{self.name}|{key}")
        return _loco_context(f"perf|{self.name}|{key}")

    def end_step(self) -> None:
        lowbitcc.end_step()

    def busy_seconds(self) -> float | None:
        s = lowbitcc.stats()["compressed"]
        return s["codec_s"] + s["wire_s"]

    def measured_wire_bytes(self, run: Callable[[], None]) -> WireBytes:
        """The bytes the call counted (`lowbitcc.stats`' ``total``: compressed calls their own,
        exact reductions their ring volume); ``total`` None where it counted none (an exact
        data movement), so the harness uses the ring volume as for gloo; the split by link
        class None where the call split none (an exact call that gloo runs)."""
        before = lowbitcc.stats()["total"]
        run()
        after = lowbitcc.stats()["total"]
        sent = {k: int(after[k] - before[k])
                for k in ("wire_bytes", "intra_node_bytes", "inter_node_bytes")}
        if not sent["wire_bytes"]:
            return WireBytes()
        if not sent["intra_node_bytes"] + sent["inter_node_bytes"]:
            return WireBytes(sent["wire_bytes"])
        return WireBytes(sent["wire_bytes"], sent["intra_node_bytes"], sent["inter_node_bytes"])


@contextlib.contextmanager
def _loco_context(key: str) -> Iterator[None]:
    with lowbitcc.compressed(), lowbitcc.feedback_key(key):
        yield


class CastBackend(Backend):
    """Sends ``dtype`` copies of the tensors through ``group`` and casts the results back."""

    exact = False

    def __init__(self, name: str, group: Any, dtype: torch.dtype) -> None:
        super().__init__(name, group)
        self.dtype = dtype
        self.wire_itemsize = torch.empty((), dtype=dtype).element_size()

    def all_reduce(self, out: torch.Tensor, inp: torch.Tensor, op: str) -> None:
        low = inp.to(self.dtype)
        dist.all_reduce(low, op=self._op(op), group=self.group)
        out.copy_(low)
        self._finish_avg(out, op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str) -> None:
        low_out = torch.empty(out.shape, dtype=self.dtype)
        dist.reduce_scatter_single(low_out, inp.to(self.dtype), op=self._op(op), group=self.group)
        out.copy_(low_out)
        self._finish_avg(out, op)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        low_out = torch.empty(out.shape, dtype=self.dtype)
        dist.all_gather_single(low_out, inp.to(self.dtype), group=self.group)
        out.copy_(low_out)


class NcclBackend(Backend):
    """torch's NCCL group on CUDA copies of the CPU buffers (copies are inside the timing)."""

    def __init__(self, name: str, group: Any, device: torch.device) -> None:
        super().__init__(name, group)
        self.device = device

    def _run(self, fn: Callable[[torch.Tensor, torch.Tensor], None], out: torch.Tensor,
             inp: torch.Tensor) -> None:
        d_inp = inp.to(self.device)
        d_out = d_inp if out.data_ptr() == inp.data_ptr() else torch.empty_like(out, device=self.device)
        fn(d_out, d_inp)
        out.copy_(d_out)

    def all_reduce(self, out: torch.Tensor, inp: torch.Tensor, op: str) -> None:
        self._run(lambda o, i: super(NcclBackend, self).all_reduce(o, i, op), out, inp)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str) -> None:
        self._run(lambda o, i: super(NcclBackend, self).reduce_scatter(o, i, op), out, inp)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        self._run(lambda o, i: super(NcclBackend, self).all_gather(o, i), out, inp)


class MpiBackend(Backend):
    """MPI through mpi4py on numpy views of the tensors (fp32/fp16 only; MPI has no bf16)."""

    def __init__(self, name: str, comm: Any) -> None:
        super().__init__(name, None)
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = comm
        self._mpi_ops = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}

    def _np(self, t: torch.Tensor) -> Any:
        if t.dtype == torch.bfloat16:
            raise ValueError("lowbitcc perf: MPI has no bfloat16 type; use -d float or half")
        return t.numpy()

    def _send(self, out: torch.Tensor, inp: torch.Tensor) -> Any:
        return self.MPI.IN_PLACE if out.data_ptr() == inp.data_ptr() else self._np(inp)

    def _finish_avg(self, out: torch.Tensor, op: str) -> None:
        if op == "avg":
            out.div_(self.comm.Get_size())

    def all_reduce(self, out: torch.Tensor, inp: torch.Tensor, op: str) -> None:
        self.comm.Allreduce(self._send(out, inp), self._np(out), op=self._mpi_ops[op])
        self._finish_avg(out, op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str) -> None:
        if _overlaps(out, inp):
            self.comm.Reduce_scatter_block(self.MPI.IN_PLACE, self._np(inp), op=self._mpi_ops[op])
            out.copy_(inp[: out.numel()])  # MPI's in-place result lands at the buffer's start
        else:
            self.comm.Reduce_scatter_block(self._np(inp), self._np(out), op=self._mpi_ops[op])
        self._finish_avg(out, op)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        send = self.MPI.IN_PLACE if _overlaps(out, inp) else self._np(inp)
        self.comm.Allgather(send, self._np(out))


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


KNOWN = ("loco", "loco2", "loco4", "loco8", "loco-model", "loco-exact", "gloo", "gloo-bf16",
         "mpi", "nccl")
"""Backend names; "loco" expands to one ``loco{b}`` per ``--bits``, "loco-model" to
``loco{b}-model`` (the cost model decides per call which calls are compressed); "loco-exact"
is a "loco" group whose calls stay exact."""


def expand(names: list[str], bits: list[int], schedules: list[str] | None = None) -> list[str]:
    """``loco`` -> ``loco{b}`` for each of ``bits`` (``loco{b}-{schedule}`` for each schedule
    when there are several); validates names; keeps order, drops repeats."""
    schedules = schedules or ["direct"]
    for schedule in schedules:
        if schedule not in SCHEDULES:
            raise ValueError(f"lowbitcc perf: unknown schedule {schedule!r}; known: "
                             + ", ".join(SCHEDULES))
    out: list[str] = []
    for name in names:
        if name not in KNOWN:
            raise ValueError(f"lowbitcc perf: unknown backend {name!r}; known: {', '.join(KNOWN)}")
        locos = [f"loco{b}" for b in bits] if name == "loco" else [name]
        if name == "loco-model":
            locos = [f"loco{b}-model" for b in bits]
        elif name.startswith("loco") and name != "loco-exact" and len(schedules) > 1:
            locos = [f"{loco}-{s}" for loco in locos for s in schedules]
        for full in locos:
            if full not in out:
                out.append(full)
    return out


def runs_on(name: str, device: str) -> bool:
    """Whether backend ``name`` (as `expand` gives it) takes tensors on ``device``."""
    return device == "cpu" or name.startswith("loco") or name == "nccl"


def create(name: str, schedule: str, device: str = "cpu") -> Backend:
    """Build backend ``name`` on the current default group's ranks (a collective call);
    ``loco{b}-{s}`` names its schedule, a bare ``loco{b}`` runs ``schedule``. ``device`` is
    where the buffers live: on "cuda", nccl runs on them directly (on "cpu" it copies them to
    the GPU inside the timing)."""
    if name == "loco-exact":
        return LocoBackend(name, dist.new_group(backend="loco", pg_options=LocoConfig.from_env()),
                           forced=False, exact=True)
    if name.startswith("loco"):
        bits, _, named = name[4:].partition("-")
        model = named == "model"
        # the bits before validation: a 3-bit LOCO_FORMAT is invalid at the default 4 bits
        config = LocoConfig.from_env({**os.environ, "LOCO_BITS": bits}).replace(
            policy="always", cost_model=model,
            schedule=schedule if model else (named or schedule))
        return LocoBackend(name, dist.new_group(backend="loco", pg_options=config),
                           forced=not model)
    if name == "gloo":
        return Backend(name, dist.new_group(backend="gloo"))
    if name == "gloo-bf16":
        return CastBackend(name, dist.new_group(backend="gloo"), torch.bfloat16)
    if name == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("lowbitcc perf: backend nccl needs a CUDA GPU; none is visible")
        if device == "cuda":
            return Backend(name, dist.new_group(backend="nccl"))
        gpu = torch.device("cuda", torch.cuda.current_device())
        return NcclBackend(name, dist.new_group(backend="nccl"), gpu)
    if name == "mpi":
        try:
            from mpi4py import MPI
        except ImportError:
            raise RuntimeError(
                "lowbitcc perf: backend mpi needs mpi4py: pip install 'lowbitcc[mpi]'") from None
        comm = MPI.COMM_WORLD
        if comm.Get_size() != dist.get_world_size() or comm.Get_rank() != dist.get_rank():
            raise RuntimeError(
                f"lowbitcc perf: backend mpi needs the ranks started by mpiexec (MPI sees rank "
                f"{comm.Get_rank()} of {comm.Get_size()}, torch rank {dist.get_rank()} of "
                f"{dist.get_world_size()}); run `mpiexec -n N lowbitcc perf ...`")
        return MpiBackend(name, comm)
    raise ValueError(f"lowbitcc perf: unknown backend {name!r}; known: {', '.join(KNOWN)}")
