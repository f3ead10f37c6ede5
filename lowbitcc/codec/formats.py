"""The code formats of compressed payloads, one record each: what every layer reads of them.

A `Format` says which code widths it takes (``bits``), how many bytes a group's scale takes on
the wire (``scale_bytes``), its group size when ``LOCO_GROUP_SIZE`` is 0 (``default_group``),
whether that is the only one it takes (``fixed_group``), how many groups share a second-level
block byte (``block``, 0: none) and the roundings it allows. The table's order is ``loco::Format``'s in
``csrc/loco_codec.cuh`` (`abi` checks it), and the header's code byte carries the position
(`wire.width_byte`). `auto` is ``LOCO_FORMAT=auto``'s rule. The arithmetic of each format is the
reference's (`reference.quantize`), the C++ kernels' and the CUDA kernels'; adding a format is
a row here and its arithmetic in those three (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Format:
    """One code format (see the module docstring)."""

    name: str
    bits: tuple[int, ...]
    scale_bytes: int
    default_group: int
    roundings: tuple[str, ...]
    summary: str
    fixed_group: bool = False
    block: int = 0

    @property
    def bits_per_element(self) -> float:
        """Wire bits per element of its (default) groups, scales included, 4-bit codes for a
        format of several widths taken at its narrowest above 2."""
        bits = 4 if 4 in self.bits else self.bits[0]
        block = 8 / (self.block * self.default_group) if self.block else 0.0
        return bits + 8 * self.scale_bytes / self.default_group + block


TABLE = (
    Format("int", (2, 4, 8), 4, 128, ("nearest", "stochastic"),
           "symmetric integer codes, one fp32 scale per group"),
    Format("mxfp4", (4,), 1, 32, ("nearest",),
           "FP4 E2M1 codes, one power-of-two E8M0 scale byte per group"),
    Format("nvfp4", (4,), 1, 16, ("nearest",),
           "FP4 E2M1 codes, one FP8 E4M3 scale byte per group of 16 under one power-of-two E8M0 "
           "byte per 16 groups", fixed_group=True, block=16),
)
FORMATS: dict[str, Format] = {f.name: f for f in TABLE}
"""The formats by name, in ``loco::Format`` order."""
NAMES = tuple(FORMATS)
WIRES = tuple((bits, f.name) for f in TABLE for bits in f.bits)
"""Every (bits, format) pair a payload can have: what the kernels are instantiated for."""


def auto(bits: int, rounding: str) -> str:
    """``LOCO_FORMAT=auto``: MXFP4 at 4 bits with nearest rounding, else integer codes."""
    mxfp4 = FORMATS["mxfp4"]
    return "mxfp4" if bits in mxfp4.bits and rounding in mxfp4.roundings else "int"
