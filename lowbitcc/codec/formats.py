"""The code formats of compressed payloads, one record each: what every layer reads of them.

A `Format` says which code widths it takes (``bits``), how many bytes a group's scale takes on
the wire (``scale_bytes``), its group size when ``LOCO_GROUP_SIZE`` is 0 (``default_group``),
whether that is the only one it takes (``fixed_group``), how many groups share a second-level
block byte (``block``, 0: none), the roundings it allows and whether error feedback is on when
``LOCO_FEEDBACK`` is auto (``feedback``: the wide study's answer, docs/convergence.md). The
table's order is ``loco::Format``'s in ``csrc/loco_codec.cuh`` (`abi` checks it), and the
header's code byte carries the position (`wire.width_byte`). `auto` is ``LOCO_FORMAT=auto``'s
rule. The arithmetic of each format is the reference's (`reference.quantize`), the C++ kernels'
and the CUDA kernels'; adding a format is a row here and its arithmetic in those three
(docs/architecture.md). A format with NVFP4's two-level scales and another grid of magnitudes
("nvint3", "nvfp3") shares NVFP4's arithmetic: its grid is one row of `two_level.GRIDS` and
one of ``loco::grid`` (which `abi` checks agree), and the kernels' dispatch sends its
``loco::Format`` to NVFP4's code, templated on the format.
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
    feedback: bool = True

    @property
    def width(self) -> int:
        """Its code width where one is asked for without a number (benchmarks, bit counts): 4
        for a format of several widths, else its only one."""
        return 4 if 4 in self.bits else self.bits[0]

    @property
    def bits_per_element(self) -> float:
        """Wire bits per element of its (default) groups at its `width`, scales included."""
        return self.wire_bits(self.width)

    def wire_bits(self, width: int, group: int = 0) -> float:
        """Wire bits per element of ``width``-bit codes in groups of ``group`` elements (0: its
        `default_group`), scales included (a block's second-level scale byte too)."""
        group = group or self.default_group
        block = 8 / (self.block * group) if self.block else 0.0
        return width + 8 * self.scale_bytes / group + block


TABLE = (
    Format("int", (2, 4, 8), 4, 128, ("nearest", "stochastic"),
           "symmetric integer codes, one fp32 scale per group"),
    Format("mxfp4", (4,), 1, 32, ("nearest",),
           "FP4 E2M1 codes, one power-of-two E8M0 scale byte per group"),
    Format("nvfp4", (4,), 1, 16, ("nearest",),
           "FP4 E2M1 codes, one FP8 E4M3 scale byte per group of 16 under one power-of-two E8M0 "
           "byte per 16 groups", fixed_group=True, block=16, feedback=False),
    Format("nvint3", (3,), 1, 16, ("nearest",),
           "3-bit integer codes (magnitudes 0..3 and a sign) under NVFP4's two-level scales",
           fixed_group=True, block=16, feedback=False),
    Format("nvfp3", (3,), 1, 16, ("nearest",),
           "FP3 E2M0 codes (magnitudes 0, 1, 2, 4 and a sign) under NVFP4's two-level scales",
           fixed_group=True, block=16, feedback=False),
)
FORMATS: dict[str, Format] = {f.name: f for f in TABLE}
"""The formats by name, in ``loco::Format`` order."""
NAMES = tuple(FORMATS)
WIRES = tuple((bits, f.name) for f in TABLE for bits in f.bits)
"""Every (bits, format) pair a payload can have: what the kernels are instantiated for."""


AUTO = ("nvfp4", "mxfp4", "int")
"""``LOCO_FORMAT=auto``'s preference: the first that takes the bits, rounding and group size
asked for (NVFP4 trained closest to exact in every cell of the wide study, docs/convergence.md;
MXFP4, the default until then, where the group size is not NVFP4's 16). The 3-bit formats are
not among them: no study has chosen between them yet, so 3 bits name their format
(`auto_takes`)."""


def auto_takes(bits: int) -> bool:
    """Whether ``LOCO_FORMAT=auto`` has a format of ``bits``-bit codes (one of `AUTO`)."""
    return any(bits in FORMATS[name].bits for name in AUTO)


def taking(bits: int) -> tuple[str, ...]:
    """The formats whose codes are ``bits`` wide, in table order."""
    return tuple(f.name for f in TABLE if bits in f.bits)


def auto(bits: int, rounding: str, group_size: int = 0) -> str:
    """``LOCO_FORMAT=auto``: the first of `AUTO` whose codes are ``bits`` wide, that allows
    ``rounding`` and takes ``group_size`` (0: the format's own); "int" takes every setting of
    its widths. Raises ValueError naming the formats of ``bits``-bit codes where none of `AUTO`
    has that width (`auto_takes`)."""
    for name in AUTO:
        f = FORMATS[name]
        fits = not f.fixed_group or group_size in (0, f.default_group)
        if bits in f.bits and rounding in f.roundings and fits:
            return name
    named = " or ".join(repr(n) for n in taking(bits)) or "none"
    raise ValueError(f"lowbitcc: format 'auto' takes no {bits}-bit codes; the formats of "
                     f"{bits}-bit codes are {named} (name one with LOCO_FORMAT)")
