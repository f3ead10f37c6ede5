"""The compressed all-gather (the parameter all-gathers of FSDP and ZeRO-3, ``param_bits``).

``all_gather(source, out, comp, links)``: each rank quantizes its one row of ``m`` elements once
(stage ``"gather"``; parameters are not accumulated, so the call's compressor keeps no error
feedback), the ranks all-gather these messages over ``links.world``, and every rank decodes all
of them, its own included, into flat ``out`` (``size * m`` elements) in rank order: with nearest
rounding every rank decodes the same bytes with the same arithmetic, so ``out`` is bitwise the
same on every rank.
"""

from __future__ import annotations

import torch

from lowbitcc.compressor import CallCompressor, Source
from lowbitcc.transports.links import Links


def all_gather(source: Source, out: torch.Tensor, comp: CallCompressor, links: Links) -> None:
    """Every rank's one-row ``source`` into flat ``out`` (see the module docstring)."""
    mine = comp.encode("gather", source, [links.world.rank])
    gathered = links.world.all_gather(mine.view(-1))
    comp.decode_into(gathered, source.m, list(range(links.world.size)), out)
