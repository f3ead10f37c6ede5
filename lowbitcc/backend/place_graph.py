"""`PlaceGraph`: a call place's steady-state compressed run captured in CUDA graphs and replayed
(`LocoConfig.call_graphs`, off by default; the graph replay of the per-call goals). On its
first GPU run (one H200, 2026-11-27) its test did not finish: most likely at the group's
teardown, which `LiveGraphs` now handles (below); not yet run on a GPU since.

A replay is one ``cudaGraphLaunch`` on the call's stream in place of the plan's launches and
NCCL calls (`call_plan.CallPlan`; an encode, an all-gather and a decode at two ranks). What a
replay cannot take from the host it takes from the device: its headers' call number from the
place's counter (`interface.CallCount`: the graph's launches read it, its last adds the stride
the place had at its first capture, every graph's), its verdict from one of the plan's two
words (a graph for each). The rest of the run is the plan's, as for an eager run: call number,
statistics (a replay adds the bytes its capture sent), the Work, the verdict word and canary
copied to the host after it. The call numbers in a replay's headers are the counter's, the same
on every rank, but not the host's once the place's stride changed (an exchange run of the call
schedule, a call the training loop adds now and then): `CallPlan.describe` names the host's.

**Uniform over the ranks.** NCCL: "Whether an operation launch is graph-captured is
considered a collective property of that operation and therefore must be uniform over all
ranks participating in the launch", and "the launch of a graph ... containing a captured NCCL
operation is considered collective for the same set of ranks that were present in the capture,
and each of those ranks must be using the graph derived from that collective capture" (its user
guide, CUDA graphs). So whether a run launches a graph, and which, depends only on what the
ranks of a place share, the plan's run count (every compressed entry runs by its plan, and
``call_graphs`` is one of the settings the ranks agree on): runs 1 and 2 are eager (the second writes the
place's next call number into its counter); from run `CAPTURE_AT` on, every run launches the
graph of its verdict word, captured once, by the first run that needs it (runs 3 and 4, on
every rank alike). A graph's first launch reads the call's source, and its last writes the
call's output, at the addresses the place's device word holds (`CallPlan.addresses`,
`interface.CallCount.addresses`), which the place sets by a fill before a launch where the
call's tensors lie elsewhere than the last call's (a rank's own business: no capture). A run
whose input factor differs from the capture's (`ReduceOp.PREMUL_SUM` with another factor), or
whose reduce-scatter output would be cast or copied after the decode (bf16, non-contiguous),
runs eagerly and turns the place's graphs off, as does a capture that fails (a path whose
launches cannot read the counter, `interface.unfused`, or a message check that raised while
capturing); those are the call's own, the same on every rank. What is not uniform, and not
handled: a rank whose capture fails for a reason of its own (out of memory), an output whose
contiguity differs between ranks, a rank whose call at the place deviates from the agreed one
or takes the job path (a non-contiguous tensor) while the others replay; NCCL may then hang,
which the group's watchdog ends.

**Host records** (`PlaceRecords`, where ``call_graphs`` is off): the same decisions with
`launch_record.LaunchRecord` in place of a CUDA graph, save that a record's replay issues the
eager run's NCCL calls and bytes, so ranks may differ: a place replays only runs whose counter
holds their own call number (`CallPlan.counter_holds_seq`) and records again wherever its
tensors, stride or input factor changed, until it has recorded `RECORDS_IN_A_ROW` times
without a replay of an earlier record; no teardown is needed.

Served (`of`): CUDA (and ``device="meta"`` in the tests' trace), error feedback off
(an error state's poison word and its reset every ``reset_interval`` uses change per run),
nearest rounding (stochastic rounding's keys follow the host's call number), checksums off,
no host check. The capture runs in ``torch.cuda.graph`` (which synchronises the device and
empties the allocator's cache first: a stall, twice per place) in thread-local capture mode
(the group's watchdog thread queries events meanwhile); every kernel and the NCCL communicator
have run eagerly before (CuPy loads its module at its first launch, NCCL makes its
communicator at its first call).

**Teardown.** NCCL destroys (and aborts) a communicator only once every CUDA graph that
captured its kernels is gone: ``commDestroySync`` (NCCL's ``src/init.cc``) polls "until all
graphs referencing us die", and ``ncclCommAbort`` reaches the same loop. A group's graphs
therefore go first (`LiveGraphs.release`, the group's ``graphs``): before its inner NCCL group's
shutdown, once its last replay has run (waiting at most the group's timeout), and before the
watchdog's abort, without waiting (a graph still running is destroyed when it ends:
``cudaGraphExecDestroy``).

Threads: the calling thread, inside `cuda_issue.CudaIssuer.compressed` (one call at a time);
`LiveGraphs.release` also the group's watchdog thread, once, before it aborts the group: a
place's lock orders its graphs' storing, launch and destruction, never held across a GPU
call.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from lowbitcc import state
from lowbitcc.backend import launch_record
from lowbitcc.codec import launch_recording
from lowbitcc.compressor import Source

log = logging.getLogger(__name__)

CAPTURE_AT = 3
"""The plan's first run that launches a graph (captured then)."""
RECORDS_IN_A_ROW = 4
"""Host records made in a row, none replayed again, after which a place stops recording."""


class CudaGraph:
    """``torch.cuda.CUDAGraph`` as `PlaceGraph` uses it: `capture` records ``body``'s work
    (without running it), `replay` launches it on the current stream (``stream``, the caller's
    ``torch.cuda.current_stream``, which torch's replay finds itself)."""

    def __init__(self) -> None:
        self._graph = torch.cuda.CUDAGraph()

    def capture(self, body: Callable[[], Any]) -> None:
        with torch.cuda.graph(self._graph, capture_error_mode="thread_local"):
            body()

    def replay(self, stream: Any) -> None:
        self._graph.replay()

    def reset(self) -> None:
        self._graph.reset()


GRAPH: Callable[[], Any] = CudaGraph
"""What `PlaceGraph` makes its graphs with (tests put a fake in its place)."""


class PlaceGraph:
    """The graphs of one `call_plan.CallPlan`'s place (see the module docstring)."""

    recorded = False
    """Host records (`PlaceRecords`) in place of CUDA graphs."""
    _stop_level = logging.WARNING
    """How `_stop` logs why the place's graphs are off."""

    def __init__(self) -> None:
        self._graphs: dict[int, tuple[Any, tuple]] = {}  # by verdict word: graph, where
        self._addressed: tuple[int, int] | None = None  # what the place's address word holds
        self._factor: float | None = None  # the first capture's input factor ...
        self._stride = 0  # ... and the place's stride then, every graph's (ranks alike)
        self._sent: dict[str, int] = {}  # what one run's transfers add to the statistics
        # (those that are not zero: a host record's replay meters its transfers itself)
        self._stream: Any = None
        self._lock = threading.Lock()  # `release` comes from the group's watchdog thread ...
        self._launching: Any = None  # ... while this graph may be in its launch, ...
        self._doomed: list[Any] = []  # ... and these are destroyed once it returns
        self.off = False
        self.replays = 0

    @staticmethod
    def of(plan: Any) -> PlaceGraph | None:
        """``plan``'s graphs: CUDA graphs (``call_graphs``), or host records (over a transport
        whose transfers can be recorded), where its place can replay at all (see the module
        docstring; the direct schedule, unchunked); else None."""
        codec, config = plan.codec, plan.group.config
        if (plan.device.type == "cpu" or plan.comp.error_dtype is not None
                or codec.rounding != "nearest" or codec.checksum or codec.host_check
                or plan.schedule != "direct" or plan.chunk):
            return None
        if config.call_graphs:
            return PlaceGraph()
        if launch_record.recordable(plan.transport):
            return PlaceRecords()
        return None

    def run(self, plan: Any, source: Source, output: torch.Tensor | None) -> bool:
        """``plan``'s run of ``source`` (into ``output``, a reduce-scatter) by its graph,
        captured first where needed: True; else nothing done, False (the plan runs it
        eagerly). Each verdict word's graph is captured once, on every rank at the same run,
        and launched by every later run wherever the call's tensors lie (their addresses set
        in the place's word first, `_address`)."""
        if self.off or plan.runs < CAPTURE_AT:
            return False
        if self._factor is None:
            self._factor, self._stride = source.factor, plan.stride
        elif source.factor != self._factor:
            return self._stop("its input factor changed")
        if output is not None and (output.dtype != torch.float32 or not output.is_contiguous()):
            return self._stop("its output is cast or copied after the decode")
        made = self._graphs.get(plan.turn)
        counted = made is None
        if counted:
            made = self._capture(plan, source, output, (self._stride,))
            if made is None:
                return False
        self._address(plan, source, output)
        self._replay(plan, made[0], counted)
        return True

    def _address(self, plan: Any, source: Source, output: torch.Tensor | None) -> None:
        """The call's source and output addresses into the place's word (`CallPlan.addresses`),
        which its graphs' first and last launches read, where they are not there already: a
        fill on the current stream (one for an all-reduce in place), before the launch."""
        src = source.tensor.data_ptr()
        out = src if output is None else output.data_ptr()
        if (src, out) == self._addressed:
            return
        words = plan.addresses()
        if output is None:
            words.fill_(src)
        else:
            words[0].fill_(src)
            words[1].fill_(out)
        self._addressed = (src, out)

    def _capture(self, plan: Any, source: Source, output: torch.Tensor | None,
                 where: tuple) -> tuple[Any, tuple] | None:
        """The graph of ``plan``'s turn, captured on the call's tensors with the place's
        counter read (None: the capture failed, the compressor is as before it and the
        place's graphs are off)."""
        graph, addresses = self._new_graph(plan)
        comp = plan.comp
        count = comp.codec.count
        before = state.STATS.sent("compressed")
        count.read, value = True, count.value
        count.value = where[0]
        count.addresses = addresses
        try:
            graph.capture(functools.partial(plan.launch, source, output))
            if comp.wire_error is not None:  # its NaN fill is in the graph: never replay it
                raise comp.wire_error
        except Exception as error:  # the call runs eagerly; the place never replays again
            if isinstance(error, launch_recording.NotRecordableError):
                log.info("%s; %s: the place runs eagerly", error, plan.describe())
            else:
                log.warning("lowbitcc: %s: capturing its graph failed; the place runs eagerly",
                            plan.describe(), exc_info=True)
            sent = state.STATS.sent("compressed")
            state.STATS.add("compressed", **{k: before[k] - v for k, v in sent.items()})
            comp.rebind()
            self._stop("")
            return None
        finally:
            count.read, count.value, count.addresses = False, value, None
        sent = state.STATS.sent("compressed").items()
        self._sent = {k: v - before[k] for k, v in sent if v != before[k]}  # (a record's: none)
        made = (graph, where)
        with self._lock:
            if self.off:  # released meanwhile: this run launches it, then it goes
                self._doomed.append(graph)
            else:
                self._graphs[plan.turn] = made
        return made

    def _new_graph(self, plan: Any) -> tuple[Any, torch.Tensor | None]:
        """A graph to capture ``plan``'s run in, and the address word its launches read: the
        place registered with its group first (a release during the capture finds it)."""
        plan.group.graphs.add(self)
        return GRAPH(), plan.addresses()

    def _replay(self, plan: Any, graph: Any, counted: bool) -> None:
        """Launch ``graph`` on the current stream; ``counted``: its capture, just now, counted
        the run's bytes."""
        stream = torch.cuda.current_stream(plan.device) if plan.device.type == "cuda" else None
        if stream != self._stream:  # the plan's buffers, used by the graph on this stream
            for buffer in plan.buffers():
                buffer.record_stream(stream)
            self._stream = stream
        with self._lock:
            self._launching = graph
        try:
            graph.replay(stream)
        finally:
            with self._lock:
                self._launching, doomed, self._doomed = None, self._doomed, []
            for released in doomed:
                released.reset()
        plan.comp.replayed()
        self.replays += 1
        if not counted and self._sent:
            state.STATS.add("compressed", **self._sent)

    def release(self, deadline: float) -> None:
        """Turn the place's graphs off and destroy them (`LiveGraphs.release`), once the
        stream of its last replay has passed it, waiting until ``deadline`` (`time.monotonic`)
        at most: a peer's failure can leave it stuck (it is then destroyed when it ends). A
        graph another thread is launching now is destroyed by that thread once its launch
        returns (NCCL's abort ends its kernels)."""
        with self._lock:
            self.off = True
            graphs = [graph for graph, _ in self._graphs.values()]
            self._graphs.clear()
            if self._launching in graphs:
                graphs.remove(self._launching)
                self._doomed.append(self._launching)
            stream = self._stream
        if graphs and stream is not None and time.monotonic() < deadline:
            done = torch.cuda.Event()
            done.record(stream)
            while time.monotonic() < deadline:
                try:
                    if done.query():
                        break
                except RuntimeError:  # a CUDA error: nothing left to wait for
                    break
                time.sleep(0.001)
        for graph in graphs:
            graph.reset()

    def _stop(self, why: str) -> bool:
        """Turn the place's graphs off (they stay referenced: a launch may still run)."""
        if why:
            log.log(self._stop_level, "lowbitcc: a call place's graphs are off from now on: %s",
                    why)
        self.off = True
        return False


class PlaceRecords(PlaceGraph):
    """`PlaceGraph` by host records (`launch_record.LaunchRecord`, see the module docstring): a
    rank may replay a call or not on its own, so a place replays only runs whose counter holds
    their own call number, and records again wherever its tensors moved."""

    recorded = True
    _stop_level = logging.INFO

    def __init__(self) -> None:
        super().__init__()
        self._misses = 0  # records made in a row without a replay of one made before

    def _new_graph(self, plan: Any) -> tuple[Any, torch.Tensor | None]:
        """A host record of ``plan``'s run; its launches read no address word (a record is
        made again where the call's tensors moved), and no teardown needs the place."""
        return launch_record.LaunchRecord(plan), None

    def run(self, plan: Any, source: Source, output: torch.Tensor | None) -> bool:
        """`PlaceGraph.run` by a host record: where the counter holds the run's own call
        number, the record of the run's verdict word, made again where the call's tensors,
        stride or input factor changed."""
        if self.off or plan.runs < CAPTURE_AT or not plan.counter_holds_seq:
            return False  # (an eager run sets the counter for the next)
        where = (plan.stride, source.factor, source.tensor.data_ptr(), None if output is None
                 else (output.data_ptr(), output.dtype, output.is_contiguous()))
        made = self._graphs.get(plan.turn)
        counted = made is None or made[1] != where
        if counted:
            if self._misses == RECORDS_IN_A_ROW:
                return self._stop("its tensors move from call to call")
            made = self._capture(plan, source, output, where)
            if made is None:
                return False
            self._misses += 1
        else:
            self._misses = 0
        self._replay(plan, made[0], counted)
        return True


class LiveGraphs:
    """The places of one group that hold graphs (`compressed_call.CallGroup.graphs`), so that
    the group can destroy them before its NCCL communicator (see the module docstring)."""

    def __init__(self) -> None:
        self._places: weakref.WeakSet[PlaceGraph] = weakref.WeakSet()
        self._lock = threading.Lock()  # the calling thread adds, the watchdog's may release

    def add(self, place: PlaceGraph) -> None:
        with self._lock:
            self._places.add(place)

    def release(self, wait_s: float) -> None:
        """Destroy every place's graphs and turn them off (its later runs are eager), once
        their last replays have run, waiting at most ``wait_s`` seconds in all (a shutdown:
        the group's timeout; an abort: 0, since its kernels may never end)."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            places = list(self._places)
        for place in places:
            place.release(deadline)
