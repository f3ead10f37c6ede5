"""The harness of `lowbitcc perf`: size sweep, warm-up, timing and check (the printed table:
`lowbitcc.tools.perf.table`; the JSON and plot: `lowbitcc.tools.perf.outputs`).

For each size (``-b`` to ``-e``, times ``-f`` or plus ``-i``), each backend's out-of-place and
in-place runs are timed in turn, ``--rounds`` times (the order reversed every other round; each
run's ``-w`` untimed calls in the first round only, a barrier before each block of timed calls),
``-n`` timed calls each in all (their mean is the time, averaged over ranks as ``-a`` says), so
that every backend is timed in the same minutes of a machine whose speed drifts; then each runs
one more call on fresh data whose result is compared with the exact one (relative L2 error,
worst rank) and whose bytes on the wire are counted. Every backend's buffers of one size are
kept until that size is done. Each block ends when the device's queued work is done (as the one
block did before), and a block's first call follows another backend's block, as a training
step's first call follows other work; a loco renewal started near a block's end may overlap
the next backend's block. Each timed
call is one training step (`Backend.end_step`; for loco `lowbitcc.end_step`, so that its
calls repeat as training's do) and runs under its own context: loco's calls use one
error-feedback key per (size, placement), the same at every step as training's, and a fresh
key for the checked call, so the error column is that of one call, not of a chain of calls.
In-place sums grow the buffer up to ``n``-fold per call; the timed loop restores the input
(outside the calling-thread time) before it could overflow (`_finite_calls`), since a
compressed call that meets Inf drops its error state and is not the call being measured.
``host_us`` (loco rows; the ``host`` column, in-place) is the calling thread's time per timed
call that is neither codec nor wire (`lowbitcc.stats`' ``codec_s`` and ``wire_s``, averaged
over ranks as the time is): issuing, agreement, bookkeeping and waits for the worker.
``across`` (``inter_node_bytes`` in JSON, beside ``intra_node_bytes``) is what the checked call
of this rank sent to ranks of other nodes (``LOCO_NODE_SIZE`` or ``LOCAL_WORLD_SIZE``), where
the backend splits its bytes by link (`lowbitcc.counters`).

algbw = size / time and busbw = algbw * factor (nccl-tests' definitions, on logical bytes);
``ratio`` is wire bytes over the bytes the same call would send with fp32 (or the given
dtype) on a ring.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from typing import Any

import torch
import torch.distributed as dist

from lowbitcc.tools.perf import targets as backends_mod
from lowbitcc.tools.perf.collectives import COLLECTIVES, Collective, fill
from lowbitcc.tools.perf.table import TablePrinter, progress_bar

DTYPES = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_ALIASES = {"float32": "float", "fp32": "float", "float16": "half", "fp16": "half",
                 "bf16": "bfloat16"}
AVERAGES = {0: "rank0", 1: "avg", 2: "min", 3: "max"}


@dataclasses.dataclass(frozen=True)
class PerfOptions:
    """One sweep. Sizes are in bytes of ``dtype``, as nccl-tests' ``-b -e -f -i``."""

    collective: str = "all_reduce"
    min_bytes: int = 64 << 10
    max_bytes: int = 64 << 20
    factor: int = 2
    step_bytes: int = 0
    iters: int = 20
    warmup: int = 5
    rounds: int = 4
    check: int = 1
    dtype: str = "float"
    op: str = "sum"
    average: int = 1
    backends: tuple[str, ...] = ("loco", "gloo")
    bits: tuple[int, ...] = (4,)
    schedules: tuple[str, ...] = ("direct",)
    json_path: str | None = None
    plot_path: str | None = None
    device: str = "cpu"

    def validate(self) -> None:
        if self.collective not in COLLECTIVES:
            raise ValueError(f"lowbitcc perf: unknown collective {self.collective!r}; known: "
                             + ", ".join(COLLECTIVES))
        if not 0 < self.min_bytes <= self.max_bytes:
            raise ValueError(f"lowbitcc perf: need 0 < -b ({self.min_bytes}) <= -e ({self.max_bytes})")
        if self.step_bytes < 0 or (self.step_bytes == 0 and self.factor < 2):
            raise ValueError("lowbitcc perf: -f must be >= 2 (or give -i > 0)")
        if self.iters < 1 or self.warmup < 0 or self.rounds < 1:
            raise ValueError("lowbitcc perf: -n and --rounds must be >= 1 and -w >= 0")
        if dtype_name(self.dtype) not in DTYPES:
            raise ValueError(f"lowbitcc perf: unknown -d {self.dtype!r}; known: " + ", ".join(DTYPES))
        if self.op not in ("sum", "avg", "max", "min"):
            raise ValueError(f"lowbitcc perf: unknown -o {self.op!r}; known: sum, avg, max, min")
        if self.average not in AVERAGES:
            raise ValueError(f"lowbitcc perf: -a must be 0, 1, 2 or 3, got {self.average}")
        names = backends_mod.expand(list(self.backends), list(self.bits), list(self.schedules))
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"lowbitcc perf: --device must be cpu or cuda, got {self.device!r}")
        wrong = [n for n in names if not backends_mod.runs_on(n, self.device)]
        if wrong:
            raise ValueError(f"lowbitcc perf: backend(s) {', '.join(wrong)} do not take "
                             f"{self.device} tensors; with --device cuda compare loco and nccl")


def dtype_name(text: str) -> str:
    return DTYPE_ALIASES.get(text.lower(), text.lower())


def sizes(opts: PerfOptions) -> list[int]:
    out, size = [], opts.min_bytes
    while size <= opts.max_bytes:
        out.append(size)
        size = size + opts.step_bytes if opts.step_bytes else size * opts.factor
    return out


# -- measurement (every rank) --------------------------------------------------------------------
class _Timed:
    """One backend and placement at one size, timed in blocks (`block`) that `measure`
    interleaves with the other backends' and placements' (``--rounds``), then checked once
    (`result`). ``data`` is this rank's input, ``expected`` its exact output (None with ``-c
    0``). Collectives outside the backend run on the default group."""

    def __init__(self, coll: Collective, backend: backends_mod.Backend, count: int,
                 data: torch.Tensor, expected: torch.Tensor | None, opts: PerfOptions,
                 in_place: bool) -> None:
        self.coll, self.backend, self.count, self.data = coll, backend, count, data
        self.expected, self.opts = expected, opts
        self.place = "in" if in_place else "out"
        self.device = device_of(opts)
        n = dist.get_world_size()
        self.bufs = coll.buffers(count, n, dist.get_rank(), data.dtype, in_place, self.device)
        self.bufs.inp.copy_(data)
        self.finite_for = _finite_calls(coll, data.dtype, n, opts.op) if in_place else 0
        self.calls = itertools.count()
        self.iters = 0
        self.elapsed = self.calling = self.busy = 0.0
        self.counts_busy = backend.busy_seconds() is not None

    def launch(self) -> None:
        self.coll.launch(self.backend, self.bufs.out, self.bufs.inp, self.opts.op)

    def call(self) -> float:
        """One training step's call: its calling-thread seconds (the input restored first where
        its in-place sums would soon overflow, outside those seconds)."""
        if self.finite_for and next(self.calls) % self.finite_for == self.finite_for - 1:
            self.bufs.inp.copy_(self.data)
        with self.backend.context(f"{self.coll.name}|{self.count}|{self.place}"):
            begun = time.perf_counter()
            self.launch()
            took = time.perf_counter() - begun
        self.backend.end_step()
        return took

    def block(self, iters: int, warmup: int) -> None:
        """``warmup`` untimed calls, a barrier, then ``iters`` timed ones, added to the totals."""
        for _ in range(warmup):
            self.call()
        _synchronize(self.device)
        dist.barrier()
        busy = self.backend.busy_seconds()
        start = time.perf_counter()
        self.calling += sum(self.call() for _ in range(iters))
        _synchronize(self.device)
        self.elapsed += time.perf_counter() - start
        if busy is not None:
            self.busy += self.backend.busy_seconds() - busy
        self.iters += iters

    def result(self) -> dict[str, float]:
        """The mean time per timed call and host time (averaged over ranks as ``-a`` says),
        then one more call on fresh data: its error (worst rank) and its bytes on the wire."""
        opts, backend = self.opts, self.backend
        elapsed = _across_ranks(self.elapsed / self.iters, opts.average)
        host = None
        if self.counts_busy:
            host = _across_ranks((self.calling - self.busy) / self.iters, opts.average)
        self.bufs.inp.copy_(self.data)
        with backend.context(f"{self.coll.name}|{self.count}|{self.place}|check"):
            wire = backend.measured_wire_bytes(self.launch)
        error = math.nan
        if self.expected is not None:
            diff = (self.bufs.out.cpu().double() - self.expected.double()).norm()
            norm = self.expected.double().norm()
            error = float(diff / norm) if norm > 0 else float(diff)
            error = _across_ranks(error, 3)
        return {"time_us": elapsed * 1e6, "error": error, "wire_bytes": wire.total,
                "intra_node_bytes": wire.intra_node, "inter_node_bytes": wire.inter_node,
                "host_us": None if host is None else host * 1e6}


def rounds_of(opts: PerfOptions) -> int:
    """The rounds a sweep runs: ``--rounds``, at most one per timed call (``-n``)."""
    return max(1, min(opts.rounds, opts.iters))


def _interleaved(timed: list[_Timed], opts: PerfOptions) -> None:
    """Time every one of ``timed`` (each backend's out-of-place and in-place runs at one size)
    in ``opts.rounds`` rounds of about ``iters / rounds`` calls each, in turn, the order
    reversed every other round, each warmed up with ``-w`` calls in the first round only: so
    that the backends' times come from the same minutes of a machine whose speed drifts."""
    rounds = rounds_of(opts)
    for r in range(rounds):
        iters = opts.iters // rounds + (r < opts.iters % rounds)
        for t in timed if r % 2 == 0 else timed[::-1]:
            t.block(iters, opts.warmup if r == 0 else 0)


def device_of(opts: PerfOptions) -> torch.device:
    """Where this rank's buffers live: the CPU, or its current GPU."""
    if opts.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _finite_calls(coll: Collective, dtype: torch.dtype, n: int, op: str) -> int:
    """In-place calls of ``coll`` in a row that keep `fill`'s data (|x| <= 8) finite in
    ``dtype`` (0: any number): a sum of ``n`` ranks grows it up to ``n``-fold per call, and a
    compressed call that meets Inf takes another path (its error state dropped), so the timed
    loop restores the input that often."""
    if op != "sum" or n < 2 or not coll.reduces:
        return 0
    headroom = torch.finfo(dtype).max / (8 * 16)
    return max(1, int(math.log(headroom) / math.log(n)))


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timings end when the GPU is done)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _across_ranks(value: float, how: int) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    if how == 0:
        dist.broadcast(t, src=0)
    elif how == 1:
        dist.all_reduce(t)
        t /= dist.get_world_size()
    else:
        dist.all_reduce(t, op=dist.ReduceOp.MIN if how == 2 else dist.ReduceOp.MAX)
    return float(t.item())


def measure(opts: PerfOptions, progress: bool = False) -> dict[str, Any]:
    """Run the sweep on the current default group (a gloo group); every rank returns the result."""
    opts.validate()
    coll = COLLECTIVES[opts.collective]
    n = dist.get_world_size()
    dtype = DTYPES[dtype_name(opts.dtype)]
    itemsize = torch.empty((), dtype=dtype).element_size()
    names = backends_mod.expand(list(opts.backends), list(opts.bits), list(opts.schedules))
    made = [backends_mod.create(name, opts.schedules[0], opts.device) for name in names]
    rows: list[dict[str, Any]] = []
    printer = (TablePrinter(dataclasses.replace(opts, rounds=rounds_of(opts)), n, device_of(opts))
               if dist.get_rank() == 0 else None)
    bar = progress_bar(len(sizes(opts)) * len(made), progress and printer is not None)
    if printer:
        printer.header(names)
    for size in sizes(opts):
        count = coll.usable_count(size // itemsize, n)
        if count == 0:
            bar.update(len(made))
            continue
        nbytes = count * itemsize
        in_count, _ = coll.shape(count, n)
        data = fill(dist.get_rank(), in_count, dtype)
        expected = (coll.expected([fill(r, in_count, dtype) for r in range(n)], dist.get_rank(),
                                  opts.op) if opts.check else None)
        timed = {(backend.name, place): _Timed(coll, backend, count, data, expected, opts,
                                               place == "in_place")
                 for backend in made for place in ("out_of_place", "in_place")}
        _interleaved(list(timed.values()), opts)
        for backend in made:
            results = {place: timed.pop((backend.name, place)).result()
                       for place in ("out_of_place", "in_place")}
            row = _row(coll, backend, nbytes, count, n, itemsize, results, opts)
            rows.append(row)
            if printer:
                printer.row(row, bar)
            bar.update(1)
    bar.close()
    result = {"collective": opts.collective, "nranks": n, "dtype": dtype_name(opts.dtype),
              "op": opts.op, "iters": opts.iters, "warmup": opts.warmup, "rounds": rounds_of(opts),
              "backends": names, "exact_backends": [b.name for b in made if b.exact],
              "rows": rows, "avg_busbw": _avg_busbw(rows, names)}
    if printer:
        printer.footer(result)
    return result


def _row(coll: Collective, backend: backends_mod.Backend, nbytes: int, count: int, n: int,
         itemsize: int, results: dict[str, dict[str, float]], opts: PerfOptions) -> dict[str, Any]:
    factor = coll.bus_factor(n)
    logical = factor * nbytes
    wire = results["in_place"]["wire_bytes"]
    if wire is None:
        wire = logical * (backend.wire_itemsize or itemsize) / itemsize
    row: dict[str, Any] = {"size": nbytes, "count": count, "type": dtype_name(opts.dtype),
                           "redop": opts.op if coll.reduces else "none", "root": -1,
                           "backend": backend.name, "wire_bytes": int(wire),
                           "ratio": wire / logical if logical else 1.0,
                           "intra_node_bytes": results["in_place"]["intra_node_bytes"],
                           "inter_node_bytes": results["in_place"]["inter_node_bytes"]}
    for place, r in results.items():
        algbw = nbytes / (r["time_us"] * 1e-6) / 1e9
        row[place] = {"time_us": r["time_us"], "algbw": algbw, "busbw": algbw * factor,
                      "error": r["error"], "host_us": r["host_us"]}
    row["host_us"] = results["in_place"]["host_us"]
    return row


def _avg_busbw(rows: list[dict[str, Any]], names: list[str]) -> dict[str, float]:
    out = {}
    for name in names:
        values = [r[p]["busbw"] for r in rows if r["backend"] == name
                  for p in ("out_of_place", "in_place")]
        out[name] = sum(values) / len(values) if values else 0.0
    return out
