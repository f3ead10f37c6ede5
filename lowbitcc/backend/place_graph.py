"""`PlaceGraph`: a call place's steady-state compressed run captured in CUDA graphs and replayed
(`LocoConfig.call_graphs`, off by default; issue 47's graph replay). **Not yet run on a GPU.**

A replay is one ``cudaGraphLaunch`` on the call's stream in place of the plan's launches and
NCCL calls (`call_plan.CallPlan`; an encode, an all-gather and a decode at two ranks). What
a replay cannot take from the host it takes from the device: its headers' call number from
the place's counter (`interface.CallCount`: the graph's launches read it, its last adds the
place's stride), its verdict from one of the plan's two words (a graph for each). The rest
of the run is the plan's, as for an eager run: call number, statistics (a replay adds the
bytes its capture sent), the Work, the verdict word and canary copied to the host after it.

**Uniform over the ranks.** NCCL: "Whether an operation launch is graph-captured is
considered a collective property of that operation and therefore must be uniform over all
ranks participating in the launch" (its user guide, CUDA graphs). So whether a run replays
depends only on what the ranks of a place share: the plan's run count and the call's
arguments. Runs 1 and 2 are eager (the second writes the place's next call number into its
counter); runs `CAPTURE_AT` and `CAPTURE_AT` + 1 each capture the graph of their verdict
word and replay it at once; every later run replays its word's graph. A run whose tensor
lies elsewhere than the captured one (the caller's buffer moved; the graph keeps the
captured one alive) still replays, through it: a copy in and (an all-reduce) a copy back. A
run whose input factor differs from the capture's (`ReduceOp.PREMUL_SUM` with another
factor) runs eagerly and turns the place's graphs off, as does a capture that fails (a path
whose launches cannot read the counter: `interface.unfused`); both are the call's own, the
same on every rank.

Served (`eligible`): CUDA (and ``device="meta"`` in the tests' trace), error feedback off
(an error state's poison word and its reset every ``reset_interval`` uses change per run),
nearest rounding (stochastic rounding's keys follow the host's call number), checksums off,
no host check. The capture runs in ``torch.cuda.graph`` (which synchronises the device
first: once per graph) in thread-local capture mode (the group's watchdog thread queries
events meanwhile); every kernel and the NCCL communicator have run eagerly before (CuPy
loads its module at its first launch, NCCL makes its communicator at its first call).

Threads: the calling thread, inside `cuda_issue.CudaIssuer.compressed` (one call at a time).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from lowbitcc import state
from lowbitcc.compressor import Source

log = logging.getLogger(__name__)

CAPTURE_AT = 3
"""The plan's run that captures the graph of its first verdict word (the next, its second's)."""


class CudaGraph:
    """``torch.cuda.CUDAGraph`` as `PlaceGraph` uses it: `capture` records ``body``'s work
    (without running it), `replay` launches it on the current stream."""

    def __init__(self) -> None:
        self._graph = torch.cuda.CUDAGraph()

    def capture(self, body: Callable[[], Any]) -> None:
        with torch.cuda.graph(self._graph, capture_error_mode="thread_local"):
            body()

    def replay(self) -> None:
        self._graph.replay()


GRAPH: Callable[[], Any] = CudaGraph
"""What `PlaceGraph` makes its graphs with (tests put a fake in its place)."""


class PlaceGraph:
    """The graphs of one `call_plan.CallPlan`'s place (see the module docstring)."""

    def __init__(self) -> None:
        self._graphs: dict[int, Any] = {}  # by the plan's verdict word (its turn)
        self._source: Source | None = None  # the captured call's: its tensor and factor
        self._output: torch.Tensor | None = None  # ... and its output (reduce-scatter)
        self._sent: dict[str, int] = {}  # what one run's transfers add to the statistics
        self._stream: Any = None
        self.off = False
        self.replays = 0

    @staticmethod
    def eligible(plan: Any) -> bool:
        """Whether ``plan``'s place replays graphs (see the module docstring)."""
        codec = plan.codec
        return (plan.device.type != "cpu" and bool(plan.group.config.call_graphs)
                and plan.comp.error_dtype is None and codec.rounding == "nearest"
                and not codec.checksum and not codec.host_check)

    def run(self, plan: Any, source: Source, output: torch.Tensor | None) -> bool:
        """``plan``'s run of ``source`` (into ``output``, a reduce-scatter): replayed, or
        captured and replayed, True; else nothing done, False (the plan runs it eagerly)."""
        graph = self._graphs.get(plan.turn)
        if graph is None:
            if self.off or plan.runs < CAPTURE_AT:
                return False
            if self._source is None:
                self._source, self._output = source, output
            if source.factor != self._source.factor:
                return self._stop("its input factor changed")
            graph = self._capture(plan)
            if graph is None:
                return False
            self._replay(plan, graph, source, output, counted=True)
            return True
        if source.factor != self._source.factor:
            return self._stop("its input factor changed")
        self._replay(plan, graph, source, output, counted=False)
        return True

    def _capture(self, plan: Any) -> Any:
        """The graph of ``plan``'s turn, captured on the first captured call's tensors with the
        place's counter read (None: the capture failed; the place's graphs are off)."""
        graph = GRAPH()
        count = plan.comp.codec.count
        before = state.STATS.sent("compressed")
        count.read, value = True, count.value
        count.value = plan.stride
        try:
            graph.capture(functools.partial(plan.launch, self._source, self._output))
        except Exception:  # the call runs eagerly; the place never replays
            log.warning("lowbitcc: %s: capturing its graph failed; the place runs eagerly",
                        plan.describe(), exc_info=True)
            self._stop("")
            return None
        finally:
            count.read, count.value = False, value
        self._sent = {k: v - before[k] for k, v in state.STATS.sent("compressed").items()}
        self._graphs[plan.turn] = graph
        return graph

    def _replay(self, plan: Any, graph: Any, source: Source, output: torch.Tensor | None,
                counted: bool) -> None:
        """Launch ``graph`` for ``source`` (and ``output``), through the captured tensors
        where the call's lie elsewhere; ``counted``: its capture counted its bytes."""
        captured, captured_out = self._source.tensor, self._output
        moved = source.tensor.data_ptr() != captured.data_ptr()
        if moved:
            captured.copy_(source.tensor)
        stream = torch.cuda.current_stream(plan.device) if plan.device.type == "cuda" else None
        if stream != self._stream:  # the plan's buffers, used by the graph on this stream
            for buffer in plan.buffers():
                buffer.record_stream(stream)
            self._stream = stream
        graph.replay()
        plan.comp.replayed()
        self.replays += 1
        if output is None and moved:
            source.tensor.copy_(captured)
        elif output is not None and output.data_ptr() != captured_out.data_ptr():
            output.copy_(captured_out)
        if not counted:
            state.STATS.add("compressed", **self._sent)

    def _stop(self, why: str) -> bool:
        if why:
            log.warning("lowbitcc: a call place's graphs are off from now on: %s", why)
        self.off = True
        self._graphs.clear()
        self._source = self._output = None
        return False
