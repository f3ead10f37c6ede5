"""The CUDA kernels' arguments as the launcher passes them (`lowbitcc.codec.cuda`): device
pointers, ``loco::EncodeArgs`` packed into one NumPy value (`abi.encode_args_dtype`), and the
message layouts the checksum, frame and check kernels can read."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from lowbitcc.codec import wire
from lowbitcc.codec.abi import ERROR_MODES, encode_args_dtype
from lowbitcc.codec.cuda_build import (
    CHECKSUM_BLOCKS,
    COUNT_ADD,
    COUNT_SET,
    DECODE_VEC,
    FRAME_ARGS,
    ROW_CHECK,
    SUM_SOURCE,
    header_words,
    struct_value,
)
from lowbitcc.codec.framing import VERDICT_NONFINITE
from lowbitcc.codec.interface import CallCount, EncodeArgs, FrameSpec

THREADS = 256
"""Threads per block of every launch."""
DECODE_SPAN = THREADS * DECODE_VEC
"""Output elements one block of a decode writes (`DECODE_VEC` a thread)."""
MAX_GRID_Y = 65535
"""CUDA's limit on a grid's second dimension (the checksum launches one row per y index)."""


def ptr_arg(t: torch.Tensor | None) -> np.uint64:
    """A device pointer as a kernel argument (0 for an absent or empty tensor)."""
    return np.uint64(pointer(t))


def pointer(t: torch.Tensor | None) -> int:
    """`ptr_arg`'s address as a Python int (a field of a packed struct)."""
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
        "src": pointer(args.source), "msgs": pointer(args.messages),
        "ecodes": pointer(args.error_codes) if held else 0,
        "escales": pointer(args.error_scales) if held else 0,
        "ef32": pointer(args.error_values) if held and mode == ERROR_MODES["fp32"] else 0,
        "ebf16": pointer(args.error_values) if held and mode == ERROR_MODES["bf16"] else 0,
        "nonfinite": pointer(args.nonfinite), "sums": pointer(args.sums),
        "invalid": pointer(state.poison) if held and args.has_error else 0,
        "clear": pointer(args.clear),
        "numel": args.source.numel(),
        "rows": args.rows, "m": args.m, "ng": args.ng, "P": args.messages.shape[1],
        "factor": args.factor, "beta": args.beta, "omb": np.float32(1.0 - args.beta),
        "G": args.group_size, "scale_input": int(args.factor != 1.0),
        "has_error": int(args.has_error), "mode": mode, "stochastic": int(args.keys is not None),
        "format": args.format_code, "k0": args.k0, "k1": args.k1,
    }
    return struct_value(encode_args_dtype(), _in_field_order()(values))


def sum_source(messages: torch.Tensor, verdict: torch.Tensor) -> np.void:
    """``loco_cuda::SumSource`` of received ``messages`` (uint8 ``[k, P]``, rows contiguous at
    any distance) and the call's ``verdict``."""
    rows, width = messages.shape
    stride = messages.stride(0) if rows > 1 else width
    return struct_value(SUM_SOURCE, (pointer(messages), rows, stride, pointer(verdict)))


def frame_args(spec: FrameSpec, words: torch.Tensor) -> np.void:
    """``loco_cuda::FrameArgs`` of ``spec``, its blocks counted in zeroed int64 ``words``."""
    reads = spec.count is not None and spec.count.read  # `FrameArgs.seq_at`
    addresses = spec.count.addresses if reads else None  # `FrameArgs.src_at`
    return struct_value(FRAME_ARGS, (header_words(spec.header), spec.shards[0], spec.used,
                                     words.data_ptr(), spec.verdict.data_ptr() + VERDICT_NONFINITE,
                                     spec.flags, 1, spec.count.word.data_ptr() if reads else 0,
                                     0 if addresses is None else addresses.data_ptr()))


def row_check(header: bytes | None, shard0: int, step: int, rows: int, shard_mod: int,
              count: CallCount | None, last: bool) -> np.void:
    """``loco_cuda::RowCheck``: the rows' headers checked against ``header`` (None: no check;
    the launch then only does its ``count``'s part), shard ``shard0 + r * step`` (modulo
    ``shard_mod`` where not 0); ``count``: the call's counter (`interface.CallCount`), this
    launch the call's last (``last``: it adds the stride to the counter or writes the next
    call number there, and writes its output where ``count.addresses``' second word says) or
    not (it only reads it)."""
    addresses = count.addresses if count is not None and count.read and last else None
    counted = (0, 0, 0, 0, 0) if count is None else (
        count.word.data_ptr(), (count.value or 0) & 0xFFFFFFFF, int(count.read),
        (COUNT_ADD if count.read else COUNT_SET) if last and count.value is not None else 0,
        0 if addresses is None else addresses.data_ptr() + addresses.element_size())
    if header is None:
        return struct_value(ROW_CHECK, ((0,) * 8, 0, 0, 0, 0, 0, counted))
    return struct_value(ROW_CHECK, (header_words(header), shard0, step, rows, shard_mod, 1,
                                    counted))


def aligned_stride(messages: torch.Tensor) -> int | None:
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


def checksum_blocks(width: int) -> int:
    """Blocks per row of a checksum pass over messages of ``width`` bytes."""
    body = width - wire.HEADER_BYTES - wire.TRAILER_BYTES
    return max(1, min(-(-body // (8 * THREADS)), CHECKSUM_BLOCKS))

