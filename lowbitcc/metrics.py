"""`StepMetrics`: `lowbitcc.stats()` as per-step scalars for loggers (TensorBoard, Lightning,
Hugging Face, wandb).

``collect()`` returns what changed since its previous call (or since the object was made) as a
flat ``{name: float}`` dict, names prefixed ``"loco/"``:

- ``compressed_calls``, ``exact_calls``: calls issued by this process's "loco" groups;
  ``cost_model_exact_calls``: eligible calls the cost model sent exact;
- ``logical_mib``, ``wire_mib``: what an fp32 ring would have sent and what was sent (this rank,
  every call), and ``compression``: wire over logical (1.0 where nothing was sent);
- ``relative_error``: ``sqrt(sum residual^2 / sum input^2)`` of the compressed calls (the codec's
  error on the error-compensated inputs; 0 without compressed calls);
- ``codec_ms``, ``wire_ms``: time in the codec and waiting for the wire.

Log it once per optimizer step, on any rank (the numbers are this rank's); after
`lowbitcc.reset_stats` it counts from the reset. Not thread-safe: one object per logging
thread.
"""

from __future__ import annotations

import math
from typing import Any

from lowbitcc import state

MIB = float(1 << 20)


class StepMetrics:
    """Per-step changes of `lowbitcc.stats()` (module docstring); ``prefix`` starts every name."""

    def __init__(self, prefix: str = "loco/") -> None:
        self.prefix = prefix
        self._last = state.STATS.snapshot()

    def collect(self) -> dict[str, float]:
        now = state.STATS.snapshot()
        if now["total"]["calls"] < self._last["total"]["calls"]:  # reset_stats() in between
            self._last = {part: {} for part in now}
        comp = _delta(now["compressed"], self._last["compressed"])
        exact = _delta(now["exact"], self._last["exact"])
        total = _delta(now["total"], self._last["total"])
        self._last = now
        p = self.prefix
        return {
            f"{p}compressed_calls": comp["calls"],
            f"{p}exact_calls": exact["calls"],
            f"{p}cost_model_exact_calls": exact["model_exact"],
            f"{p}logical_mib": total["logical_bytes"] / MIB,
            f"{p}wire_mib": total["wire_bytes"] / MIB,
            f"{p}compression": (total["wire_bytes"] / total["logical_bytes"]
                                if total["logical_bytes"] else 1.0),
            f"{p}relative_error": (math.sqrt(comp["residual_sq"] / comp["input_sq"])
                                   if comp["input_sq"] > 0 else 0.0),
            f"{p}codec_ms": 1e3 * total["codec_s"],
            f"{p}wire_ms": 1e3 * total["wire_s"],
        }


def _delta(now: dict[str, Any], before: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) - float(before.get(k, 0.0)) for k, v in now.items()
            if isinstance(v, int | float)}
