"""Compressed reduce-scatter / all-reduce schedules (see docs/algorithms.md), and the compressed
all-gather (`gather`, one schedule).

Every reduction schedule module has ``reduce_scatter(source, comp, links, chunk, out=None)``
-> fp32 ``[m]`` (the sum of this rank's row, in ``out`` where given) and ``all_reduce(source,
out, comp, links, chunk)`` (the sum of every row into flat ``out``, identical on every rank). A
schedule sees only `CallCompressor` (codec, error feedback, statistics, buffers) and the
group's `Links` (transports through their protocol); flat schedules use ``links.world``, the
hierarchical one its node and rail links too.

`SCHEDULES` is the registry; `NAMES` its names, which `lowbitcc.config` validates against (with
"auto", which the process group resolves per call).
"""

from __future__ import annotations

from types import ModuleType

import torch

from lowbitcc.compressor import CallCompressor, Source
from lowbitcc.schedules import direct, gather, hierarchical, ring, tree
from lowbitcc.transports.links import Links

SCHEDULES: dict[str, ModuleType] = {
    "direct": direct, "ring": ring, "tree": tree, "hierarchical": hierarchical,
}
NAMES = tuple(SCHEDULES)


def reduce_scatter(name: str, source: Source, comp: CallCompressor, links: Links,
                   chunk: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Schedule ``name``'s reduce-scatter: fp32 ``[m]``, the sum of this rank's row (in
    ``out`` where given)."""
    return SCHEDULES[name].reduce_scatter(source, comp, links, chunk, out=out)


def all_reduce(name: str, source: Source, out: torch.Tensor, comp: CallCompressor, links: Links,
               chunk: int) -> None:
    """Schedule ``name``'s all-reduce into flat ``out``."""
    SCHEDULES[name].all_reduce(source, out, comp, links, chunk)


def all_gather(source: Source, out: torch.Tensor, comp: CallCompressor, links: Links) -> None:
    """The compressed all-gather of every rank's one-row ``source`` into flat ``out``."""
    gather.all_gather(source, out, comp, links)


__all__ = ["NAMES", "SCHEDULES", "all_gather", "all_reduce", "reduce_scatter"]
