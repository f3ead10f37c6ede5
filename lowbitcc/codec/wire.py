"""The wire format of compressed messages, and of the call descriptor exchanged before them.

A compressed *shard message* carries ``numel`` elements of one shard, quantized in groups of
``G`` (the last group zero-padded). Layout, little-endian, ``P = payload_bytes(...)`` bytes::

    offset  size           field
    0       32             header (`ShardHeader`)
    32      F              scales (`scale_field_bytes`): fp32 per group for format "int", an
                           E8M0 byte per group for "mxfp4", an E4M3 byte per group and then an
                           E8M0 byte per block of 16 groups for "nvfp4", "nvint3" and "nvfp3"
                           (`reference.scale_field`)
    32+F    ng * G * b / 8 packed codes, element j at bit b * j (see `reference.pack`; 3-bit
                           codes: 6 bytes per group of 16)
    ...     0..7           zero padding to a multiple of 8 bytes
    P - 8   8              checksum of bytes 32 .. P-8 (`checksum`; 0 when checksums are off)

The *checksum* of a message covers its body, bytes 32 to P-8, read as little-endian 64-bit words
``w_i`` (``i`` from 0) and as 32-bit words ``u_j``. With ``K = CHECKSUM_STEP`` and
``y_i = w_i + (i + 1) * K mod 2**64``::

    N = sum_i lo32(y_i) * hi32(y_i)  mod 2**64     (a keyed product sum, NH-style)
    S = sum_j u_j                     mod 2**32
    checksum = S + 2**32 * (lo32(N) xor hi32(N))

A change within one 32-bit word (any flipped bit or byte) always changes ``S``; other changes
(words that trade places, a 64-bit word altered with ``S`` kept) go unnoticed with probability
about 2**-32. Both are sums of independent terms, vectorized (AVX2: 32 bytes in seven
instructions) and split across threads and devices alike (`reference.checksum`,
``cpu_codec.cpp``); every implementation writes the same 8 bytes.
The header is not covered: its fields are compared one by one with the receiver's own.

A *call descriptor* (`CallDescriptor`, 32 bytes) describes a whole collective call; all ranks
exchange theirs before a compressible call so that mismatched calls fail on every rank.

Decoders compute the expected size of everything from their own arguments and compare it with
what they read; no length read off the wire is trusted.
"""

from __future__ import annotations

import dataclasses
import functools
import struct
import zlib

import torch

from lowbitcc.codec import formats
from lowbitcc.collectives import COLLECTIVES

HEADER_BYTES = 32
SHARD_MAGIC = b"LBCS"
CALL_MAGIC = b"LBCD"
VERSION = 6
"""1: no checksum trailer (padding to 4 bytes); 2: the trailer held a sum of MurmurHash3
finalizers (about 4 GB/s per core, too slow to be on by default); 3: call descriptors of 32
bytes, without ``parent``; 4: descriptors without the flags `DESC_DEVIATED`, `DESC_EXPLORE`
and `DESC_PART` (every call place's schedule entry, exact ones included); 5: the scale field
unpadded (codes at any byte offset) and messages padded to 8 bytes."""
CODES_ALIGN = 16
"""A shard message's codes start at a multiple of this (`codes_offset`: the scale field is
padded with zeros to it), and its size is one (`payload_bytes`), so in a buffer of messages
every row's codes are as aligned as the buffer (``loco::kCodesAlign``)."""

FLAG_NONFINITE = 1
FLAG_PEER_ERROR = 2
"""The sender received a corrupt or foreign message earlier in this call: its result, and so
this message's values, are incomplete (see `lowbitcc.compressor.CallCompressor`)."""
FLAG_DEVIATED = 4
"""The sender's call is not the one the ranks agreed on at this point of their schedule
(`lowbitcc.backend.call_schedule`): the message has the agreed call's size and carries no
values, and its header's ``signature`` is `call_signature` of the sender's own call."""

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
DTYPE_NAMES = {0: "float32", 1: "bfloat16", 2: "float16"}
DESCRIPTOR_DTYPES = (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
    torch.uint16, torch.uint32, torch.uint64,
)
"""The dtypes a call descriptor names, by code (its index; 255: any other dtype). The codec's
`DTYPE_CODES` are the first codes."""


class WireFormatError(RuntimeError):
    """A received message is truncated, corrupt or belongs to another call."""


class DeviatedCallError(WireFormatError):
    """Messages flagged `FLAG_DEVIATED` arrived: their senders issued another call than the
    agreed one. ``signatures[i]``: the `call_signature` of message row ``i``'s sender's call
    (None: the row was the agreed call's)."""

    def __init__(self, message: str, signatures: list[int | None]) -> None:
        super().__init__(message)
        self.signatures = signatures


class PeerWireFormatError(WireFormatError):
    """A received message says its sender hit a `WireFormatError` earlier in the call."""


def ngroups(numel: int, group_size: int) -> int:
    return -(-numel // group_size)


TRAILER_BYTES = 8
"""The checksum at the end of each shard message."""
CHECKSUM_STEP = 0x9E3779B97F4A7C15
"""``K`` of the checksum: word ``i`` is keyed as ``w_i + (i + 1) * K`` (mod 2**64)."""


FORMATS = formats.NAMES
"""The code formats, in ``loco::Format`` order (`lowbitcc.codec.formats`; lowbitcc.codec.abi
checks the header agrees)."""


def scale_bytes_used(ng: int, fmt: str) -> int:
    """Bytes of the scales of a message of ``ng`` groups, before the field's padding
    (``loco::scale_bytes_used``): one scale of `formats.Format.scale_bytes` per group, and for a
    format with blocks (`formats.Format.block`) one byte per block."""
    spec = formats.FORMATS[fmt]
    return spec.scale_bytes * ng + (-(-ng // spec.block) if spec.block else 0)


def scale_field_bytes(ng: int, fmt: str) -> int:
    """Bytes of the scale field of a message of ``ng`` groups (``loco::scale_field_bytes``): its
    scales (`scale_bytes_used`), then zero bytes up to a multiple of `CODES_ALIGN`."""
    return -(-scale_bytes_used(ng, fmt) // CODES_ALIGN) * CODES_ALIGN


def codes_offset(numel: int, group_size: int, fmt: str = "int") -> int:
    """Byte offset of the packed codes in a shard message (the scale field ends there): a
    multiple of `CODES_ALIGN`."""
    return HEADER_BYTES + scale_field_bytes(ngroups(numel, group_size), fmt)


@functools.lru_cache(maxsize=1024)  # every call of a place asks the same
def used_bytes(numel: int, bits: int, group_size: int, fmt: str = "int") -> int:
    """Bytes of one shard message that carry header, scales and codes (before its padding)."""
    ng = ngroups(numel, group_size)
    return codes_offset(numel, group_size, fmt) + ng * group_size * bits // 8


@functools.lru_cache(maxsize=1024)
def payload_bytes(numel: int, bits: int, group_size: int, fmt: str = "int") -> int:
    """Size in bytes of one shard message of ``numel`` elements: `used_bytes` padded to 8, then
    the checksum trailer, the whole padded to a multiple of `CODES_ALIGN` (zeros before the
    trailer)."""
    body = -(-used_bytes(numel, bits, group_size, fmt) // 8) * 8 + TRAILER_BYTES
    return -(-body // CODES_ALIGN) * CODES_ALIGN


def width_byte(bits: int, fmt: str) -> int:
    """The header's code byte: the code width in bits 0..3, the format's ``loco::Format`` value
    in bits 4..7 (so "int" messages keep the bytes of version 2 without formats). The value is
    the format's position in `FORMATS`, which `abi` checks is its ``loco::Format``."""
    return bits | FORMATS.index(fmt) << 4


def split_width_byte(value: int) -> tuple[int, str | None]:
    """Inverse of `width_byte`: ``(bits, format)``, format None when unknown."""
    code = value >> 4
    return value & 0xF, FORMATS[code] if code < len(FORMATS) else None


_SHARD = struct.Struct("<4sBBBBIQIHHI")  # 32 bytes
FLAGS_OFFSET = struct.calcsize("<4sBBB")
"""Byte offset of ``flags`` in a shard header (the one byte an encode writes after the fact)."""
SEQ_OFFSET = struct.calcsize("<4sBBBBIQ")
"""Byte offset of ``seq`` (uint32, little-endian) in a shard header."""
SHARD_OFFSET = struct.calcsize("<4sBBBBIQI")
"""Byte offset of ``shard`` (uint16, little-endian) in a shard header."""
SIGNATURE_OFFSET = struct.calcsize("<4sBBBBIQIHH")
"""Byte offset of ``signature`` (uint32, little-endian) in a shard header."""


@dataclasses.dataclass(frozen=True)
class ShardHeader:
    """Header of one shard message; ``signature`` is `call_signature` of the call."""

    bits: int
    dtype_code: int
    flags: int
    group_size: int
    numel: int
    seq: int
    shard: int
    world: int
    signature: int
    fmt: str | None = "int"
    """The code format (None: a value this build does not know)."""

    def pack(self) -> bytes:
        return _SHARD.pack(
            SHARD_MAGIC, VERSION, width_byte(self.bits, self.fmt), self.dtype_code, self.flags,
            self.group_size, self.numel, self.seq & 0xFFFFFFFF, self.shard, self.world, self.signature,
        )

    @classmethod
    def unpack(cls, raw: bytes) -> ShardHeader:
        if len(raw) < HEADER_BYTES:
            raise WireFormatError(f"shard message of {len(raw)} bytes is shorter than its header")
        magic, version, width, dtype_code, flags, group_size, numel, seq, shard, world, sig = (
            _SHARD.unpack_from(raw)
        )
        bits, fmt = split_width_byte(width)
        if magic != SHARD_MAGIC:
            raise WireFormatError(f"bad magic {magic!r} in shard message (expected {SHARD_MAGIC!r})")
        if version != VERSION:
            raise WireFormatError(f"wire format version {version}, this build speaks {VERSION}")
        return cls(bits, dtype_code, flags, group_size, numel, seq, shard, world, sig, fmt)


def call_signature(collective: str, numel: int, dtype: torch.dtype) -> int:
    """32-bit signature of a call, carried in every shard header of that call."""
    return zlib.crc32(f"{collective}|{numel}|{dtype}".encode())


_CALL = struct.Struct("<4sBBBBQIIIIQ")  # 40 bytes
DESCRIPTOR_BYTES = _CALL.size
DESC_FLAGS_OFFSET = 28
"""Where the flags word starts: the bytes before it are the call itself, compared across ranks
byte for byte (`CallDescriptor.call` where they differ), and so is the ``parent`` after it."""
DESC_PARENT_OFFSET = 32
"""Where ``parent`` starts (8 bytes, to the descriptor's end)."""
COLLECTIVE_CODES = {c.name: c.code for c in COLLECTIVES.values()}
"""The kinds of call a descriptor names (`lowbitcc.collectives`): the reductions (1, 2), the
all-gather (3, compressed or exact) and, under ``check``, the exact data movements (4-9), whose
descriptors carry the root rank in ``group_size`` and 0 in ``bits``; point-to-point calls have
none."""
ROOTED = frozenset(c.name for c in COLLECTIVES.values() if c.rooted)
"""The kinds whose descriptor's ``group_size`` field is the root rank."""
DESC_COMPRESSED = 1
"""Descriptor flag: this rank would compress the call (its policy and the size allow it); the
ranks compress it only if every rank would (and the cost model agrees)."""
DESC_PREFER_EXACT = 2
"""Descriptor flag: this rank's cost model suggests the exact path."""
DESC_FRAMED = 4
"""Descriptor flag: this rank's frame carries its input (`exchange_frame.FRAME_PAYLOAD`). Part of the call:
every rank decides it alike from the call, so ranks that differ issued different calls (e.g.
CPU tensors on one, CUDA tensors on another)."""
DESC_INVALID = 8
"""Descriptor flag: this rank's arguments for the call are invalid. It takes part in the
exchange only so that every rank raises for this call (this rank its own error, the others one
naming it) and the group stays in step; its other fields are a placeholder and are not compared."""
DESC_DEVIATED = 16
"""Descriptor flag, advisory: since its last exchange this rank issued a call that was not the
one its place in the call schedule agreed on, and ran the agreed exact call in its place on a
NaN-filled buffer (`lowbitcc.backend.deviation.ExactDeviation`): every rank raises
`CollectiveMismatchError` in this exchange."""
DESC_EXPLORE = 32
"""Descriptor flag, advisory, with a cost-model suggestion: the suggestion is a warm-up or an
exploration call (`lowbitcc.cost_model`), so the outcome holds for this call only (its place
in the call schedule agrees again at its next run; decided by a place's renewal, the place
runs the other path once and renews at once, `lowbitcc.backend.renewal`)."""
DESC_PART = 64
"""Descriptor flag: the call is one tensor of a call of several (coalesced). Part of the call:
a place in the call schedule keeps an exact entry only for calls of one tensor."""
COLLECTIVE_NAMES = {v: k for k, v in COLLECTIVE_CODES.items()}


@dataclasses.dataclass(frozen=True)
class CallDescriptor:
    """What a rank is about to do; every rank must describe the same call."""

    collective: str
    dtype: torch.dtype
    op: int
    numel: int
    seq: int
    bits: int
    group_size: int
    compressed: bool
    prefer_exact: bool = False
    """Advisory, not part of the call: this rank's cost model suggests the exact path (every
    rank follows rank 0's suggestion; see `lowbitcc.cost_model`)."""
    fmt: str | None = "int"
    """The code format (carried with ``bits`` as `width_byte`; None: unknown to this build)."""
    framed: bool = False
    """The frame carries this rank's input (`DESC_FRAMED`)."""
    invalid: bool = False
    """This rank's arguments are invalid (`DESC_INVALID`)."""
    parent: int = 0
    """The call whose future's callback issued this one (its tag, `issue_queue.callback_parent`;
    0: issued outside such a callback). Part of the call: callbacks of different calls that
    run at once issue their calls in either order, and ranks whose orders differ must not pair
    one bucket's call with another's."""
    deviated: bool = False
    """Advisory: this rank deviated from its call schedule since its last exchange
    (`DESC_DEVIATED`)."""
    explore: bool = False
    """Advisory, with ``prefer_exact`` or a compressed suggestion: the cost model's suggestion
    holds for this call only (`DESC_EXPLORE`)."""
    part: bool = False
    """The call is one tensor of a coalesced call (`DESC_PART`)."""

    def pack(self) -> bytes:
        dtype_code = (DESCRIPTOR_DTYPES.index(self.dtype) if self.dtype in DESCRIPTOR_DTYPES
                      else 255)
        flags = (DESC_COMPRESSED if self.compressed else 0) | (
            DESC_PREFER_EXACT if self.prefer_exact else 0) | (
            DESC_FRAMED if self.framed else 0) | (DESC_INVALID if self.invalid else 0) | (
            DESC_DEVIATED if self.deviated else 0) | (DESC_EXPLORE if self.explore else 0) | (
            DESC_PART if self.part else 0)
        return _CALL.pack(
            CALL_MAGIC, VERSION, COLLECTIVE_CODES[self.collective], dtype_code, self.op,
            self.numel, self.seq & 0xFFFFFFFF, width_byte(self.bits, self.fmt), self.group_size,
            flags, self.parent,
        )

    def call(self) -> CallDescriptor:
        """The call itself, without the advisory fields (what must match across ranks):
        whether this rank would compress it is not compared, the ranks settle it together."""
        return dataclasses.replace(self, compressed=False, prefer_exact=False,
                                   deviated=False, explore=False)

    @classmethod
    def unpack(cls, raw: bytes) -> CallDescriptor:
        magic, version, coll, dtype_code, op, numel, seq, width, group_size, flags, parent = (
            _CALL.unpack_from(raw)
        )
        bits, fmt = split_width_byte(width & 0xFF)
        if magic != CALL_MAGIC or version != VERSION or coll not in COLLECTIVE_NAMES:
            raise WireFormatError("corrupt call descriptor received")
        dtype = DESCRIPTOR_DTYPES[dtype_code] if dtype_code < len(DESCRIPTOR_DTYPES) else None
        return cls(COLLECTIVE_NAMES[coll], dtype, op, numel, seq, bits, group_size,
                   bool(flags & DESC_COMPRESSED), bool(flags & DESC_PREFER_EXACT),
                   fmt if width < 0x100 else None,
                   bool(flags & DESC_FRAMED), bool(flags & DESC_INVALID), parent,
                   bool(flags & DESC_DEVIATED), bool(flags & DESC_EXPLORE),
                   bool(flags & DESC_PART))

    def describe(self) -> str:
        kind = "compressed" if self.compressed else "exact"
        dtype = str(self.dtype).replace("torch.", "") if self.dtype else "another dtype"
        if self.collective not in ("all_reduce", "reduce_scatter") and not self.bits:
            root = f", root={self.group_size}" if self.collective in ROOTED else ""
            op = f", op={self.op}" if self.collective == "reduce" else ""
            return (f"exact {self.collective}(numel={self.numel}, dtype={dtype}{op}{root}) "
                    f"as call #{self.seq}{self._issuer()}")
        return (
            f"{kind} {self.collective}(numel={self.numel}, dtype={dtype}, op={self.op}, "
            f"bits={self.bits}, format={self.fmt}, group_size={self.group_size}"
            f"{', input in frame' if self.framed else ''}"
            f"{', one of several tensors' if self.part else ''}) as call #{self.seq}{self._issuer()}"
        )

    def _issuer(self) -> str:
        return (f", issued by a callback of the call tagged {self.parent:#x}" if self.parent
                else "")
