"""The kernels' shared definitions, read from ``csrc/loco_codec.cuh`` (their only definition).

- `ERROR_MODES`: error-state storage name (None: feedback off) -> ``loco::ErrorMode`` value.
- `FORMAT_CODES`: code format name -> ``loco::Format`` value (the names are
  `wire.FORMATS`, checked here).
- the shard header's layout (``kFlagsOffset``, ``kShardOffset``, ...) equals `wire`'s,
  NVFP4's group and block sizes (``kNvGroup``, ``kNvBlock``) those of every format with blocks
  in the format table, and the element grids of ``loco::grid`` (`grids`) the reference's
  (`two_level.GRIDS`, with each grid's block rule), checked at import;
- `encode_args_dtype()`: a NumPy structured dtype with the byte layout of ``loco::EncodeArgs``
  (host ABI, x86-64 and aarch64 alike, which CUDA's device ABI matches for such structs), so the
  CUDA launcher passes one struct by value, as CuPy does for structured scalars
  (``cupy/examples/custom_struct``). The C++ module exports the offsets g++ gave each field, and
  ``tests/codec/test_abi.py`` compares them with this dtype.

The header keeps these in a fixed shape (one field per line, fixed-width types, ``kError<Name>``
members) so that this reader stays a few lines.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import numpy as np

from lowbitcc.codec import formats, two_level, wire
from lowbitcc.codec.wire import FORMATS

CSRC = Path(__file__).parent / "csrc"
HEADER = CSRC / "loco_codec.cuh"

_C_TYPES = {
    "int8_t": np.int8, "uint8_t": np.uint8, "uint16_t": np.uint16, "int32_t": np.int32,
    "uint32_t": np.uint32, "int64_t": np.int64, "float": np.float32, "double": np.float64,
}


def _block(kind: str, name: str) -> str:
    match = re.search(rf"{kind} {name}\b[^{{]*\{{(.*?)\}};", HEADER.read_text(), re.S)
    if match is None:
        raise RuntimeError(f"lowbitcc: {HEADER} defines no {kind} {name}")
    return re.sub(r"//[^\n]*", "", match.group(1))


@functools.cache
def error_modes() -> dict[str | None, int]:
    modes: dict[str | None, int] = {}
    for member, value in re.findall(r"kError(\w+)\s*=\s*(\d+)", _block("enum", "ErrorMode")):
        modes[None if member == "None" else member.lower()] = int(value)
    return modes


ERROR_MODES = error_modes()
ERROR_STORAGES = tuple(k for k in ERROR_MODES if k is not None)


@functools.cache
def format_codes() -> dict[str, int]:
    return {member.lower(): int(value)
            for member, value in re.findall(r"kFormat(\w+)\s*=\s*(\d+)", _block("enum", "Format"))}


FORMAT_CODES = format_codes()
if tuple(FORMAT_CODES) != FORMATS:
    raise RuntimeError(f"lowbitcc: {HEADER} defines formats {tuple(FORMAT_CODES)}, "
                       f"wire.py {FORMATS}")


def constant(name: str, source: Path = HEADER) -> int:
    """The integer constant ``name`` of ``source`` (``constexpr <type> name = value;``)."""
    match = re.search(rf"constexpr \w+ {name} = (\d+);", source.read_text())
    if match is None:
        raise RuntimeError(f"lowbitcc: {source} defines no constant {name}")
    return int(match.group(1))


_HEADER_FIELDS = {"kHeaderBytes": wire.HEADER_BYTES, "kFlagsOffset": wire.FLAGS_OFFSET,
                  "kShardOffset": wire.SHARD_OFFSET, "kSeqOffset": wire.SEQ_OFFSET,
                  "kFlagNonfinite": wire.FLAG_NONFINITE, "kCodesAlign": wire.CODES_ALIGN}
"""The shard message's layout as the kernels frame and verify messages (its header, and where
its codes start), and wire.py's own."""
if any(constant(name) != value for name, value in _HEADER_FIELDS.items()):
    raise RuntimeError(f"lowbitcc: {HEADER}'s shard header constants differ from wire.py's "
                       f"{_HEADER_FIELDS}")
_NVFP4 = {"kNvGroup": formats.FORMATS["nvfp4"].default_group,
          "kNvBlock": formats.FORMATS["nvfp4"].block}
"""NVFP4's group and block sizes as the kernels lay them out, and the format table's."""
if any(constant(name) != value for name, value in _NVFP4.items()) or any(
        f.block and (f.default_group, f.block) != tuple(_NVFP4.values()) for f in formats.TABLE):
    raise RuntimeError(f"lowbitcc: {HEADER}'s NVFP4 constants differ from formats.py's {_NVFP4}")


@functools.cache
def grids() -> dict[str, tuple[int, int, int, tuple[float, ...]]]:
    """``loco::grid``'s rows, one per line: ``case kFormat<Name>`` (or ``default``, every other
    format's) -> ``(bits, block_exp, block_man, magnitudes)``, keyed "<name>" (or "default")."""
    body = re.search(r"constexpr Grid grid\(int format\) \{(.*?)\n\}", HEADER.read_text(), re.S)
    if body is None:
        raise RuntimeError(f"lowbitcc: {HEADER} defines no loco::grid")
    rows = {}
    for case, bits, exp, man, mags in re.findall(
            r"(case kFormat\w+|default): return Grid\{(\d+), (\d+), (0x[0-9a-f]+)u, \{([^}]*)\}\};",
            body.group(1)):
        magnitudes = tuple(float(v.strip().rstrip("f")) for v in mags.split(","))
        rows[case.removeprefix("case kFormat").lower()] = (int(bits), int(exp), int(man, 16),
                                                           magnitudes)
    return rows


_GRIDS = {name: (g.bits, *g.block_rule, g.magnitudes) for name, g in two_level.GRIDS.items()}
"""The reference's grids (`two_level.GRIDS`) as ``loco::grid`` writes them."""
if any(grids().get(name, grids().get("default")) != row for name, row in _GRIDS.items()) or (
        grids().get("default", (0, 0, 0, ()))[3] != two_level.E2M1):
    raise RuntimeError(f"lowbitcc: {HEADER}'s loco::grid {grids()} differs from "
                       f"two_level.py's {_GRIDS}")


@functools.cache
def encode_args_fields() -> tuple[tuple[str, str], ...]:
    """``(name, C type)`` of each field of ``loco::EncodeArgs``, in order ("ptr" for pointers)."""
    fields = []
    for decl in filter(None, (d.strip() for d in _block("struct", "EncodeArgs").split(";"))):
        match = re.fullmatch(r"(?:const\s+)?(\w+)\s*(\*?)\s*(\w+)", decl)
        if match is None or (not match.group(2) and match.group(1) not in _C_TYPES):
            raise RuntimeError(f"lowbitcc: cannot read EncodeArgs field {decl!r} in {HEADER}")
        ctype, pointer, name = match.groups()
        fields.append((name, "ptr" if pointer else ctype))
    return tuple(fields)


@functools.cache
def encode_args_dtype() -> np.dtype:
    """``loco::EncodeArgs`` as an aligned NumPy structured dtype (pointers as uint64)."""
    return np.dtype([(name, np.uint64 if ctype == "ptr" else _C_TYPES[ctype])
                     for name, ctype in encode_args_fields()], align=True)
