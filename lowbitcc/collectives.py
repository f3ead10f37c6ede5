"""The collectives of c10d that a "loco" group names, one record each (as nccl-tests' testColl).

Each `Collective` says what is the same wherever the call is handled: its ``code`` in a call
descriptor (`lowbitcc.codec.wire`), whether its descriptor's ``group_size`` field carries a
root rank (``rooted``), how it may be compressed (``compressed``: "reduction" for the
error-compensated reductions, "gather" for ``param_bits`` all-gathers, "" for never), and its
bus factor (nccl-tests' definitions): the bytes one rank sends in a ring schedule, per byte of
the call's *size*, which is the tensor for an all-reduce, the whole input for a
reduce-scatter and the whole output for an all-gather. `logical_bytes` is what the statistics
count for a call, compressed or exact (`lowbitcc.counters`), and what ``lowbitcc perf`` reports
bandwidth on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective (see the module docstring)."""

    name: str
    code: int
    bus_factor: Callable[[int], float]
    rooted: bool = False
    compressed: str = ""

    def logical_bytes(self, size_bytes: int, world: int) -> int:
        """Bytes one of ``world`` ranks sends for a call of ``size_bytes`` in its own dtype."""
        return round(self.bus_factor(world) * size_bytes)


def _ring(n: int) -> float:
    return (n - 1) / n


_TABLE = (
    Collective("all_reduce", 1, lambda n: 2 * (n - 1) / n, compressed="reduction"),
    Collective("reduce_scatter", 2, _ring, compressed="reduction"),
    Collective("all_gather", 3, _ring, compressed="gather"),
    Collective("broadcast", 4, lambda n: 1.0, rooted=True),
    Collective("gather", 5, _ring, rooted=True),
    Collective("scatter", 6, _ring, rooted=True),
    Collective("all_to_all", 7, _ring),
    Collective("barrier", 8, lambda n: 0.0),
    Collective("reduce", 9, lambda n: 1.0, rooted=True),
)

COLLECTIVES: dict[str, Collective] = {c.name: c for c in _TABLE}
"""Every collective a call descriptor can name, by name."""
