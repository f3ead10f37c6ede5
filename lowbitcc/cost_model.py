"""`CostModel`: per call, whether compressing pays, learned from the timings of real calls.

A compressible call (the policy allows it, and no `lowbitcc.compressed()` block forces it) is
compressed only where that has been faster than the exact call of the same *size class*
(collective, device type and ``floor(log2(bytes))``) on this group:

1. the first ``warmup`` calls of a class run compressed and the next ``warmup`` exact (the
   first of each is not timed: one-time costs such as buffer growth would count; of the
   others the fastest counts, so that one call slowed by something else on the machine does
   not decide the choice);
2. from then on the path with the lower mean seconds per byte (an exponential moving average
   with weight ``ALPHA``, from the warm-up's fastest; compressed must beat exact by
   ``MARGIN``) is taken, and the other is
   retried now and then (an *exploration* call), so a change of conditions (link, load) is
   noticed. The gap between explorations is at least ``explore_every`` calls, and long enough
   that exploring costs at most ``EXPLORE_COST`` of the class's time: where a compressed call
   takes 30 times an exact one (a fast GPU link), it is retried once in ~600 calls, not 64.

The counts that drive steps 1-2 follow the calls in issue order, the same on every rank; the
timings, and so the choices and gaps, do not (each rank measures its own). So the model only
*suggests*: each rank writes its suggestion into the call descriptor it exchanges anyway
(``LocoConfig.check``), and every rank follows rank 0's (`lowbitcc.backend.compressed_call`).
Under the call schedule the ranks agree on a place's path once per cycle of the place
(`lowbitcc.backend.renewal`), with rank 0's suggestion for the place's next cycle. Without the descriptor
exchange the model is not consulted and every compressible call is compressed.

Timings of CPU calls are wall seconds from the start of the call on the group's worker to its
end (the compressed schedule, or the exact gloo call completing); those of CUDA calls are the
GPU time between two events recorded around the call on its stream, read once the GPU has passed
them (`lowbitcc.backend.cuda_issue.StreamTimings`: no host wait). Thread-safe.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable

ALPHA = 0.3
"""Weight of the newest timing in a class's moving average."""
MARGIN = 0.1
"""Compression is chosen only when its mean time is this fraction below the exact call's:
exact is the safe side (timings on a loaded machine are noisy, and a compressed call also
costs error-state memory and quantization error)."""
EXPLORE_COST = 0.05
"""At most this fraction of a class's time goes to exploration calls (see `CostModel`)."""
MAX_GAP = 4096
"""Calls between explorations at most."""


SizeClass = tuple[str, str, int]
"""(collective, device type, floor(log2(input bytes)))."""


@dataclasses.dataclass
class _Class:
    calls: int = 0
    timed: dict[bool, int] = dataclasses.field(default_factory=lambda: {False: 0, True: 0})
    per_byte: dict[bool, float | None] = dataclasses.field(
        default_factory=lambda: {False: None, True: None})
    explore_at: int = -1  # the call that explores next (-1: set at the end of the warm-up)


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """What the model suggests for one call: ``exact`` (else compressed), ``size_class`` to
    report the call's timing under; ``explore``: a warm-up or exploration call."""

    exact: bool
    size_class: SizeClass
    explore: bool = False
    """A warm-up or exploration call: the suggestion holds for this call only."""


class CostModel:
    """The choice between exact and compressed per size class (see the module docstring)."""

    def __init__(self, warmup: int = 3, explore_every: int = 64) -> None:
        if warmup < 1 or not 2 <= explore_every <= MAX_GAP:
            raise ValueError(f"CostModel needs warmup >= 1 and 2 <= explore_every <= {MAX_GAP}")
        self.warmup = warmup
        self.explore_every = explore_every
        self._lock = threading.Lock()
        self._classes: dict[SizeClass, _Class] = {}

    @staticmethod
    def size_class(collective: str, nbytes: int, device: str = "cpu") -> SizeClass:
        return (collective, device, max(nbytes, 1).bit_length() - 1)

    def suggest(self, collective: str, nbytes: int, device: str = "cpu",
                counts: bool = True) -> Suggestion:
        """This rank's suggestion for the next call of ``nbytes`` input bytes on ``device``
        tensors (counts it; call it once per call, in issue order). ``counts`` False: the
        call is counted where it runs (`count`): a place's renewal asks a period ahead of the
        run it decides (`lowbitcc.backend.call_schedule`)."""
        key = self.size_class(collective, nbytes, device)
        with self._lock:
            c = self._class(key)
            n = c.calls
            c.calls += counts
            if n < self.warmup:
                return Suggestion(False, key, explore=True)
            if n < 2 * self.warmup:
                return Suggestion(True, key, explore=True)
            compressed, exact = c.per_byte[False], c.per_byte[True]
            if compressed is None or exact is None:
                best_exact = exact is not None
            else:
                best_exact = compressed * (1 + MARGIN) >= exact
            if c.explore_at < 0:
                c.explore_at = n + self._gap(c, best_exact) - 1
            if n >= c.explore_at:
                c.explore_at = n + self._gap(c, best_exact)
                return Suggestion(not best_exact, key, explore=True)
            return Suggestion(best_exact, key)

    def _class(self, key: SizeClass) -> _Class:
        """Under the lock: the class ``key``, created on first use."""
        c = self._classes.get(key)
        if c is None:
            c = self._classes[key] = _Class()
        return c

    def _gap(self, c: _Class, best_exact: bool) -> int:
        """Calls from one exploration to the next: ``explore_every``, or more where the other
        path is so much slower that exploring would cost over ``EXPLORE_COST``."""
        best, other = c.per_byte[best_exact], c.per_byte[not best_exact]
        if best is None or other is None or best <= 0:
            return self.explore_every
        extra = max(other / best - 1, 0.0)
        return int(min(MAX_GAP, max(self.explore_every, extra / EXPLORE_COST)))

    def count(self, size_class: SizeClass) -> None:
        """Count a call of ``size_class`` that did not ask for a suggestion (one that ran as
        its place's entry)."""
        with self._lock:
            self._class(size_class).calls += 1

    def record(self, size_class: SizeClass, exact: bool, seconds: float,
               nbytes: int) -> None:
        """A call of ``size_class`` took ``seconds`` for ``nbytes`` input bytes on a path
        (``exact``: the exact path, else the compressed one)."""
        self.record_all(((size_class, exact, seconds, nbytes),))

    def record_all(self, timings: Iterable[tuple[SizeClass, bool, float, int]]) -> None:
        """`record` of each ``(size_class, exact, seconds, nbytes)`` in turn, in one call (the
        C++ steady runner hands the timings of the runs it serves over in batches)."""
        with self._lock:
            classes = self._classes
            for size_class, exact, seconds, nbytes in timings:
                # (`_class`'s lookup inline: no Python call per timing where the class exists)
                c = classes.get(size_class) or self._class(size_class)
                c.timed[exact] += 1
                if c.timed[exact] == 1:
                    continue  # the first call of a path pays one-time costs
                value = seconds / max(nbytes, 1)
                old = c.per_byte[exact]
                if old is None or c.timed[exact] <= self.warmup:
                    c.per_byte[exact] = value if old is None else min(old, value)
                else:
                    c.per_byte[exact] = (1 - ALPHA) * old + ALPHA * value

    def table(self) -> list[dict[str, object]]:
        """Every size class: calls, and the mean seconds per GB of each path (None: untimed)."""
        with self._lock:
            items = sorted(self._classes.items())
        return [{"collective": coll, "device": device, "bytes_log2": log2, "calls": c.calls,
                 "exact_s_per_GB": None if c.per_byte[True] is None else c.per_byte[True] * 1e9,
                 "compressed_s_per_GB": (None if c.per_byte[False] is None
                                         else c.per_byte[False] * 1e9)}
                for (coll, device, log2), c in items]
