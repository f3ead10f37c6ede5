"""The CUDA kernels (``csrc/cuda_codec.cu``), compiled by CuPy's NVRTC and cached.

Used for CUDA tensors when CuPy is installed (``pip install lowbitcc[cuda]``); kernels run on
torch's current CUDA stream. Layouts and arguments are those of the C++ CPU codec (one
``loco::EncodeArgs``, passed by value), and the bytes are the same; `kernels.select` takes the
reference for group sizes above `MAX_GROUP`.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import numpy as np
import torch

from lowbitcc.codec import launch_recording, reference, wire
from lowbitcc.codec.cuda_args import (
    DECODE_SPAN,
    THREADS,
    aligned_stride,
    checksum_blocks,
    frame_args,
    pack_encode_args,
    ptr_arg,
    row_check,
    sum_source,
)
from lowbitcc.codec.cuda_build import (
    CHECK_FOLD,
    CHECKSUM,
    CHECKSUM_FOLD,
    FRAME_BODY,
    FRAME_FOLD,
    HEADER_WORDS,
    NO_FRAME,
    SOURCE,
    decode_into_name,
    decode_rows_name,
    decode_sum_name,
    encode_name,
    encode_sum_name,
    encode_warps,
    name_expressions,
    options,
)
from lowbitcc.codec.framing import (
    VERDICT_FOREIGN,
    VERDICT_NONFINITE,
    TorchFraming,
    check_with_torch,
    frame_with_torch,
    verdict_flag,
)
from lowbitcc.codec.interface import CallCount, EncodeArgs, Flag, unfused
from lowbitcc.codec.stream_words import StreamWords

MAX_GROUP = 256  # at most a warp per group, 8 elements per lane (`segment_lanes`)
ENCODE_BLOCKS = 1024
"""Most blocks an encode launches (its warps loop over the groups): about one full wave on an
H100 (132 SMs x 2048 threads), and the count of atomic adds of the residual sums."""


@functools.cache
def cupy() -> ModuleType | None:
    """CuPy, or None when it is not installed or sees no GPU."""
    try:
        import cupy as cp

        return cp if cp.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:  # noqa: BLE001 (no CuPy or no driver: CUDA tensors use the reference)
        return None


def available() -> bool:
    return cupy() is not None


@functools.cache
def module() -> Any:
    """The CUDA codec as a ``cupy.RawModule`` (every instance of `name_expressions`)."""
    cp = cupy()
    if cp is None:
        raise RuntimeError("lowbitcc: the CUDA codec needs CuPy and a GPU")
    return cp.RawModule(code=SOURCE.read_text(), options=options(),
                        name_expressions=name_expressions())


def _launch(name: str, device: torch.device, grid: int | tuple[int, int], args: tuple) -> None:
    """Launch kernel ``name`` of `module` on ``device``'s current torch stream (CuPy's own
    current stream and device are never used: a launch names both; CuPy loads the module once
    per device). ``grid``: blocks, or (blocks in x, blocks in y)."""
    grid = grid if isinstance(grid, tuple) else (grid,)
    if 0 in grid:
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(index)
    _function(index, name)(grid, (THREADS,), args, stream=_external(stream, index))


def _issue(name: str, device: torch.device, grid: int | tuple[int, int], args: tuple) -> None:
    """`_launch`, or where this thread records (`launch_recording.recording`) the launch
    appended to the record instead, as a `RecordedLaunch`."""
    record = launch_recording.steps()
    if record is None:
        _launch(name, device, grid, args)
    else:
        record.append(RecordedLaunch(name, device, grid, args))


class RecordedLaunch:
    """A launch a record holds (`_issue` while recording): kernel ``name`` on ``device``,
    ``grid`` (blocks, or (x, y)) of `THREADS`, ``args`` (NumPy scalars, as `_launch` takes
    them). Calling it makes the launch again on the then current stream (`_launch`, looked up
    now); a C++ replay (`backend.launch_record`) reads its fields instead."""

    __slots__ = ("name", "device", "grid", "args")

    def __init__(self, name: str, device: torch.device, grid: int | tuple[int, int],
                 args: tuple) -> None:
        self.name, self.device, self.grid, self.args = name, device, grid, args

    def __call__(self) -> None:
        _launch(self.name, self.device, self.grid, self.args)


def function_handle(device: torch.device, name: str) -> int:
    """The ``CUfunction`` of kernel ``name`` on ``device``, as CuPy loaded it (the
    ``RawKernel``'s ``Function`` of the current device, its ``ptr``): what a C++ replay launches
    with the CUDA driver."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with cupy().cuda.Device(index):
        return int(_function(index, name).kernel.ptr)


@functools.cache
def _function(index: int, name: str) -> Any:
    """Kernel ``name`` of `module`, loaded on GPU ``index`` (looked up once per launch site)."""
    with cupy().cuda.Device(index):
        return module().get_function(name)


_EXTERNAL: dict[int, Any] = {}


def _external(stream: torch.cuda.Stream, index: int) -> Any:
    """CuPy's view of torch ``stream`` (made once per stream)."""
    external = _EXTERNAL.get(stream.cuda_stream)
    if external is None:
        cp = cupy()
        if hasattr(cp.cuda.Stream, "from_external"):  # CuPy >= 14 (ExternalStream is deprecated)
            external = cp.cuda.Stream.from_external(stream)
        else:
            external = cp.cuda.ExternalStream(stream.cuda_stream, index)
        _EXTERNAL[stream.cuda_stream] = external
    return external


class CudaKernels(TorchFraming):
    """`kernels.Kernels` on CuPy's NVRTC build of ``cuda_codec.cu``; CUDA tensors only, launched
    on torch's current stream, with no host synchronisation."""

    name = "cuda"
    writes_every_byte = True
    """Every group's scale and codes and non-finite byte by the encode (each lane of a group's
    segment stores its 8 codes, the leader the scale and the byte), the header, padding and
    trailer by `frame`."""

    reads_poison = True
    """The encode reads a state's ``poison`` word (`ErrorState.poison`) on the device."""

    def __init__(self) -> None:
        self.stream_words = StreamWords()

    fuses_frame = True
    """The encode frames its messages itself where given ``EncodeArgs.frame``: the last of its
    blocks to finish writes the headers, padding and trailers (`FRAME_ARGS`)."""

    fuses_sum = True
    """The encode of one row reads it as the sum of received messages where given
    ``EncodeArgs.summed`` (``encode_sum``), checking their headers as a fused decode does."""

    def encode(self, args: EncodeArgs) -> None:
        """One launch; with ``args.frame`` the encode frames the messages too, unless they
        cannot be framed there (no block to launch, rows not 8-byte aligned, shards not
        consecutive): then `frame` runs after it. With ``args.summed``, ``encode_sum``."""
        warps = encode_warps(args.rows, args.ng, args.group_size, args.fmt)
        blocks = min(-(-warps * 32 // THREADS), ENCODE_BLOCKS)
        device = args.source.device
        if blocks == 0 and args.clear is not None:  # no launch to clear it
            args.clear.zero_()
        summed = args.summed
        if summed is None:
            name = encode_name(args.source.dtype, args.bits, args.mode, args.stochastic, args.fmt)
            sources: tuple = ()
        elif blocks == 0:
            raise ValueError("lowbitcc: an encode of a sum needs elements to encode")
        else:
            name = encode_sum_name(args.bits, args.mode, args.stochastic, args.fmt)
            sources = (sum_source(summed.messages, summed.verdict),
                       self._row_check(summed.messages, summed.check, summed.verdict,
                                       summed.count, last=False))
        spec = args.frame
        messages = args.messages
        if spec is None or blocks == 0 or aligned_stride(messages) != messages.shape[1] or (
                spec.shards != list(range(spec.shards[0], spec.shards[0] + args.rows))):
            if spec is not None:
                unfused(spec.count, "frame")
            _issue(name, device, blocks, (pack_encode_args(args), NO_FRAME, *sources))
            if spec is not None:
                self.frame(messages, spec.header, spec.shards, args.nonfinite, spec.used,
                           spec.flags, False, spec.verdict)
            return
        own = spec.count.frame if spec.count is not None else None
        if own is not None and own.numel() > args.rows:  # the place's: no stream's words
            _issue(name, device, blocks, (pack_encode_args(args), frame_args(spec, own), *sources))
            return
        with self.stream_words.taken(args.rows + 1, device) as words:
            _issue(name, device, blocks, (pack_encode_args(args), frame_args(spec, words), *sources))

    fuses_check = True
    """The decodes check the rows' headers themselves where given the call's header (`check`):
    one launch instead of `CHECK_FOLD` and a decode."""

    def decode_sum(self, messages: torch.Tensor, m: int, bits: int, group_size: int, fmt: str,
                   out: torch.Tensor, verdict: torch.Tensor | None = None,
                   check: tuple[bytes, list[int]] | None = None,
                   count: CallCount | None = None) -> None:
        """`kernels.Kernels.decode_sum`; with ``check`` (the call's header and the rows' shards;
        the call's ``verdict`` given, checksums off) the launch checks the headers as `check`
        would, setting the verdict's bytes (`_row_check`); ``count``: the call's counter, this
        launch its last (`interface.CallCount`)."""
        if m == 0 and check is not None:  # no launch: the check runs alone
            unfused(count, "decode")
            self.check(messages, check[0], check[1], False, verdict)
            return
        _issue(decode_sum_name(bits, fmt), messages.device, -(-m // DECODE_SPAN),
                (ptr_arg(messages), np.int64(messages.shape[0]), np.int64(messages.stride(0)),
                 np.int64(m), np.int32(group_size), ptr_arg(out), ptr_arg(verdict),
                 self._row_check(messages, check, verdict, count, last=True)))

    def decode_into(self, messages: torch.Tensor, m: int, bits: int, group_size: int, fmt: str,
                    out: torch.Tensor, verdict: torch.Tensor | None = None,
                    check: tuple[bytes, list[int]] | None = None,
                    count: CallCount | None = None) -> None:
        """`kernels.Kernels.decode_into`; ``check`` and ``count`` as `decode_sum`'s."""
        n = out.numel()
        if n == 0 and check is not None:  # no launch: the check runs alone
            unfused(count, "decode")
            self.check(messages, check[0], check[1], False, verdict)
            return
        name = decode_into_name(out.dtype, bits, fmt)
        _issue(name, messages.device, -(-n // DECODE_SPAN),
                (ptr_arg(messages), np.int64(messages.stride(0)), np.int64(m), np.int32(group_size),
                 np.int64(n), ptr_arg(out), ptr_arg(verdict),
                 self._row_check(messages, check, verdict, count, last=True)))

    fuses_rows = True
    """`decode_rows`: every row of gathered messages decoded and summed in one launch."""

    def decode_rows(self, messages: torch.Tensor, senders: int, m: int, bits: int,
                    group_size: int, fmt: str, out: torch.Tensor, verdict: torch.Tensor,
                    header: bytes, count: CallCount | None = None) -> None:
        """One launch: row ``r`` of ``out`` (flat, fp32, bf16 or fp16, at most ``n * m``
        elements) is the sum over the ``senders`` of their message of row ``r``, cast, as
        `decode_sum` and a cast write it (NaN everywhere where a row is foreign, as
        `decode_into`); ``messages`` uint8 ``[senders * n, P]``, contiguous,
        sender by sender. Every row is checked against ``header`` (the call's) and its shard
        (row ``q`` holds shard ``q % n``), setting the call's ``verdict`` as `check` does;
        rows that do not start 8-byte aligned take `check` first; ``count`` as `decode_sum`'s."""
        rows, width = messages.shape
        n = rows // senders
        if aligned_stride(messages) == width:
            check = row_check(header, 0, 1, rows, n, count, last=True)
        else:
            unfused(count, "check")
            self.check(messages, header, list(range(n)) * senders, False, verdict)
            check = row_check(None, 0, 0, 0, 0, count, last=True)
        numel = out.numel()
        _issue(decode_rows_name(out.dtype, bits, fmt), messages.device, -(-numel // DECODE_SPAN),
                (ptr_arg(messages), np.int64(senders), np.int64(n), np.int64(width), np.int64(m),
                 np.int32(group_size), np.int64(numel), ptr_arg(out), ptr_arg(verdict), check))

    def _row_check(self, messages: torch.Tensor, check: tuple[bytes, list[int]] | None,
                   verdict: torch.Tensor | None, count: CallCount | None = None,
                   last: bool = False) -> np.void:
        """``loco_cuda::RowCheck`` of ``check`` and ``count`` (`cuda_args.row_check`; no check
        where none is asked). Rows the decode cannot check itself (not 8-byte aligned, shards
        other than ``s0 + r * step`` with step 0 or 1) take `check` first: then the decode reads
        the answer from the verdict. Every row of ``messages`` is checked, also rows past a
        ``decode_into``'s ``out``."""
        if check is None:
            unfused(count, "decode without its check")
            return row_check(None, 0, 0, 0, 0, count, last)
        if verdict is None:
            raise ValueError("lowbitcc: a decode that checks its rows needs the call's verdict")
        header, shards = check
        step = shards[1] - shards[0] if len(shards) > 1 else 0
        if (aligned_stride(messages) is None or step not in (0, 1)
                or shards != [shards[0] + r * step for r in range(len(shards))]):
            unfused(count, "check")
            self.check(messages, header, shards, False, verdict)
            return row_check(None, 0, 0, 0, 0, count, last)
        return row_check(header, shards[0], step, messages.shape[0], 0, count, last)

    def checksum(self, messages: torch.Tensor) -> torch.Tensor:
        """The fused kernels (one read of the messages, a fold; plus the zeroing of two int64
        per row), on the current stream. Rows that `_aligned_stride` refuses take
        `reference.checksum` (torch's kernels)."""
        rows, width = messages.shape
        stride = aligned_stride(messages)
        if stride is None:
            return reference.checksum(messages)
        sums = torch.zeros(rows, 2, dtype=torch.int64, device=messages.device)
        out = torch.empty(rows, dtype=torch.int64, device=messages.device)
        _issue(CHECKSUM, messages.device, (checksum_blocks(width), rows),
                (ptr_arg(messages), np.int64(width), np.int64(stride), np.uint64(wire.CHECKSUM_STEP),
                 ptr_arg(sums)))
        _issue(CHECKSUM_FOLD, messages.device, -(-rows // THREADS),
                (ptr_arg(sums), np.int64(rows), ptr_arg(out)))
        return out

    def frame(self, messages: torch.Tensor, header: bytes, shards: list[int],
              nonfinite: torch.Tensor, used: int, flags: int, checksum: bool,
              verdict: torch.Tensor | None = None) -> Flag:
        """Two launches on the current stream: `FRAME_BODY` clears the padding, sums the
        checksum and ORs each row's non-finite flags into ``acc`` (three words a row);
        `FRAME_FOLD` writes headers and trailers, zeroes ``acc`` again, and sets the answer, the
        call's ``verdict`` non-finite flag. ``acc`` is the stream's own (`_StreamWords`, no
        zero-fill per call); without a ``verdict`` it is a new zero-filled one with a last word
        for the answer (a 0-dim bool view of it). Rows that do not start 8-byte aligned, more
        rows than a grid's second dimension holds, or shards that are not consecutive take
        `framing.frame_with_torch`."""
        rows, width = messages.shape
        if (aligned_stride(messages) != width or not nonfinite.is_contiguous()
                or shards != list(range(shards[0], shards[0] + rows))):
            return frame_with_torch(self, messages, header, shards, nonfinite, used, flags,
                                    checksum, verdict)
        device = messages.device
        if verdict is None:
            acc = torch.zeros(3 * rows + 1, dtype=torch.int64, device=device)
            answer = acc[-1:].view(torch.bool)[0]
            self._frame(messages, header, shards, nonfinite, used, flags, checksum, acc, answer)
            return answer
        answer = verdict_flag(verdict, VERDICT_NONFINITE)
        with self.stream_words.taken(3 * rows, device) as acc:
            self._frame(messages, header, shards, nonfinite, used, flags, checksum, acc, answer)
        return answer

    @staticmethod
    def _frame(messages: torch.Tensor, header: bytes, shards: list[int],
               nonfinite: torch.Tensor, used: int, flags: int, checksum: bool,
               acc: torch.Tensor, answer: torch.Tensor) -> None:
        rows, width = messages.shape
        device = messages.device
        _issue(FRAME_BODY, device, (checksum_blocks(width), rows),
                (ptr_arg(messages), np.int64(width), np.int64(used), ptr_arg(nonfinite),
                 np.int64(nonfinite.numel() // rows), np.uint64(wire.CHECKSUM_STEP),
                 np.int32(checksum), ptr_arg(acc)))
        _issue(FRAME_FOLD, device, -(-rows // THREADS),
                (ptr_arg(messages), np.int64(width), np.int64(rows), ptr_arg(acc),
                 np.frombuffer(header, dtype=HEADER_WORDS)[0], np.int64(shards[0]),
                 np.uint32(flags), np.int32(checksum), ptr_arg(answer)))

    def check(self, messages: torch.Tensor, header: bytes, shards: list[int],
              checksum: bool, verdict: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One zero-fill and, with checksums, `CHECKSUM` into it, then `CHECK_FOLD`: the two
        answers are 0-dim bool views of the zero-filled buffer's last word (of the call's
        ``verdict`` where given: then no zero-fill without checksums). Rows that do not
        start 8-byte aligned, more rows than a grid's second dimension holds, or shards other
        than ``s0 + r * step`` (step 0 or 1) take `framing.check_with_torch`. Rows may lie
        apart (a column of gathered messages)."""
        rows, width = messages.shape
        step = shards[1] - shards[0] if rows > 1 else 0
        stride = aligned_stride(messages)
        if (stride is None or step not in (0, 1)
                or shards != [shards[0] + r * step for r in range(rows)]):
            return check_with_torch(self, messages, header, shards, checksum, verdict)
        device = messages.device
        words = 2 * rows * checksum + (verdict is None)
        acc = torch.zeros(words, dtype=torch.int64, device=device) if words else None
        if verdict is None:
            verdict = acc[-1:].view(torch.uint8)
        if checksum:
            _issue(CHECKSUM, device, (checksum_blocks(width), rows),
                    (ptr_arg(messages), np.int64(width), np.int64(stride),
                     np.uint64(wire.CHECKSUM_STEP), ptr_arg(acc)))
        _issue(CHECK_FOLD, device, -(-rows // THREADS),
                (ptr_arg(messages), np.int64(width), np.int64(stride), np.int64(rows), ptr_arg(acc),
                 np.frombuffer(header, dtype=HEADER_WORDS)[0], np.int64(shards[0]),
                 np.int64(step), np.int32(checksum), ptr_arg(verdict)))
        return verdict_flag(verdict, VERDICT_NONFINITE), verdict_flag(verdict, VERDICT_FOREIGN)


KERNELS = CudaKernels()
