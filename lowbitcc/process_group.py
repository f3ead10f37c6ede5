"""`LocoProcessGroup`: the torch ``ProcessGroup`` behind ``init_process_group("loco")``.

Every c10d collective is answered. Exact calls run on an inner ``ProcessGroupGloo`` built on the
same store, so they equal gloo bit for bit (AVG and PREMUL_SUM, which gloo lacks, are a SUM with a
division or a pre-multiplication). Compressible calls (see `lowbitcc.policy`) run a compressed
schedule over the same inner group.

Ordering: every call, sync or async, is queued in issue order to one worker thread per group,
which issues the inner gloo operations (and runs compressed schedules) in that order, so that
every rank issues the same inner operations in the same order. Calls return a `LocoWork` whose
future completes with the list of output tensors; ``wait()`` re-raises any error.

Mismatch safety: before a compressible call the ranks exchange 32-byte call descriptors
(``config.check``); if any rank describes another call, every rank raises `CollectiveMismatchError`.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from lowbitcc import algorithms, policy, topology
from lowbitcc.backends.base import MeteredTransport
from lowbitcc.backends.gloo import GlooTransport
from lowbitcc.backends.links import Links
from lowbitcc.compressor import CallCompressor, Scratch, Source
from lowbitcc.config import LocoConfig
from lowbitcc.feedback import FeedbackStore
from lowbitcc.kernels import wire
from lowbitcc.kernels.codec import ShardCodec
from lowbitcc.counters import STATS

log = logging.getLogger("lowbitcc")

BACKEND_NAME = "loco"
FEEDBACK = FeedbackStore()
ReduceOp = dist.ReduceOp


class CollectiveMismatchError(RuntimeError):
    """Ranks issued different collectives (shape, dtype, op or order) on the same group."""


class LocoWork(dist.Work):
    """A queued call; its future's value is the list of output tensors."""

    def __init__(self, future: torch.futures.Future) -> None:
        super().__init__()
        self._future = future

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:
            return False
        return True

    def exception(self) -> BaseException | None:
        if not self._future.done():
            return None
        try:
            self._future.value()
        except Exception as exc:
            return exc
        return None

    def result(self) -> list[torch.Tensor]:
        return self._future.wait()


@dataclasses.dataclass
class _Pending:
    """An inner gloo operation in flight and how to finish the call once it completes."""

    work: Any
    finish: Callable[[], list[torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class _Reduction:
    """How an exact reduction runs on gloo: inputs scaled by ``factor``, outputs divided."""

    op: ReduceOp
    factor: float | torch.Tensor | None = None
    divisor: int | None = None


def _flat(tensors: list[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for t in tensors:
        out.extend(_flat(t) if isinstance(t, list | tuple) else [t])
    return out


class LocoProcessGroup(dist.ProcessGroup):
    """The "loco" process group for CPU tensors. Create it with ``init_process_group("loco")``."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: datetime.timedelta,
        config: LocoConfig,
        global_ranks: list[int] | None = None,
    ) -> None:
        """``global_ranks[i]`` is the default group's rank of this group's rank ``i`` (None:
        this is the default group)."""
        super().__init__(rank, size)
        self.config = config
        self.timeout = timeout
        self._store = store
        self._global_ranks = global_ranks or list(range(size))
        self._inner = dist.ProcessGroupGloo(
            dist.PrefixStore("lowbitcc/gloo", store), rank, size, timeout
        )
        self._gloo = GlooTransport(self._inner)
        self._links = self._make_links()
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._seq = 0
        self._epoch: tuple[str, int] | None = None
        self._ordinals: dict[tuple, int] = {}
        self._group_name = ""
        self._group_desc = ""
        self._closed = False
        self._codec_impl = _codec_impl(config.codec)
        self._scratch = Scratch()  # the worker thread's decode buffer
        self._worker = threading.Thread(
            target=self._run, name=f"lowbitcc-worker-r{rank}", daemon=True
        )
        self._pending: queue.SimpleQueue = queue.SimpleQueue()
        self._waiter = threading.Thread(
            target=self._wait_pending, name=f"lowbitcc-waiter-r{rank}", daemon=True
        )
        self._worker.start()
        self._waiter.start()

    def _make_links(self) -> Links:
        """The compressed schedules' transports, of kind ``config.transport`` for CPU tensors."""
        kind = "gloo" if self.config.transport in ("auto", "gloo") else self.config.transport
        layout = topology.layout(self._global_ranks, self.rank(),
                                 topology.node_size_from(self.config.node_size))
        timeout_s = self.timeout.total_seconds()
        if kind == "gloo":
            def make(name: str, color: int, key: int, size: int) -> MeteredTransport:
                store = dist.PrefixStore(f"lowbitcc/gloo-{name}{color}", self._store)
                return MeteredTransport(GlooTransport(
                    dist.ProcessGroupGloo(store, key, size, self.timeout)), STATS)

            return Links(MeteredTransport(self._gloo, STATS), layout, make)
        if kind == "mpi":
            from lowbitcc.backends import mpi

            comm = mpi.communicator(self._global_ranks, self.rank())

            def split(name: str, color: int, key: int, size: int) -> MeteredTransport:
                return MeteredTransport(mpi.MpiTransport(comm.Split(color, key), timeout_s), STATS)

            return Links(MeteredTransport(mpi.MpiTransport(comm, timeout_s), STATS), layout, split)
        raise ValueError(
            "lowbitcc: LOCO_TRANSPORT=nccl moves CUDA tensors, and this build of the 'loco' "
            "backend takes CPU tensors only: use gloo or mpi"
        )

    # -- identity -----------------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 (c10d's name)
        return BACKEND_NAME

    def _get_backend_name(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:  # type: ignore[override]
        return BACKEND_NAME

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._group_name

    @property
    def group_desc(self) -> str:  # type: ignore[override]
        return self._group_desc

    # -- the worker ---------------------------------------------------------------------------
    def _submit(self, job: Callable[[], Any]) -> LocoWork:
        """Queue ``job`` (run on the worker, in issue order) and return its Work."""
        future: torch.futures.Future = torch.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("lowbitcc: this process group has been shut down")
            self._jobs.put((job, future))
        return LocoWork(future)

    def _run(self) -> None:
        """Worker: run queued jobs in order; hand inner gloo work in flight to the waiter."""
        while True:
            item = self._jobs.get()
            if item is None:
                self._pending.put(None)
                return
            job, future = item
            try:
                result = job()
            except BaseException as exc:  # noqa: BLE001 (delivered to the caller's wait())
                future.set_exception(exc)
                continue
            if isinstance(result, _Pending):
                self._pending.put((result, future))
            else:
                future.set_result(result)

    def _wait_pending(self) -> None:
        """Waiter: complete calls whose inner gloo work is in flight, in issue order.

        Gloo progresses its operations on its own threads; waiting in order only orders the
        completion notices, never the operations, so a send and a recv posted in either order
        cannot deadlock here.
        """
        while True:
            item = self._pending.get()
            if item is None:
                return
            pending, future = item
            try:
                future.set_result(self._complete(pending))
            except BaseException as exc:  # noqa: BLE001
                future.set_exception(exc)

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._jobs.put(None)
        self._worker.join(timeout=self.timeout.total_seconds())
        self._waiter.join(timeout=self.timeout.total_seconds())
        self._inner.shutdown()

    def abort(self) -> None:
        self.shutdown()

    # -- exact calls on the inner gloo group --------------------------------------------------
    def _exact(self, method: str, outputs: list[Any], *args: Any) -> LocoWork:
        """Queue ``inner.<method>(*args)``; the Work's value is ``outputs`` flattened."""
        nbytes = sum(t.numel() * t.element_size() for t in _flat(list(args[:1])))
        STATS.add("exact", calls=1, tensor_bytes=nbytes)

        def job() -> _Pending:
            work = getattr(self._inner, method)(*args)
            return _Pending(work, lambda: _flat(outputs))

        return self._submit(job)

    def _complete(self, pending: _Pending) -> list[torch.Tensor]:
        """Wait for ``pending``'s inner gloo work, keep the Work referenced for a while (see
        `GlooTransport.retire`), and finish the call."""
        pending.work.wait()
        self._gloo.retire(pending.work)
        return pending.finish()

    def _sequence(
        self, jobs: list[Callable[[], Any]], outputs: list[torch.Tensor]
    ) -> Callable[[], Any]:
        """One worker job running ``jobs`` in order; pending inner work is waited for at the end."""

        def job() -> Any:
            pending = [p for p in (j() for j in jobs) if isinstance(p, _Pending)]
            for p in pending:
                self._complete(p)
            return outputs

        return job

    def _exact_reduction(
        self,
        opts: Any,
        inputs: list[torch.Tensor],
        outputs: list[torch.Tensor],
        call: Callable[[Any, list[torch.Tensor]], Any],
        in_place: bool,
    ) -> Callable[[], _Pending]:
        """A worker job for an exact reduction; ``call(sum_opts, inputs)`` issues the gloo op.

        For PREMUL_SUM the op runs on scaled copies of ``inputs`` (copied back where the op is
        ``in_place`` and this rank receives the result); for AVG ``outputs`` are divided after.
        """
        red = self._reduction(opts.reduceOp)
        STATS.add("exact", calls=1, tensor_bytes=sum(t.numel() * t.element_size() for t in inputs))

        def job() -> _Pending:
            sum_opts = type(opts)()
            for field in ("rootRank", "rootTensor", "timeout", "asyncOp"):
                if hasattr(opts, field):
                    setattr(sum_opts, field, getattr(opts, field))
            sum_opts.reduceOp = red.op
            buffers = inputs if red.factor is None else [_scaled(t, red.factor) for t in inputs]
            work = call(sum_opts, buffers)

            def finish() -> list[torch.Tensor]:
                if in_place and buffers is not inputs:
                    for dst, src in zip(outputs, buffers):
                        dst.copy_(src)
                if red.divisor is not None:
                    for t in outputs:
                        _divide_(t, red.divisor)
                return outputs

            return _Pending(work, finish)

        return job

    def _reduction(self, op: ReduceOp) -> _Reduction:
        kind = _op_type(op)
        if kind == ReduceOp.AVG:
            return _Reduction(ReduceOp.SUM, divisor=self.size())
        if kind == ReduceOp.PREMUL_SUM:
            return _Reduction(ReduceOp.SUM, factor=_premul_factor(op))
        return _Reduction(op)

    # -- compressed calls -----------------------------------------------------------------------
    def _compressible(self, tensors: list[torch.Tensor], op: ReduceOp) -> bool:
        return (
            self.config.policy != "never"
            and all(policy.eligible(t, _op_type(op)) and t.device.type == "cpu" for t in tensors)
            and policy.wants_compression(self.config.policy)
        )

    def _key(self, collective: str, tensor: torch.Tensor, numel: int) -> str:
        explicit = policy.explicit_key()
        if explicit is not None:
            return f"{self._group_name}|{explicit}"
        epoch = policy.epoch()
        signature = (collective, tensor.dtype, numel)
        with self._lock:
            if epoch != self._epoch:
                self._epoch = epoch
                self._ordinals.clear()
            ordinal = self._ordinals.get(signature, 0)
            self._ordinals[signature] = ordinal + 1
        dtype = str(tensor.dtype).replace("torch.", "")
        return f"{self._group_name}|{collective}|{dtype}|{numel}|{ordinal}"

    def _next_seq(self) -> int:
        with self._lock:
            self._seq += 1
            return self._seq

    def _agree(self, desc: wire.CallDescriptor) -> None:
        """Exchange call descriptors; raise `CollectiveMismatchError` on every rank on mismatch."""
        raw = torch.frombuffer(bytearray(desc.pack()), dtype=torch.uint8)
        everyone = self._gloo.all_gather(raw)
        descs = [wire.CallDescriptor.unpack(bytes(row.numpy().tobytes())) for row in everyone]
        if any(d != descs[0] for d in descs):
            lines = "; ".join(f"rank {r}: {d.describe()}" for r, d in enumerate(descs))
            raise CollectiveMismatchError(
                f"lowbitcc: ranks of group '{self._group_name}' issued different collectives: {lines}"
            )

    def _compressed_call(
        self,
        collective: str,
        source: torch.Tensor,
        op: ReduceOp,
        run: Callable[[Source, CallCompressor], None],
        exact: Callable[[], Any],
    ) -> Callable[[], Any]:
        """A worker job for one compressible all-reduce / reduce-scatter.

        ``source`` is the input; ``run(source, compressor)`` runs the schedule and writes the
        output; ``exact()`` issues the exact fallback (used when the agreed size is below
        ``min_size``).
        """
        cfg = self.config
        numel = source.numel()
        seq = self._next_seq()
        key = self._key(collective, source, numel)
        desc = wire.CallDescriptor(
            collective=collective, dtype=source.dtype, op=int(_op_type(op)), numel=numel, seq=seq,
            bits=cfg.bits, group_size=cfg.group_size, compressed=numel >= cfg.min_size,
        )
        factor = self._input_factor(op)

        def job() -> Any:
            if cfg.check:
                self._agree(desc)
            if not desc.compressed:
                return exact()
            n = self.size()
            itemsize = source.element_size()
            m = -(-numel // n)
            STATS.add("compressed", calls=1, tensor_bytes=numel * itemsize,
                      logical_bytes=(2 if collective == "all_reduce" else 1) * (n - 1) * m * itemsize)
            codec = ShardCodec(
                bits=cfg.bits, group_size=cfg.group_size, dtype_code=wire.DTYPE_CODES[source.dtype],
                seq=seq, world=n, signature=wire.call_signature(collective, numel, source.dtype),
                impl=self._codec_impl, rounding=cfg.rounding, seed=cfg.seed,
            )
            comp = CallCompressor(codec, cfg, FEEDBACK, key, STATS, rank=self.rank(),
                                  scratch=self._scratch)
            flat = source.detach().reshape(-1).contiguous()
            run(Source(flat, n, m, factor), comp)
            comp.finish()
            return None

        return job

    def _schedule(self, source: Source) -> str:
        nbytes = source.tensor.numel() * source.tensor.element_size()
        return algorithms.choose(self.config, nbytes, self.size(), self._links.layout)

    def _input_factor(self, op: ReduceOp) -> float:
        """What compressed inputs are multiplied by: PREMUL_SUM's factor, 1/n for AVG, else 1."""
        red = self._reduction(op)
        if red.divisor is not None:
            return 1.0 / red.divisor
        if red.factor is not None:
            return float(red.factor)
        return 1.0

    def _all_reduce_compressed(self, tensor: torch.Tensor, op: ReduceOp, opts: Any) -> Callable:
        def run(source: Source, comp: CallCompressor) -> None:
            out = tensor.view(-1) if tensor.is_contiguous() else torch.empty_like(source.tensor)
            algorithms.all_reduce(self._schedule(source), source, out, comp, self._links,
                                  self.config.chunk_size)
            if out.data_ptr() != tensor.data_ptr():
                tensor.copy_(out.view(tensor.shape))

        def exact() -> Any:
            return self._exact_reduction(
                opts, [tensor], [tensor], lambda o, ins: self._inner.allreduce(ins, o), True
            )()

        return self._compressed_call("all_reduce", tensor, op, run, exact)

    def _reduce_scatter_compressed(
        self, output: torch.Tensor, source: torch.Tensor, op: ReduceOp, opts: Any
    ) -> Callable:
        def run(src: Source, comp: CallCompressor) -> None:
            reduced = algorithms.reduce_scatter(self._schedule(src), src, comp, self._links,
                                                self.config.chunk_size)
            output.copy_(reduced.view(output.shape))

        def exact() -> Any:
            return self._exact_reduction(
                opts, [source], [output],
                lambda o, ins: self._inner._reduce_scatter_base(output, ins[0].contiguous(), o),
                False,
            )()

        return self._compressed_call("reduce_scatter", source, op, run, exact)

    # -- c10d methods: reductions -------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> LocoWork:
        opts = opts if opts is not None else dist.AllreduceOptions()
        _check_tensors("all_reduce", tensors)
        if self._compressible(tensors, opts.reduceOp):
            jobs = [self._all_reduce_compressed(t, opts.reduceOp, opts) for t in tensors]
            return self._submit(self._sequence(jobs, tensors))
        return self._submit(self._exact_reduction(
            opts, tensors, tensors, lambda o, ins: self._inner.allreduce(ins, o), True
        ))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> LocoWork:
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        _check_tensors("all_reduce_coalesced", tensors)
        single = dist.AllreduceOptions()
        single.reduceOp = opts.reduceOp
        if self._compressible(tensors, opts.reduceOp):
            jobs = [self._all_reduce_compressed(t, opts.reduceOp, single) for t in tensors]
            return self._submit(self._sequence(jobs, tensors))
        return self._submit(self._exact_reduction(
            opts, tensors, tensors, lambda o, ins: self._inner.allreduce_coalesced(ins, o), True
        ))

    def reduce_scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> LocoWork:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        if len(output_tensors) != 1 or len(input_tensors) != 1:
            raise ValueError("lowbitcc: reduce_scatter takes one output and one input list")
        output, inputs = output_tensors[0], input_tensors[0]
        if len(inputs) != self.size():
            raise ValueError(
                f"lowbitcc: reduce_scatter needs {self.size()} input tensors, got {len(inputs)}"
            )
        _check_tensors("reduce_scatter", [output, *inputs])
        if any(t.shape != output.shape or t.dtype != output.dtype for t in inputs):
            raise ValueError("lowbitcc: reduce_scatter inputs must all match the output's shape and dtype")
        if self._compressible([output], opts.reduceOp):
            source = torch.stack([t.reshape(-1) for t in inputs])
            return self._submit(self._sequence(
                [self._reduce_scatter_compressed(output, source, opts.reduceOp, opts)], [output]
            ))
        return self._submit(self._exact_reduction(
            opts, inputs, [output],
            lambda o, ins: self._inner.reduce_scatter([output], [ins], o), False,
        ))

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None  # noqa: A002
    ) -> LocoWork:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self.reduce_scatter_single_coalesced([output], [input], opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> LocoWork:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        if len(outputs) != len(inputs):
            raise ValueError("lowbitcc: reduce_scatter needs as many outputs as inputs")
        _check_tensors("reduce_scatter", [*outputs, *inputs])
        for out, inp in zip(outputs, inputs):
            if inp.numel() != out.numel() * self.size() or inp.dtype != out.dtype:
                raise ValueError(
                    f"lowbitcc: reduce_scatter input of {inp.numel()} {inp.dtype} elements does not "
                    f"hold {self.size()} outputs of {out.numel()} {out.dtype} elements"
                )
        jobs: list[Callable] = []
        compress = self._compressible(outputs, opts.reduceOp)
        for out, inp in zip(outputs, inputs):
            if compress:
                jobs.append(self._reduce_scatter_compressed(out, inp, opts.reduceOp, opts))
            else:
                jobs.append(self._exact_reduction(
                    opts, [inp], [out],
                    lambda o, ins, out=out: self._inner._reduce_scatter_base(
                        out, ins[0].contiguous(), o
                    ),
                    False,
                ))
        return self._submit(self._sequence(jobs, outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> LocoWork:
        opts = opts if opts is not None else dist.ReduceOptions()
        _check_tensors("reduce", tensors)
        outputs = tensors if self.rank() == opts.rootRank else []
        return self._submit(self._exact_reduction(
            opts, tensors, outputs, lambda o, ins: self._inner.reduce(ins, o), True
        ))

    # -- c10d methods: exact data movement ----------------------------------------------------
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> LocoWork:
        opts = opts if opts is not None else dist.BroadcastOptions()
        return self._exact("broadcast", tensors, tensors, opts)

    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> LocoWork:
        opts = opts if opts is not None else AllgatherOptions()
        return self._exact("allgather", output_tensors, output_tensors, input_tensors, opts)

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None  # noqa: A002
    ) -> LocoWork:
        opts = opts if opts is not None else AllgatherOptions()
        return self._exact("_allgather_base", [output], output, input, opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> LocoWork:
        opts = opts if opts is not None else AllgatherOptions()
        STATS.add("exact", calls=1, tensor_bytes=sum(t.numel() * t.element_size() for t in inputs))

        def issue(out: torch.Tensor, inp: torch.Tensor) -> Callable:
            return lambda: _Pending(self._inner._allgather_base(out, inp, opts), lambda: [out])

        return self._submit(self._sequence([issue(o, i) for o, i in zip(outputs, inputs)], outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
        opts: Any = None,
    ) -> LocoWork:
        opts = opts if opts is not None else AllgatherOptions()
        return self._exact("allgather_coalesced", output_lists, output_lists, input_list, opts)

    def gather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> LocoWork:
        opts = opts if opts is not None else dist.GatherOptions()
        return self._exact("gather", output_tensors, output_tensors, input_tensors, opts)

    def scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> LocoWork:
        opts = opts if opts is not None else dist.ScatterOptions()
        return self._exact("scatter", output_tensors, output_tensors, input_tensors, opts)

    def alltoall(
        self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> LocoWork:
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self._exact("alltoall", output_tensors, output_tensors, input_tensors, opts)

    def all_to_all_single(
        self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
        output_split_sizes: list[int], input_split_sizes: list[int], opts: Any = None,
    ) -> LocoWork:
        opts = opts if opts is not None else dist.AllToAllOptions()
        return self._exact(
            "alltoall_base", [output], output, input, output_split_sizes, input_split_sizes, opts
        )

    alltoall_base = all_to_all_single

    def barrier(self, opts: Any = None) -> LocoWork:
        opts = opts if opts is not None else dist.BarrierOptions()

        def job() -> _Pending:
            return _Pending(self._inner.barrier(opts), lambda: [])

        return self._submit(job)

    # -- point to point: issued in order, never waited on by the worker ----------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> LocoWork:
        return self._exact("send", tensors, tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> LocoWork:
        return self._exact("recv", tensors, tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> LocoWork:
        return self._exact("recv_anysource", tensors, tensors, tag)


# -- helpers -----------------------------------------------------------------------------------
def _codec_impl(choice: str) -> str:
    """Resolve ``config.codec`` ("auto", "reference" or "cpu") to an implementation name."""
    if choice == "reference":
        return "reference"
    from lowbitcc.kernels import cpu

    if cpu.load() is not None:
        return "cpu"
    if choice == "cpu":
        raise RuntimeError("lowbitcc: LOCO_CODEC=cpu but the C++ CPU codec could not be built")
    return "reference"


def _check_tensors(what: str, tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"lowbitcc: {what} expects tensors, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(
                f"lowbitcc: {what} got a {t.device.type} tensor; this build of the 'loco' backend "
                "serves CPU tensors"
            )


def _op_type(op: ReduceOp) -> ReduceOp:
    return op.op if isinstance(op, ReduceOp) else op


def _premul_factor(op: ReduceOp) -> float | torch.Tensor:
    factor = getattr(op, "factor", None)
    if factor is None:
        raise ValueError("lowbitcc: PREMUL_SUM without a factor (use dist._make_nccl_premul_sum)")
    return factor


def _scaled(t: torch.Tensor, factor: float | torch.Tensor) -> torch.Tensor:
    return t * factor if not isinstance(factor, torch.Tensor) else t * factor.to(t.dtype)


def _divide_(t: torch.Tensor, divisor: int) -> None:
    if t.is_floating_point() or t.is_complex():
        t.div_(divisor)
    else:
        t.copy_(torch.div(t, divisor, rounding_mode="trunc"))
