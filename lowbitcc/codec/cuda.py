"""The CUDA kernels (``csrc/cuda_codec.cu``), compiled by CuPy's NVRTC and cached.

Used for CUDA tensors when CuPy is installed (``pip install lowbitcc[cuda]``); kernels run on
torch's current CUDA stream. Layouts and arguments are those of the C++ CPU codec (one
``loco::EncodeArgs``, passed by value), and the bytes are the same; `kernels.select` takes the
reference for group sizes above `MAX_GROUP`.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import numpy as np
import torch

from lowbitcc.codec import reference, wire
from lowbitcc.codec.abi import ERROR_MODES, encode_args_dtype
from lowbitcc.codec.cuda_build import (
    CHECK_FOLD,
    CHECKSUM,
    CHECKSUM_BLOCKS,
    CHECKSUM_FOLD,
    FRAME_ARGS,
    FRAME_BODY,
    FRAME_FOLD,
    HEADER_WORDS,
    NO_CHECK,
    NO_FRAME,
    ROW_CHECK,
    SOURCE,
    decode_into_name,
    decode_sum_name,
    encode_name,
    encode_warps,
    header_words,
    name_expressions,
    options,
    struct_value,
)
from lowbitcc.codec.framing import (
    VERDICT_FOREIGN,
    VERDICT_NONFINITE,
    TorchFraming,
    check_with_torch,
    frame_with_torch,
    verdict_flag,
)
from lowbitcc.codec.interface import EncodeArgs, Flag

MAX_GROUP = 256  # at most a warp per group, 8 elements per lane (`segment_lanes`)
THREADS = 256
ENCODE_BLOCKS = 1024
"""Most blocks an encode launches (its warps loop over the groups): about one full wave on an
H100 (132 SMs x 2048 threads), and the count of atomic adds of the residual sums."""
MAX_GRID_Y = 65535
"""CUDA's limit on a grid's second dimension (the checksum launches one row per y index)."""


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


def _p(t: torch.Tensor | None) -> np.uint64:
    """A device pointer as a kernel argument (0 for an absent or empty tensor)."""
    return np.uint64(_ptr(t))


def _ptr(t: torch.Tensor | None) -> int:
    """`_p`'s address as a Python int (a field of a packed struct)."""
    return 0 if t is None or t.numel() == 0 else t.data_ptr()


@functools.cache
def _in_field_order() -> Callable[[dict[str, Any]], tuple]:
    """The values of a ``{field: value}`` dict in ``loco::EncodeArgs``' order (one C call)."""
    return operator.itemgetter(*encode_args_dtype().names)


def pack_encode_args(args: EncodeArgs) -> np.void:
    """``args`` as one ``loco::EncodeArgs`` value (pointers are the tensors' device addresses;
    without an error state its fields are zero, as `EncodeArgs`' properties then say)."""
    state, mode = args.state, args.mode
    held = state is not None
    values = {
        "src": _ptr(args.source), "msgs": _ptr(args.messages),
        "ecodes": _ptr(args.error_codes) if held else 0,
        "escales": _ptr(args.error_scales) if held else 0,
        "ef32": _ptr(args.error_values) if held and mode == ERROR_MODES["fp32"] else 0,
        "ebf16": _ptr(args.error_values) if held and mode == ERROR_MODES["bf16"] else 0,
        "nonfinite": _ptr(args.nonfinite), "sums": _ptr(args.sums),
        "invalid": _ptr(state.poison) if held and args.has_error else 0,
        "clear": _ptr(args.clear),
        "numel": args.source.numel(),
        "rows": args.rows, "m": args.m, "ng": args.ng, "P": args.messages.shape[1],
        "factor": args.factor, "beta": args.beta, "omb": np.float32(1.0 - args.beta),
        "G": args.group_size, "scale_input": int(args.factor != 1.0),
        "has_error": int(args.has_error), "mode": mode, "stochastic": int(args.keys is not None),
        "format": args.format_code, "k0": args.k0, "k1": args.k1,
    }
    return struct_value(encode_args_dtype(), _in_field_order()(values))


def _aligned_stride(messages: torch.Tensor) -> int | None:
    """The distance in bytes between rows of ``messages`` (uint8 ``[rows, P]``, rows
    contiguous) where the checksum kernels can read them: whole words of body, every row
    starting 8-byte aligned, at most a grid's second dimension of rows; else None."""
    rows, width = messages.shape
    stride = messages.stride(0) if rows > 1 else width
    if ((width - wire.HEADER_BYTES - wire.TRAILER_BYTES) % 8 or width % 8 or stride % 8
            or messages.data_ptr() % 8 or (width > 1 and messages.stride(1) != 1)
            or stride < width or not 0 < rows <= MAX_GRID_Y):
        return None
    return stride


def _checksum_blocks(width: int) -> int:
    """Blocks per row of a checksum pass over messages of ``width`` bytes."""
    body = width - wire.HEADER_BYTES - wire.TRAILER_BYTES
    return max(1, min(-(-body // (8 * THREADS)), CHECKSUM_BLOCKS))


class _StreamWords:
    """Zeroed int64 accumulators kept per CUDA stream: `taken` lends at least ``words`` of the
    current stream's to the launches in its block, which must leave them zero again
    (`FRAME_FOLD` does), so no call zero-fills its own. Work on one stream is ordered, and a
    lock keeps two host threads (two groups on one stream) from interleaving their launches;
    a block that raises drops the stream's buffer (it may be left dirty). A larger request
    replaces the buffer with a new zero-filled one (the old one goes back to the caching
    allocator, which reuses it on that stream only)."""

    def __init__(self) -> None:
        self._words: dict[tuple[str, int | None, int], torch.Tensor] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def taken(self, words: int, device: torch.device) -> Iterator[torch.Tensor]:
        stream = (torch.cuda.current_stream(device).cuda_stream if device.type == "cuda"
                  else 0)
        key = (device.type, device.index, stream)
        with self._lock:
            buf = self._words.get(key)
            if buf is None or buf.numel() < words:
                buf = self._words[key] = torch.zeros(max(words, 64), dtype=torch.int64,
                                                     device=device)
            try:
                yield buf[:words]
            except BaseException:
                self._words.pop(key, None)
                raise


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
        self.stream_words = _StreamWords()

    fuses_frame = True
    """The encode frames its messages itself where given ``EncodeArgs.frame``: the last of its
    blocks to finish writes the headers, padding and trailers (`FRAME_ARGS`)."""

    def encode(self, args: EncodeArgs) -> None:
        """One launch; with ``args.frame`` the encode frames the messages too, unless they
        cannot be framed there (no block to launch, rows not 8-byte aligned, shards not
        consecutive): then `frame` runs after it."""
        warps = encode_warps(args.rows, args.ng, args.group_size, args.fmt)
        name = encode_name(args.source.dtype, args.bits, args.mode, args.stochastic, args.fmt)
        blocks = min(-(-warps * 32 // THREADS), ENCODE_BLOCKS)
        device = args.source.device
        if blocks == 0 and args.clear is not None:  # no launch to clear it
            args.clear.zero_()
        spec = args.frame
        messages = args.messages
        if spec is None or blocks == 0 or _aligned_stride(messages) != messages.shape[1] or (
                spec.shards != list(range(spec.shards[0], spec.shards[0] + args.rows))):
            _launch(name, device, blocks, (pack_encode_args(args), NO_FRAME))
            if spec is not None:
                self.frame(messages, spec.header, spec.shards, args.nonfinite, spec.used,
                           spec.flags, False, spec.verdict)
            return
        with self.stream_words.taken(args.rows + 1, device) as words:
            answer = _ptr(spec.verdict) + VERDICT_NONFINITE  # the byte's address
            frame = struct_value(FRAME_ARGS, (header_words(spec.header), spec.shards[0],
                                              spec.used, _ptr(words), answer, spec.flags, 1))
            _launch(name, device, blocks, (pack_encode_args(args), frame))

    fuses_check = True
    """The decodes check the rows' headers themselves where given the call's header (`check`):
    one launch instead of `CHECK_FOLD` and a decode."""

    def decode_sum(self, messages: torch.Tensor, m: int, bits: int, group_size: int, fmt: str,
                   out: torch.Tensor, verdict: torch.Tensor | None = None,
                   check: tuple[bytes, list[int]] | None = None) -> None:
        """`kernels.Kernels.decode_sum`; with ``check`` (the call's header and the rows' shards;
        the call's ``verdict`` given, checksums off) the launch checks the headers as `check`
        would, setting the verdict's bytes (`_row_check`)."""
        if m == 0 and check is not None:  # no launch: the check runs alone
            self.check(messages, check[0], check[1], False, verdict)
            return
        _launch(decode_sum_name(bits, fmt), messages.device, -(-m // THREADS),
                (_p(messages), np.int64(messages.shape[0]), np.int64(messages.stride(0)),
                 np.int64(m), np.int32(group_size), _p(out), _p(verdict),
                 self._row_check(messages, check, verdict)))

    def decode_into(self, messages: torch.Tensor, m: int, bits: int, group_size: int, fmt: str,
                    out: torch.Tensor, verdict: torch.Tensor | None = None,
                    check: tuple[bytes, list[int]] | None = None) -> None:
        """`kernels.Kernels.decode_into`; ``check`` as `decode_sum`'s."""
        n = out.numel()
        if n == 0 and check is not None:  # no launch: the check runs alone
            self.check(messages, check[0], check[1], False, verdict)
            return
        name = decode_into_name(out.dtype, bits, fmt)
        _launch(name, messages.device, -(-n // THREADS),
                (_p(messages), np.int64(messages.stride(0)), np.int64(m), np.int32(group_size),
                 np.int64(n), _p(out), _p(verdict), self._row_check(messages, check, verdict)))

    def _row_check(self, messages: torch.Tensor, check: tuple[bytes, list[int]] | None,
                   verdict: torch.Tensor | None) -> np.void:
        """``loco_cuda::RowCheck`` of ``check``, or `NO_CHECK` (nothing asked). Rows the decode
        cannot check itself (not 8-byte aligned, shards other than ``s0 + r * step`` with step
        0 or 1) take `check` first: then the decode reads the answer from the verdict. Every
        row of ``messages`` is checked, also rows past a ``decode_into``'s ``out``."""
        if check is None:
            return NO_CHECK
        if verdict is None:
            raise ValueError("lowbitcc: a decode that checks its rows needs the call's verdict")
        header, shards = check
        step = shards[1] - shards[0] if len(shards) > 1 else 0
        if (_aligned_stride(messages) is None or step not in (0, 1)
                or shards != [shards[0] + r * step for r in range(len(shards))]):
            self.check(messages, header, shards, False, verdict)
            return NO_CHECK
        return struct_value(ROW_CHECK, (header_words(header), shards[0], step, messages.shape[0], 1))

    def checksum(self, messages: torch.Tensor) -> torch.Tensor:
        """The fused kernels (one read of the messages, a fold; plus the zeroing of two int64
        per row), on the current stream. Rows that `_aligned_stride` refuses take
        `reference.checksum` (torch's kernels)."""
        rows, width = messages.shape
        stride = _aligned_stride(messages)
        if stride is None:
            return reference.checksum(messages)
        sums = torch.zeros(rows, 2, dtype=torch.int64, device=messages.device)
        out = torch.empty(rows, dtype=torch.int64, device=messages.device)
        _launch(CHECKSUM, messages.device, (_checksum_blocks(width), rows),
                (_p(messages), np.int64(width), np.int64(stride), np.uint64(wire.CHECKSUM_STEP),
                 _p(sums)))
        _launch(CHECKSUM_FOLD, messages.device, -(-rows // THREADS),
                (_p(sums), np.int64(rows), _p(out)))
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
        if (_aligned_stride(messages) != width or not nonfinite.is_contiguous()
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
        _launch(FRAME_BODY, device, (_checksum_blocks(width), rows),
                (_p(messages), np.int64(width), np.int64(used), _p(nonfinite),
                 np.int64(nonfinite.numel() // rows), np.uint64(wire.CHECKSUM_STEP),
                 np.int32(checksum), _p(acc)))
        _launch(FRAME_FOLD, device, -(-rows // THREADS),
                (_p(messages), np.int64(width), np.int64(rows), _p(acc),
                 np.frombuffer(header, dtype=HEADER_WORDS)[0], np.int64(shards[0]),
                 np.uint32(flags), np.int32(checksum), _p(answer)))

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
        stride = _aligned_stride(messages)
        if (stride is None or step not in (0, 1)
                or shards != [shards[0] + r * step for r in range(rows)]):
            return check_with_torch(self, messages, header, shards, checksum, verdict)
        device = messages.device
        words = 2 * rows * checksum + (verdict is None)
        acc = torch.zeros(words, dtype=torch.int64, device=device) if words else None
        if verdict is None:
            verdict = acc[-1:].view(torch.uint8)
        if checksum:
            _launch(CHECKSUM, device, (_checksum_blocks(width), rows),
                    (_p(messages), np.int64(width), np.int64(stride),
                     np.uint64(wire.CHECKSUM_STEP), _p(acc)))
        _launch(CHECK_FOLD, device, -(-rows // THREADS),
                (_p(messages), np.int64(width), np.int64(stride), np.int64(rows), _p(acc),
                 np.frombuffer(header, dtype=HEADER_WORDS)[0], np.int64(shards[0]),
                 np.int64(step), np.int32(checksum), _p(verdict)))
        return verdict_flag(verdict, VERDICT_NONFINITE), verdict_flag(verdict, VERDICT_FOREIGN)


KERNELS = CudaKernels()
