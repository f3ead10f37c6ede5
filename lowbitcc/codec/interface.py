"""The interface of the codec's kernels: `EncodeArgs` (one encode) and `Kernels` (what an
implementation offers). The implementations are `kernels.ReferenceKernels`, `cpu.CpuKernels` and
`cuda.CudaKernels`; `kernels.select` picks one."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from lowbitcc.codec import wire
from lowbitcc.codec.abi import ERROR_MODES, FORMAT_CODES
from lowbitcc.codec.error_state import ErrorState

Flag = bool | torch.Tensor
"""A yes/no answer: a bool on the host, or a 0-dim bool tensor where reading it would
synchronise with a GPU."""


@dataclasses.dataclass(slots=True)
class CallCount:
    """A call place's counter on the device and what one call's launches do with it (kernels
    with ``counts_calls``; `lowbitcc.backend.call_plan` keeps one per place on CUDA).
    ``word``: int32 ``[2]`` on the device, zero when made (uint32 words: the call number the
    place's next replayed graph uses, and a count of finished blocks that the launches leave
    at zero). ``read``: the launches take the call number of the headers they write and
    expect from ``word[0]`` instead of the header's (a graph replayed with the arguments of
    its capture), and the call's last launch, its decode into the output, adds ``value`` (the
    place's stride between two of its calls) to it once read; else that launch writes
    ``value`` there (the place's next call number), or nothing where ``value`` is None. The
    launches read it when they are issued (their arguments are packed then): the keeper may
    set ``value`` anew for its next call."""

    word: torch.Tensor
    read: bool
    value: int | None
    frame: torch.Tensor | None = None
    """The place's own accumulator of its encodes' frames (int64, at least the rows of its
    largest encode and one, zero between launches), used instead of the stream's
    (`stream_words.StreamWords`): a replayed graph runs on another stream than it was captured on."""
    addresses: torch.Tensor | None = None
    """Where ``read``: the place's int64 ``[2]`` device word of the call's source and output
    addresses, from which the encode reads its source and the call's last launch (its decode
    into the output) writes its output instead of the launch's arguments (a graph replayed on
    tensors elsewhere than its capture's); None: the arguments' own."""


def unfused(count: CallCount | None, what: str) -> None:
    """Refuse a ``count`` that reads the call number on the device where a call takes a path
    (``what``) whose launches cannot read it: a graph's replay would write and expect its
    capture's call number."""
    if count is not None and count.read:
        raise ValueError(f"lowbitcc: this call's {what} cannot take its call number from the "
                         "device (a replayed graph needs the fused launches)")


@dataclasses.dataclass(frozen=True)
class FrameSpec:
    """What `Kernels.frame` would be given after an encode, for kernels that frame in the
    encode itself (``fuses_frame``; the call's ``verdict``, checksums off): the call's
    ``header``, the rows' ``shards``, the bytes ``used`` and the ``flags``."""

    header: bytes
    shards: list[int]
    used: int
    flags: int
    verdict: torch.Tensor
    count: CallCount | None = None
    """The call's counter, read where ``count.read`` (kernels with ``counts_calls``)."""


@dataclasses.dataclass(frozen=True)
class SumSpec:
    """The one row an encode encodes where it is the fp32 sum in row order of received
    ``messages`` (uint8 ``[k, P]`` of one shard, rows contiguous at any distance), for kernels
    that decode them inside the encode (``fuses_sum``): the rows are checked as a decode
    given ``check`` checks them (the call's header and the rows' shards) against the call's
    ``verdict``, and every value is NaN where one is foreign, as `Kernels.decode_sum` writes it."""

    messages: torch.Tensor
    check: tuple[bytes, list[int]]
    verdict: torch.Tensor
    count: CallCount | None = None
    """As `FrameSpec.count` (never this launch's last)."""


@dataclasses.dataclass
class EncodeArgs:
    """One encode of ``rows`` rows of ``m`` elements of flat ``source`` (see ``loco::EncodeArgs``).

    Buffers and who writes them: ``messages`` ``uint8 [rows, P]``, whose bytes from
    ``wire.HEADER_BYTES`` to ``wire.used_bytes`` the kernels write (the header and the padding
    are the caller's); ``state`` (None: feedback off) is read and then updated in place, and
    ``has_error`` says whether it holds an error to apply (False: it starts at zero);
    ``nonfinite`` ``uint8 [rows * ng]``: every byte written, 1 where the group is not finite;
    the encode adds its residual^2 and input^2 into ``sums`` ``float64 [2]`` (a call's
    encodes, or every call's, may share one). All tensors are contiguous and on the source's device.
    """

    source: torch.Tensor
    rows: int
    m: int
    factor: float
    messages: torch.Tensor
    state: ErrorState | None
    has_error: bool
    beta: float
    bits: int
    group_size: int
    keys: tuple[int, int] | None
    nonfinite: torch.Tensor
    sums: torch.Tensor
    threads: int = 1
    fmt: str = "int"
    """The code format (`wire.FORMATS`)."""
    clear: torch.Tensor | None = None
    """A call's verdict (`framing.new_verdict` with ``cleared_by_encode``) that this encode
    zeroes before anything else of the call writes it; None: nothing to clear."""
    frame: FrameSpec | None = None
    """Kernels with ``fuses_frame`` only: the encode also frames the messages as ``frame``
    would (its answer in the verdict's non-finite byte); None: the caller frames them."""
    summed: SumSpec | None = None
    """Kernels with ``fuses_sum`` only: the one row (``rows`` 1, ``factor`` 1, ``m`` > 0) is
    ``summed``'s sum, decoded as the encode reads it; ``source`` (fp32 ``[m]``) is not read."""

    def __post_init__(self) -> None:
        """What the kernels read besides the fields, made once (a C++ encode reads each as an
        attribute: a property would cost a Python call per read): ``format_code``
        (`FORMAT_CODES`), ``mode`` (`ERROR_MODES` of the state's storage), ``stochastic``, and
        the random stream's keys ``k0`` and ``k1`` (0 without)."""
        keys = self.keys
        self.format_code = FORMAT_CODES[self.fmt]
        self.mode = ERROR_MODES[None if self.state is None else self.state.dtype]
        self.stochastic = keys is not None
        self.k0, self.k1 = (0, 0) if keys is None else keys

    @property
    def ng(self) -> int:
        return wire.ngroups(self.m, self.group_size)

    def _state_part(self, dtype: str | tuple[str, ...], part: str) -> torch.Tensor | None:
        dtypes = (dtype,) if isinstance(dtype, str) else dtype
        if self.state is None or self.state.dtype not in dtypes:
            return None
        return getattr(self.state, part)

    @property
    def error_codes(self) -> torch.Tensor | None:
        """int8 storage: the codes (else None)."""
        return self._state_part("int8", "data")

    @property
    def error_scales(self) -> torch.Tensor | None:
        """int8 storage: the fp32 scale of each group (else None)."""
        return self._state_part("int8", "scales")

    @property
    def error_values(self) -> torch.Tensor | None:
        """fp32 or bf16 storage: the values (else None)."""
        return self._state_part(("fp32", "bf16"), "data")


class Kernels(Protocol):
    """One implementation of the codec's arithmetic (see the module docstring).

    ``writes_every_byte``: encode writes every payload byte (else the caller zeroes messages).
    ``reads_poison``: encode honours a state's ``ErrorState.poison`` word on the device (else
    the caller settles the state first). ``fuses_frame``: encode takes ``EncodeArgs.frame``.
    ``frame`` completes the messages an encode wrote (uint8 ``[rows, P]``, contiguous; the
    encode wrote bytes ``wire.HEADER_BYTES`` to ``used``): row ``r``'s header is ``header``
    (`wire.ShardHeader.pack`, shard 0 and flags 0) with shard ``shards[r]`` and flags ``flags``,
    plus `wire.FLAG_NONFINITE` where any of the row's bytes of ``nonfinite`` (uint8
    ``[rows * ng]``, from the encode) is set; bytes ``used`` to ``P - 8`` become zeros and the
    last 8 the checksum (zeros without ``checksum``); it returns whether any row is non-finite
    (a bool, or a 0-dim bool tensor on the device). ``verify`` says whether received messages
    (sizes already checked) belong to the call whose header is ``header``, row ``r`` to shard
    ``shards[r]``: -1 where a header differs outside its flags, carries a flag other than
    `wire.FLAG_NONFINITE` or (``checksum``) fails its checksum; else 1 if any row is flagged
    non-finite, 0 if none (a host synchronisation on a GPU). ``check`` is ``verify`` without
    a synchronisation: ``(nonfinite, foreign)``, 0-dim bool tensors on the messages' device,
    whether a row is flagged non-finite and whether one is not the call's (a header differs
    outside the non-finite flag, or a checksum). Given a call's ``verdict``
    (`framing.new_verdict`), ``frame`` and ``check`` set its bytes instead (never clear them)
    and return views of it: what the call's messages showed so far.
    Decoders read messages of ``bits``-bit codes in format ``fmt`` in groups of ``group_size``;
    each row contiguous, rows at any distance (a column of gathered messages).
    ``decode_sum`` writes into ``out`` fp32 ``[m]`` the sum in row order of ``messages``
    ``uint8 [k, P]``; ``decode_into`` writes row ``r`` of the messages, cast to ``out``'s dtype,
    to ``out[r*m ...]`` (``out`` flat, at most ``k * m`` elements). Sizes are already validated.
    Given a call's ``verdict`` (on a device, after ``check``), both write NaN instead where its
    foreign byte is set (read on the device). Kernels with ``fuses_check`` also take
    ``check=(header, shards)`` (with the call's verdict, checksums off): the decode then does
    ``check``'s work itself, without a ``check`` before it.
    Kernels with ``fuses_rows`` also decode every row of gathered messages at once
    (``decode_rows``: `shard_codec.ShardCodec.decode_rows`), checking every row themselves.
    Kernels with ``fuses_sum`` encode the sum of received messages without writing it
    (`EncodeArgs.summed`): one pass instead of ``decode_sum`` and an encode, the same bytes.
    ``checksum`` returns int64 ``[k]`` on the messages' device: each row's checksum as
    `reference.checksum` defines it (without a host synchronisation on CUDA).
    """

    name: str
    writes_every_byte: bool
    reads_poison: bool

    def encode(self, args: EncodeArgs) -> None: ...

    def decode_sum(self, messages: torch.Tensor, m: int, bits: int, group_size: int, fmt: str,
                   out: torch.Tensor, verdict: torch.Tensor | None = None) -> None: ...

    def decode_into(self, messages: torch.Tensor, m: int, bits: int, group_size: int, fmt: str,
                    out: torch.Tensor, verdict: torch.Tensor | None = None) -> None: ...

    def checksum(self, messages: torch.Tensor) -> torch.Tensor: ...

    def frame(self, messages: torch.Tensor, header: bytes, shards: list[int],
              nonfinite: torch.Tensor, used: int, flags: int, checksum: bool,
              verdict: torch.Tensor | None = None) -> Flag: ...

    def verify(self, messages: torch.Tensor, header: bytes, shards: list[int],
               checksum: bool) -> int: ...

    def check(self, messages: torch.Tensor, header: bytes, shards: list[int],
              checksum: bool, verdict: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]: ...
