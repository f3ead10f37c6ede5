"""`Buffers`: the reusable buffers of a call's compressor, kept by name.

A compressed call's schedule encodes into messages, receives messages and decodes into fp32
rows (`lowbitcc.compressor.CallCompressor`). Where the same call runs again and again (a call
place's plan, `lowbitcc.backend.call_plan.CallPlan`) every one of those buffers is kept and
the steady call allocates nothing; a group's worker keeps only its decode buffer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lowbitcc.codec import wire
from lowbitcc.codec.shard_codec import ShardCodec


class Buffers:
    """Reusable buffers by name, each grown to the largest request and kept; a request returns
    a view of its first elements, valid until the next request of the same name.

    Two owners, each using its buffers for one call at a time:

    - a group's worker thread (``keeps_messages`` False): one fp32 decode buffer per device
      (`CallCompressor.scratch`), shared by its calls; a fresh tensor above glibc's mmap
      threshold (32 MiB) page-faults on every call;
    - a call place's plan (`lowbitcc.backend.call_plan.CallPlan`, ``keeps_messages``): also
      each stage's messages and non-finite bytes (`messages`) and what each transfer receives
      into (`received`), the same tensors for every run of the place (a replayed CUDA graph
      reads them at their addresses). A run's transfers and decodes of a buffer end before the
      next run writes it: the worker and inline runs wait for them; on CUDA the runs of a place
      are ordered on the issuer's stream, and ``on_use(buffer)`` marks a buffer used by the
      current stream at every request (so that the caching allocator hands it on only after
      every stream that used it, once the plan is gone).
    """

    def __init__(self, keeps_messages: bool = False,
                 on_use: Callable[[torch.Tensor], None] | None = None) -> None:
        self.keeps_messages = keeps_messages
        self._on_use = on_use
        self._kept: dict[tuple, torch.Tensor] = {}
        self._pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # `messages`' by stage

    def get(self, name: str, numel: int, dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
        """``dtype [numel]`` on ``device``: the first ``numel`` elements of the buffer ``name``
        (made, or grown, by this request where it is missing or smaller)."""
        key = (name, dtype, device)
        buffer = self._kept.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._kept[key] = torch.empty(numel, dtype=dtype, device=device)
        if self._on_use is not None:
            self._on_use(buffer)
        return buffer if buffer.numel() == numel else buffer[:numel]

    def fp32(self, n: int, device: torch.device) -> torch.Tensor:
        """The fp32 decode buffer ``[n]`` (`CallCompressor.scratch`)."""
        return self.get("decoded", n, torch.float32, device)

    def messages(self, stage: str, rows: int, m: int, codec: ShardCodec,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where messages are kept: ``stage``'s messages ``uint8 [rows, P]`` and non-finite
        bytes ``uint8 [rows * groups]`` (`ShardCodec.encode`'s ``out`` and ``nonfinite``),
        made by the first request of ``stage``; else None (each encode makes its own)."""
        if not self.keeps_messages:
            return None
        pair = self._pairs.get(stage)
        if pair is None or pair[0].shape[0] != rows:
            size = codec.message_bytes(m)
            pair = self._pairs[stage] = (
                self.get(f"sent {stage}", rows * size, torch.uint8, device).view(rows, size),
                self.get(f"flags {stage}", rows * wire.ngroups(m, codec.group_size),
                         torch.uint8, device))
        elif self._on_use is not None:
            self._on_use(pair[0])
            self._on_use(pair[1])
        return pair

    def received(self, name: str, numel: int, device: torch.device) -> torch.Tensor | None:
        """Where messages are kept: the uint8 ``[numel]`` buffer transfer ``name`` receives
        into; else None (the transport makes one)."""
        if not self.keeps_messages:
            return None
        return self.get(f"received {name}", numel, torch.uint8, device)

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer kept."""
        return list(self._kept.values())
