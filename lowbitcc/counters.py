"""`Stats`: counters of what the "loco" groups sent, behind `lowbitcc.stats()` (the process-wide
instance is `lowbitcc.state.STATS`).

Two categories, ``compressed`` and ``exact``, and their sum ``total``. For each: ``calls``;
``tensor_bytes`` (sum of the input sizes); ``logical_bytes`` (bytes this rank would have sent
with the same schedule had the elements travelled in their own dtype); ``wire_bytes`` (bytes
this rank actually sent, headers and scales included); ``codec_s`` and ``wire_s`` (seconds
spent encoding/decoding and exchanging). Exact reductions (all-reduce, reduce-scatter, reduce)
run gloo's or NCCL's own schedules, which this package does not see: their logical and wire
bytes are the ring volume of `lowbitcc.collectives` (the bus factor times the call's size),
and their times stay 0; exact data movements (broadcast, all-gather, ...) count only ``calls``
and ``tensor_bytes``. ``total``'s ``ratio`` is the wire bytes over the logical bytes of every
counted call, what switching to "loco" saved. ``compressed`` also has
``residual_sq`` and ``input_sq``, the squared norms of the quantization residual and of the
compensated input, and ``relative_error = sqrt(residual_sq / input_sq)``. ``exact`` also has
``model_exact``: compressible calls that the cost model sent exact (`lowbitcc.cost_model`).
``intra_node_bytes`` and ``inter_node_bytes`` split the wire bytes of lowbitcc's own schedules
(the compressed calls, and the hierarchical schedule's exact node steps) by the link they take:
to a rank of this rank's node or to another node (`transports.topology`: ``LOCO_NODE_SIZE``
or the launcher's ``LOCAL_WORLD_SIZE``; unknown, every rank counts as one node). Exact calls
that gloo or NCCL run themselves are not split (their schedule is theirs).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import weakref
from typing import Any, Protocol

import torch


@dataclasses.dataclass
class Counters:
    calls: int = 0
    tensor_bytes: int = 0
    logical_bytes: int = 0
    wire_bytes: int = 0
    codec_s: float = 0.0
    wire_s: float = 0.0
    residual_sq: float = 0.0
    input_sq: float = 0.0
    model_exact: int = 0
    intra_node_bytes: int = 0
    inter_node_bytes: int = 0


_SUMMED = ("calls", "tensor_bytes", "logical_bytes", "wire_bytes", "codec_s", "wire_s",
           "intra_node_bytes", "inter_node_bytes")
"""The `Counters` fields that ``total`` sums."""


class SecondsSource(Protocol):
    """What measures a category's codec and wire seconds away from `Stats` (a plan's C++ core,
    ``backend/csrc/plan_core.h``) and hands them over once, to whichever asks first."""

    def take_seconds(self) -> tuple[float, float]:
        """``(codec_s, wire_s)`` measured since the last take."""
        ...


class CountsSource(Protocol):
    """What counts calls away from `Stats` (a group's C++ steady runner, its ``ServedCounts``:
    ``backend/csrc/served_counts.h``) and hands the counts over when they are read."""

    def take_counts(self) -> dict[str, dict[str, float]]:
        """What was counted since the last take, by category and `Counters` field (only those
        counted), zeroed."""
        ...


class Stats:
    """Thread-safe accumulation of `Counters` per category."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # one reader of the accumulators and the watched sources at a time (`snapshot`, `sent`,
        # `fold_counts`), and `reset`
        self._reading = threading.Lock()
        self._counters = {"compressed": Counters(), "exact": Counters()}
        self._accumulators: dict[tuple, torch.Tensor] = {}  # by `accumulator`'s key
        self._read: dict[tuple, list[float]] = {}
        self._sources: weakref.WeakKeyDictionary[SecondsSource, str] = weakref.WeakKeyDictionary()
        self._counting: weakref.WeakSet[CountsSource] = weakref.WeakSet()
        self._gone: list[CountsSource] = []  # `hand_over_counts`' (appended without a lock)

    def add(self, category: str, **deltas: float) -> None:
        with self._lock:
            c = self._counters[category]
            for name, delta in deltas.items():
                setattr(c, name, getattr(c, name) + delta)

    def add_call(self, category: str, tensor_bytes: int, logical_bytes: int) -> None:
        """`add` of one call of ``tensor_bytes`` (``logical_bytes`` on a ring)."""
        c = self._counters[category]
        with self._lock:
            c.calls += 1
            c.tensor_bytes += tensor_bytes
            c.logical_bytes += logical_bytes

    def add_codec(self, category: str, seconds: float) -> None:
        """`add` of ``codec_s`` alone: every encode and decode adds its time (no keywords)."""
        c = self._counters[category]
        with self._lock:
            c.codec_s += seconds

    def add_wire(self, category: str, seconds: float) -> None:
        """`add` of ``wire_s`` alone: every wait for a transfer adds its time."""
        c = self._counters[category]
        with self._lock:
            c.wire_s += seconds

    def add_sent(self, category: str, seconds: float, intra_node: int, inter_node: int) -> None:
        """`add` of a transfer started in ``seconds`` (``wire_s``) that sends ``intra_node`` and
        ``inter_node`` bytes (``wire_bytes`` their sum)."""
        c = self._counters[category]
        with self._lock:
            c.wire_s += seconds
            c.wire_bytes += intra_node + inter_node
            c.intra_node_bytes += intra_node
            c.inter_node_bytes += inter_node

    def add_run(self, category: str, run: Counters) -> None:
        """`add` of everything one call counted in ``run`` (`RunTally.flush`), under one lock."""
        c = self._counters[category]
        with self._lock:
            c.calls += run.calls
            c.tensor_bytes += run.tensor_bytes
            c.logical_bytes += run.logical_bytes
            c.codec_s += run.codec_s
            c.wire_s += run.wire_s
            c.wire_bytes += run.wire_bytes
            c.intra_node_bytes += run.intra_node_bytes
            c.inter_node_bytes += run.inter_node_bytes

    def sent(self, category: str) -> dict[str, int]:
        """The bytes a category's calls sent so far (`add`'s keywords: ``wire_bytes``,
        ``intra_node_bytes``, ``inter_node_bytes``), the watched counts included
        (`watch_counts`)."""
        with self._reading:
            self._fold_counting()
        c = self._counters[category]
        with self._lock:
            return {"wire_bytes": c.wire_bytes, "intra_node_bytes": c.intra_node_bytes,
                    "inter_node_bytes": c.inter_node_bytes}

    def accumulator(self, category: str, device: torch.device,
                    thread: int | None = None) -> torch.Tensor:
        """float64 ``[residual_sq, input_sq]`` on ``device`` that encodes add a category's sums
        into without a step of their own (on a device on any stream, without a launch): made
        once and kept for the process, on the CPU one per thread (the C++ encodes of two
        threads would race on one): the calling thread's, or ``thread``'s (an ident) for
        encodes that stand in for that thread's while it runs none (a plan's C++ core for the
        group's worker, `backend.steady_runner`). `snapshot` reads what was added since its
        last read; `reset` zeroes them."""
        key = (category, device) if device.type != "cpu" else (
            category, device, threading.get_ident() if thread is None else thread)
        acc = self._accumulators.get(key)
        if acc is None:
            with self._lock:
                acc = self._accumulators.setdefault(
                    key, torch.zeros(2, dtype=torch.float64, device=device))
        return acc

    def watch(self, category: str, source: SecondsSource) -> None:
        """Count ``source``'s seconds in ``category`` at each `snapshot`, while it lives (it
        also hands them to whoever else takes them first, who adds them with `add`)."""
        with self._lock:
            self._sources[source] = category

    def watch_counts(self, source: CountsSource) -> None:
        """Add what ``source`` counted (`CountsSource.take_counts`) at each read (`snapshot`,
        `sent`), while it lives; `reset` drops what it counted until then. Called with the GIL
        held, as ``take_counts`` is (the runner's counts are kept under the GIL)."""
        with self._lock:
            self._counting.add(source)

    def fold_counts(self, source: CountsSource) -> None:
        """Add what ``source`` counted now, and watch it no more (a runner that counts in
        another `Stats` from now on). Takes the statistics' locks: not for a destructor
        (`hand_over_counts`)."""
        with self._reading:
            with self._lock:
                self._counting.discard(source)
            self._add_counts(source.take_counts())

    def hand_over_counts(self, source: CountsSource) -> None:
        """Keep ``source``, whose owner goes, until the next read adds what it counted last (or
        `reset` drops it). Takes no lock, so that a destructor may call it: the garbage collector
        can run one inside any of this object's locks, in the thread that holds it."""
        self._gone.append(source)  # (atomic under the GIL)

    def _add_counts(self, counts: dict[str, dict[str, float]]) -> None:
        """`add` of `CountsSource.take_counts`' answer, category by category."""
        for category, deltas in counts.items():
            self.add(category, **deltas)

    def _watched_counts(self) -> list[CountsSource]:
        """Under ``_reading``: the sources to take counts from (`watch_counts`), those handed
        over (`hand_over_counts`) let go of."""
        with self._lock:
            counting = list(self._counting)
        while self._gone:
            counting.append(self._gone.pop())
        return counting

    def _fold_counting(self) -> None:
        """Under ``_reading``: the watched counts (`watch_counts`, `hand_over_counts`) added."""
        for source in self._watched_counts():
            self._add_counts(source.take_counts())

    def snapshot(self) -> dict[str, Any]:
        """The counters (waits for the device sums still being computed on this stream); the
        seconds of the watched sources taken first (`watch`), and their counts
        (`watch_counts`)."""
        with self._reading:  # one reader at a time: each delta is added once
            with self._lock:
                accumulators = dict(self._accumulators)
                sources = list(self._sources.items())
            for source, category in sources:
                codec_s, wire_s = source.take_seconds()
                self.add(category, codec_s=codec_s, wire_s=wire_s)
            self._fold_counting()
            for key, acc in accumulators.items():
                now = acc.tolist()
                before = self._read.get(key, [0.0, 0.0])
                self._read[key] = now
                self.add(key[0], residual_sq=now[0] - before[0], input_sq=now[1] - before[1])
        with self._lock:
            out = {k: dataclasses.asdict(v) for k, v in self._counters.items()}
        comp = out["compressed"]
        comp["relative_error"] = (
            math.sqrt(comp["residual_sq"] / comp["input_sq"]) if comp["input_sq"] > 0 else 0.0
        )
        comp["ratio"] = comp["wire_bytes"] / comp["logical_bytes"] if comp["logical_bytes"] else 0.0
        total = {name: out["compressed"][name] + out["exact"][name] for name in _SUMMED}
        total["ratio"] = total["wire_bytes"] / total["logical_bytes"] if total["logical_bytes"] else 0.0
        out["total"] = total
        return out

    def reset(self) -> None:
        with self._reading:
            counting = self._watched_counts()
            with self._lock:
                for source in list(self._sources):
                    source.take_seconds()
                for source in counting:
                    source.take_counts()
                self._counters = {"compressed": Counters(), "exact": Counters()}
                # zeroed on the current stream: sums of kernels still running elsewhere may count
                # in the new period (statistics only), and the tensors kernels may use stay alive
                for acc in self._accumulators.values():
                    acc.zero_()
                self._read = {}


class RunTally:
    """What one call counts in one category of ``stats`` while it runs, added to ``stats`` at
    once by `flush` (`Stats.add_run`): a call place's plan (`backend.call_plan.CallPlan`) hands
    it to its compressor and its transport as their ``stats`` (`add_codec`, `add_wire`,
    `add_sent`: `Stats`' methods, the category argument ignored), so that a
    steady-state call takes the statistics' lock once instead of once per encode, decode and
    transfer. One thread at a time (the plan's); nothing is locked here."""

    def __init__(self, stats: Stats, category: str = "compressed") -> None:
        self.stats, self.category = stats, category
        self.counted = Counters()
        """What the call counted so far (its residual sums go to ``stats``' accumulator)."""

    def add_call(self, category: str, tensor_bytes: int, logical_bytes: int) -> None:
        c = self.counted
        c.calls += 1
        c.tensor_bytes += tensor_bytes
        c.logical_bytes += logical_bytes

    def add_codec(self, category: str, seconds: float) -> None:
        self.counted.codec_s += seconds

    def add_wire(self, category: str, seconds: float) -> None:
        self.counted.wire_s += seconds

    def add_sent(self, category: str, seconds: float, intra_node: int, inter_node: int) -> None:
        c = self.counted
        c.wire_s += seconds
        c.wire_bytes += intra_node + inter_node
        c.intra_node_bytes += intra_node
        c.inter_node_bytes += inter_node

    def add(self, category: str, **deltas: float) -> None:
        """Anything else goes to ``stats`` at once."""
        self.stats.add(category, **deltas)

    def accumulator(self, category: str, device: torch.device) -> torch.Tensor:
        return self.stats.accumulator(category, device)

    def flush(self) -> None:
        """Add what was counted since the last flush to ``stats``, and start again."""
        self.stats.add_run(self.category, self.counted)
        self.counted = Counters()
