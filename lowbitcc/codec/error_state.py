"""`ErrorState`: the stored LoCo error of one key, in the layout the codec kernels read.

``numel`` elements (a multiple of the group size ``G``), stored as

- ``int8``: ``data`` int8 codes and ``scales`` fp32, one per group (the codec's 8-bit quantizer);
- ``bf16`` / ``fp32``: ``data`` in that dtype, ``scales`` None.

Every implementation of the codec (`kernels`) updates ``data`` and ``scales`` in place. A
device state may carry a ``poison`` word: the verdict of the call that wrote it, non-zero where
that call saw a non-finite value or a foreign message, which voids the state. The CUDA encode
reads the word (a void state counts as zero, with no kernel to clear it); an encode that cannot
settles the state first on the call's stream (`ErrorState.settle`); the other readers (`decode`,
copies) mask what they return and leave the stored state and its word as they are.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lowbitcc.codec import reference
from lowbitcc.codec.abi import ERROR_STORAGES

STORAGE = {"int8": torch.int8, "bf16": torch.bfloat16, "fp32": torch.float32}
assert set(STORAGE) == set(ERROR_STORAGES), "one torch dtype per loco::ErrorMode storage"


@dataclasses.dataclass
class ErrorState:
    dtype: str
    data: torch.Tensor
    scales: torch.Tensor | None
    group_size: int
    poison: torch.Tensor | None = dataclasses.field(default=None, compare=False, repr=False)
    """None, or a device word (uint8 ``[8]``, a call's verdict) whose non-zero value voids
    ``data`` and ``scales`` (the module docstring)."""
    run_verdict: Any = dataclasses.field(default=None, compare=False, repr=False)
    """None, or the verdict of the CPU run that stored the state before its last decodes (a
    plan's C++ core does: ``RunVerdict``, ``backend/csrc/feedback_slots.h``): its ``dropped()``
    waits until that run is done and says whether it then met a non-finite value or a foreign
    message or a failed transfer, which drops the state at its store's next
    `feedback.FeedbackStore.take`, as if it had not been stored (`feedback._void`)."""

    def settle(self) -> None:
        """Apply ``poison`` to this state on the device (zero it where the word is set; no host
        wait) and drop the word: for an encode that does not read it, on the call's stream."""
        if self.poison is None:
            return
        self.data, self.scales = self._masked(self.data, self.scales, inplace=True)
        self.poison = None

    def _masked(self, data: torch.Tensor, scales: torch.Tensor | None,
                inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``data`` and ``scales`` (this state's, or copies of them) zeroed where ``poison`` is
        set; themselves without a word."""
        if self.poison is None:
            return data, scales
        bad = self.poison.view(torch.int64)[0].to(data.device) != 0
        fill = torch.Tensor.masked_fill_ if inplace else torch.Tensor.masked_fill
        return fill(data, bad, 0), None if scales is None else fill(scales, bad, 0)

    @property
    def numel(self) -> int:
        return self.data.numel()

    def problem(self) -> str | None:
        """What makes this state unusable by the codec kernels (which read ``data`` and
        ``scales`` without bounds checks), or None: a storage the kernels know, ``data`` a
        contiguous 1-D tensor of that storage's dtype whose length is a multiple of a positive
        ``group_size``, fp32 ``scales`` of one finite non-negative value per group for int8
        (none otherwise), finite values."""
        if self.dtype not in STORAGE:
            return f"storage {self.dtype!r} is not one of {', '.join(STORAGE)}"
        if not isinstance(self.group_size, int) or self.group_size <= 0:
            return f"group size {self.group_size!r} is not a positive int"
        data = self.data
        if not isinstance(data, torch.Tensor) or data.dtype != STORAGE[self.dtype]:
            return f"data is not a {STORAGE[self.dtype]} tensor"
        if data.dim() != 1 or not data.is_contiguous() or data.numel() % self.group_size:
            return (f"data of shape {tuple(data.shape)} is not a contiguous 1-D tensor of whole "
                    f"groups of {self.group_size}")
        if self.dtype != "int8":
            if self.scales is not None:
                return f"{self.dtype} storage has scales"
            return None if bool(torch.isfinite(data).all()) else "data is not finite"
        scales = self.scales
        groups = data.numel() // self.group_size
        if (not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32
                or scales.shape != (groups,) or not scales.is_contiguous()
                or scales.device != data.device):
            return f"int8 storage needs {groups} contiguous fp32 scales beside its data"
        if not bool((torch.isfinite(scales) & (scales >= 0)).all()):
            return "scales are not finite and non-negative"
        return None

    def decode(self) -> torch.Tensor:
        """The error as a flat fp32 tensor (zeros where ``poison`` voids it)."""
        if self.dtype == "int8":
            groups = self.data.view(-1, self.group_size)
            values = reference.dequantize(groups, self.scales).reshape(-1)
        else:
            values = self.data.to(torch.float32)
        return self._masked(values, None)[0]

    @classmethod
    def encode(cls, e: torch.Tensor, dtype: str, group_size: int) -> ErrorState:
        """Store flat fp32 ``e`` as ``dtype``."""
        if dtype == "int8":
            codes, scales = reference.quantize(e.reshape(-1, group_size), 8)
            return cls(dtype, codes.reshape(-1), scales, group_size)
        return cls(dtype, e.reshape(-1).to(STORAGE[dtype]).clone(), None, group_size)

    @classmethod
    def zeros(cls, numel: int, dtype: str, group_size: int,
              device: torch.device | str = "cpu") -> ErrorState:
        scales = torch.zeros(numel // group_size, device=device) if dtype == "int8" else None
        return cls(dtype, torch.zeros(numel, dtype=STORAGE[dtype], device=device), scales,
                   group_size)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device: torch.device | str, copy: bool = False) -> ErrorState:
        """This state on ``device`` (itself when it is there already, unless ``copy``)."""
        device = torch.device(device)
        if self.device == device and not copy:
            return self
        scales = None if self.scales is None else self.scales.to(device, copy=True)
        data, scales = self._masked(self.data.to(device, copy=True), scales, inplace=True)
        return ErrorState(self.dtype, data, scales, self.group_size)

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Mark this (CUDA) state's tensors as used by the work queued on ``stream`` so far: the
        caching allocator keeps their memory from other streams' allocations until that work is
        done, whenever the host drops the state (a feedback store evicting or replacing it)."""
        self.data.record_stream(stream)
        if self.scales is not None:
            self.scales.record_stream(stream)
        if self.poison is not None:
            self.poison.record_stream(stream)

    def clone(self) -> ErrorState:
        """A copy without a poison word (zeros where this state's voids it)."""
        data, scales = self._masked(self.data.clone(),
                                    None if self.scales is None else self.scales.clone(),
                                    inplace=True)
        return ErrorState(self.dtype, data, scales, self.group_size)
