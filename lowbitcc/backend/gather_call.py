"""`GatherCall`: the compressed parameter all-gather (``LocoConfig.param_bits``) of one group.

After the descriptor exchange (every rank must want it compressed), `schedules.gather`: one
encode of this rank's flat input, one all-gather of codes, one decode of every rank's codes
into the output. No error feedback: parameters are not accumulated.
"""

from __future__ import annotations

from typing import Any

import torch

from lowbitcc import schedules, state
from lowbitcc.backend.call_agreement import CorruptFrameError
from lowbitcc.backend.compressed_call import CallGroup
from lowbitcc.backend.issue_queue import Job
from lowbitcc.backend.works import callback_parent
from lowbitcc.codec import wire
from lowbitcc.codec.shard_codec import ShardCodec
from lowbitcc.collectives import COLLECTIVES
from lowbitcc.compressor import CallCompressor, Source


class GatherCall:
    """An all-gather of flat ``source`` (``m`` elements per rank) into ``output`` (``size *
    m`` elements, same dtype) as ``config.param_bits``-bit codes (`LocoConfig.param_bits`;
    `schedules.gather`). No error feedback (parameters are not accumulated) and nearest
    rounding, so ``output`` is bitwise the same on every rank, its own slot included;
    ``source`` is not modified. Ranks exchange descriptors first (``config.check``) and gather
    exact unless every rank would compress (``wants``: this rank's policy allows it;
    ``exact``: the fallback)."""

    collective = "all_gather"

    def __init__(self, group: CallGroup, output: torch.Tensor, source: torch.Tensor,
                 exact: Job, wants: bool) -> None:
        cfg = group.config
        self.group, self.output, self.source, self.exact = group, output, source, exact
        self.route = group.route(source.device)
        self.desc = wire.CallDescriptor(
            collective=self.collective, dtype=source.dtype, op=0, numel=source.numel(),
            seq=group.agreement.next_seq(), bits=cfg.param_bits,
            group_size=cfg.group_for("int"), compressed=wants, parent=callback_parent())

    def __call__(self) -> Any:
        group = self.group
        try:
            agreed = not group.config.check or group.agreement.agree(self.desc).compressed
        except CorruptFrameError as exc:
            return group.agreement.then_raise(exc, self.exact)
        if not agreed:
            return self.exact()
        self.compress()
        return None

    def compress(self) -> None:
        group, cfg, source, output = self.group, self.group.config, self.source, self.output
        n, numel, itemsize = group.size, source.numel(), source.element_size()
        state.STATS.add_call("compressed", numel * itemsize,
                             COLLECTIVES[self.collective].logical_bytes(n * numel * itemsize, n))
        codec = ShardCodec(
            bits=cfg.param_bits, group_size=cfg.group_for("int"),
            dtype_code=wire.DTYPE_CODES[source.dtype], seq=self.desc.seq, world=n,
            signature=wire.call_signature(self.collective, numel, source.dtype),
            kernels=self.route.kernels, checksum=cfg.checksum_for(source.device.type))
        # no feedback, and no residual sums: the statistics' error is the gradients'
        comp = CallCompressor(codec, state.FEEDBACK, "", state.STATS, error_dtype=None, beta=0.0,
                              reset_interval=0, rank=group.rank, count_sums=False)
        out = output.view(-1) if output.is_contiguous() else torch.empty_like(output).view(-1)
        flat = source.detach().reshape(-1).contiguous()
        schedules.all_gather(Source(flat, 1, numel), out, comp, self.route.links)
        comp.finish()  # no error states: the codec time counted
        comp.raise_deferred()
        if out.data_ptr() != output.data_ptr():
            output.copy_(out.view(output.shape))
