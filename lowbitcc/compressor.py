"""`CallCompressor`: what a schedule needs to compress one call, bound to that call.

A schedule sees only three operations, each on shard matrices (see `kernels.codec`):
``encode(stage, x, shard_ids)`` compensates ``x`` with the error state of ``(key, stage)``,
quantizes and frames it, and stores the new error; ``decode`` and ``decode_sum`` validate and
decode received messages. Error state, statistics and the codec stay out of the schedule.
"""

from __future__ import annotations

import time

import torch

from lowbitcc.config import LocoConfig
from lowbitcc.feedback import FeedbackStore
from lowbitcc.kernels.codec import ShardCodec
from lowbitcc.counters import Stats


class CallCompressor:
    """Codec + error feedback + statistics for the call keyed ``key``."""

    def __init__(
        self, codec: ShardCodec, config: LocoConfig, store: FeedbackStore, key: str, stats: Stats
    ) -> None:
        self.codec = codec
        self.config = config
        self.store = store
        self.key = key
        self.stats = stats
        self.saw_nonfinite = False
        self._stages: list[str] = []

    def encode(self, stage: str, x: torch.Tensor, shard_ids: list[int]) -> torch.Tensor:
        """Messages ``uint8 [k, P]`` for the ``k`` rows of fp32 ``x`` ``[k, m]``."""
        start = time.perf_counter()
        key = f"{self.key}|{stage}"
        self._stages.append(key)
        shape = (x.shape[0], self.codec.padded(x.shape[1]))
        cfg = self.config
        error = self.store.load(key, shape, cfg.reset_interval) if cfg.feedback else None
        result = self.codec.encode(x, error, cfg.beta, shard_ids, feedback=cfg.feedback)
        nonfinite = bool(result.nonfinite.any())
        self.saw_nonfinite |= nonfinite
        if cfg.feedback:
            self.store.store(key, result.new_error, nonfinite, cfg.error_dtype, cfg.group_size)
        self.stats.add(
            "compressed", codec_s=time.perf_counter() - start,
            residual_sq=result.residual_sq, input_sq=result.input_sq,
        )
        return result.messages

    def decode(self, messages: torch.Tensor, m: int, shard_ids: list[int]) -> torch.Tensor:
        start = time.perf_counter()
        values = self.codec.decode(messages, m, shard_ids)
        self.stats.add("compressed", codec_s=time.perf_counter() - start)
        return values

    def decode_sum(self, messages: torch.Tensor, m: int, shard: int) -> torch.Tensor:
        start = time.perf_counter()
        total = self.codec.decode_sum(messages, m, shard)
        self.stats.add("compressed", codec_s=time.perf_counter() - start)
        return total

    def finish(self, output_nonfinite: bool) -> None:
        """Drop every stage's error state of this call if anything in it was non-finite."""
        if output_nonfinite or self.saw_nonfinite:
            for key in self._stages:
                self.store.drop(key)
