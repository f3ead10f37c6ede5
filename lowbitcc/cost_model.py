"""`CostModel`: per call, whether compressing pays, learned from the timings of real calls.

A compressible call (the policy allows it, and no `lowbitcc.compressed()` block forces it) is
compressed only where that has been faster than the exact call of the same *size class* (collective and
``floor(log2(bytes))``) on this group:

1. the first ``warmup`` calls of a class run compressed and the next ``warmup`` exact (the
   first of each is not timed: one-time costs such as buffer growth would count);
2. from then on the path with the lower mean seconds per byte (an exponential moving average
   with weight ``ALPHA``; compressed must beat exact by ``MARGIN``) is taken, and the other is
   retried once every ``explore_every`` calls of the class, so a change of conditions (link,
   load) is noticed.

The counts that drive steps 1-2 follow the calls in issue order, the same on every rank; the
timings do not (each rank measures its own). So the model only *suggests*: each rank writes its
suggestion into the call descriptor it exchanges anyway (``LocoConfig.check``), and every rank
follows rank 0's (`lowbitcc.backend.compressed_call`). An agreed exact choice holds until the
class's next exploration call (`until_explore`), and those calls skip the exchange. Without
the descriptor exchange the model is not consulted and every compressible call is compressed.

Timings are wall seconds from the start of the call on the group's worker to its end (the
compressed schedule, or the exact gloo call completing). Thread-safe.
"""

from __future__ import annotations

import dataclasses
import threading

ALPHA = 0.3
"""Weight of the newest timing in a class's moving average."""
MARGIN = 0.1
"""Compression is chosen only when its mean time is this fraction below the exact call's:
exact is the safe side (timings on a loaded machine are noisy, and a compressed call also
costs error-state memory and quantization error)."""


@dataclasses.dataclass
class _Class:
    calls: int = 0
    timed: dict[bool, int] = dataclasses.field(default_factory=lambda: {False: 0, True: 0})
    per_byte: dict[bool, float | None] = dataclasses.field(
        default_factory=lambda: {False: None, True: None})


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """What the model suggests for one call: ``exact`` (else compressed), ``size_class`` to
    report the call's timing under, and whether the class is ``settled`` (past its warm-up and
    not exploring: the same on every rank, since it depends on counts only)."""

    exact: bool
    size_class: tuple[str, int]
    settled: bool = False


class CostModel:
    """The choice between exact and compressed per size class (see the module docstring)."""

    def __init__(self, warmup: int = 2, explore_every: int = 64) -> None:
        if warmup < 1 or explore_every < 2:
            raise ValueError("CostModel needs warmup >= 1 and explore_every >= 2")
        self.warmup = warmup
        self.explore_every = explore_every
        self._lock = threading.Lock()
        self._classes: dict[tuple[str, int], _Class] = {}

    @staticmethod
    def size_class(collective: str, nbytes: int) -> tuple[str, int]:
        return (collective, max(nbytes, 1).bit_length() - 1)

    def suggest(self, collective: str, nbytes: int) -> Suggestion:
        """This rank's suggestion for the next call of ``nbytes`` input bytes (counts it; call
        it once per call, in issue order)."""
        key = self.size_class(collective, nbytes)
        with self._lock:
            c = self._classes.setdefault(key, _Class())
            n = c.calls
            c.calls += 1
            if n < self.warmup:
                return Suggestion(False, key)
            if n < 2 * self.warmup:
                return Suggestion(True, key)
            compressed, exact = c.per_byte[False], c.per_byte[True]
            if compressed is None or exact is None:
                best_exact = exact is not None
            else:
                best_exact = compressed * (1 + MARGIN) >= exact
            explore = (n - 2 * self.warmup) % self.explore_every == self.explore_every - 1
            return Suggestion(best_exact != explore, key, settled=not explore)

    def count(self, size_class: tuple[str, int]) -> None:
        """Count a call of ``size_class`` that did not ask for a suggestion (a lease's)."""
        with self._lock:
            self._classes.setdefault(size_class, _Class()).calls += 1

    def until_explore(self, size_class: tuple[str, int]) -> int:
        """Calls of ``size_class`` before its next exploration call (0 during warm-up): how
        long an agreed exact choice may be kept without asking again."""
        with self._lock:
            n = self._classes.setdefault(size_class, _Class()).calls
        if n < 2 * self.warmup:
            return 0
        k = (n - 2 * self.warmup) % self.explore_every
        return (self.explore_every - 1 - k) % self.explore_every

    def record(self, size_class: tuple[str, int], exact: bool, seconds: float,
               nbytes: int) -> None:
        """A call of ``size_class`` took ``seconds`` for ``nbytes`` input bytes on a path."""
        with self._lock:
            c = self._classes.setdefault(size_class, _Class())
            c.timed[exact] += 1
            if c.timed[exact] == 1:
                return  # the first call of a path pays one-time costs
            value = seconds / max(nbytes, 1)
            old = c.per_byte[exact]
            c.per_byte[exact] = value if old is None else (1 - ALPHA) * old + ALPHA * value

    def table(self) -> list[dict[str, object]]:
        """Every size class: calls, and the mean seconds per GB of each path (None: untimed)."""
        with self._lock:
            items = sorted(self._classes.items())
        return [{"collective": coll, "bytes_log2": log2, "calls": c.calls,
                 "exact_s_per_GB": None if c.per_byte[True] is None else c.per_byte[True] * 1e9,
                 "compressed_s_per_GB": (None if c.per_byte[False] is None
                                         else c.per_byte[False] * 1e9)}
                for (coll, log2), c in items]
