"""`CycleLearner`: how a call schedule learns the period of the calls the ranks repeat.

While a group's call schedule (`call_schedule`) does not know its period, every call exchanges a
descriptor, and the calls the ranks agree on are kept here by index (each call's *index* is
its position in issue order since the schedule began, the same on every rank). The period
becomes known in one of two ways, each decided by the agreed calls and the calls' epochs alone,
so alike on every rank:

- **epochs** (`policy.epoch`: a backward pass, or the calls between two optimizer steps): the
  first call of an epoch agreed equal to the first call of an earlier epoch closes the period
  at their distance. Training loops; DDP's ``Join``, whose shadow calls run outside backward,
  keeps the places of the calls they shadow, since epochs no longer matter once it is known;
- **the calls themselves**, where no epoch has begun since learning began and the calls are
  not a backward pass's (a loop of ``dist.all_reduce`` with no backward and no optimizer step:
  a benchmark, a custom optimizer, a user's own sync code; a backward pass's calls wait for the
  next pass, whose epoch closes the period): the shortest cycle of at most `LONGEST` calls that
  the agreed calls have just repeated ``repeats`` times in a row (`REPEATS` at first). A guess can be wrong (a
  longer pattern that begins with repeats): the first call that is not its guessed place's
  call deviates on every rank alike, every rank starts again (`call_schedule`), and each such
  restart doubles the repeats the next guess needs (up to `MOST_REPEATS`).

Past `CAPACITY` calls without a period, learning starts again.

Threads: `advance` in the calling thread; `learn` where outcomes are recorded (the worker, or
the calling thread inline), which the next call waits for (`CallSchedule.wait_settled`).
"""

from __future__ import annotations

from typing import Any

from lowbitcc import policy

CAPACITY = 4096
"""Calls kept while the period is unknown; past it, learning starts again."""
REPEATS = 3
"""Times a cycle of calls must come round in a row before it is taken as the period, where
no epoch marks it."""
MOST_REPEATS = 64
"""The most repeats a guess needs after wrong guesses."""
LONGEST = 1024
"""The longest cycle learned from the calls themselves."""


class CycleLearner:
    """The agreed calls of a schedule that does not know its period yet (see the module
    docstring): ``entries`` by index (`call_schedule.Entry`, whose ``key`` names its call)."""

    def __init__(self) -> None:
        self.repeats = REPEATS
        self.guessed = False
        """The last period found was a guess from the calls themselves (not from epochs)."""
        self.reset()

    def reset(self) -> None:
        """Learn anew (the schedule forgot everything)."""
        self.entries: dict[int, Any] = {}
        self._starts: list[int] = []  # the index of each epoch's first call
        self._epoch: tuple[str, int] | None = None
        self._seen: dict[tuple, list[int]] = {}  # each call key's indices, for guesses

    def wrong_guess(self) -> None:
        """Every rank deviated alike from a period found here: the next guess needs twice the
        repeats."""
        if self.guessed:
            self.repeats = min(2 * self.repeats, MOST_REPEATS)

    def advance(self, index: int) -> None:
        """The call issued now has ``index``: where it begins a new epoch, note it."""
        epoch = policy.epoch()
        if epoch != self._epoch:
            self._epoch = epoch
            self._starts.append(index)

    def learn(self, index: int, entry: Any) -> tuple[int, int] | None:
        """Keep ``entry``, the call agreed at ``index``; where that closes the period, return
        ``(period, origin)`` (the first index of the cycle) with `entries` holding the cycle's
        calls by their place, ``entry`` at its own; else None."""
        starts = self._starts
        found = None
        if starts and index == starts[-1]:
            for start in starts[:-1]:
                first = self.entries.get(start)
                if first is not None and first.key == entry.key:
                    found = (index - start, start)
                    break
        self.entries[index] = entry
        if found is None and len(starts) <= 1 and (self._epoch is None
                                                   or self._epoch[0] == "step"):
            found = self._repeated(index, entry.key)  # no epoch marks it: not in backward
            self.guessed = found is not None
        elif found is not None:
            self.guessed = False
        if found is not None:
            period, origin = found
            cycle = {i: e for i, e in self.entries.items() if origin <= i < origin + period}
            cycle[origin + (index - origin) % period] = entry
            self.reset()
            self.entries = cycle
            return found
        if starts and index - starts[0] >= CAPACITY:
            self.entries = {index: entry}
            self._starts = [index]
            self._seen = {}
        return None

    def _repeated(self, index: int, key: tuple) -> tuple[int, int] | None:
        """The shortest cycle (at most `LONGEST` calls) that the calls up to ``index`` (of
        ``key``) have repeated `repeats` times in a row: ``(period, origin)``, its last round
        beginning at ``origin``; else None."""
        seen = self._seen.setdefault(key, [])
        seen.append(index)
        entries, repeats = self.entries, self.repeats
        for earlier in reversed(seen[:-1]):
            period = index - earlier
            if period > LONGEST:
                break
            first = index - repeats * period + 1
            if first < 0:
                break
            if all(entries.get(i) is not None and entries.get(i + period) is not None
                   and entries[i].key == entries[i + period].key
                   for i in range(first, index - period + 1)):
                return period, index - period + 1
        return None
