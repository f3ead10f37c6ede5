"""The CUDA codec's source, its kernel instances and their names, and NVRTC builds of it for a
real architecture (no GPU needed: CI compiles every instance, ``tests/codec/test_cuda_kernels.py``).
`lowbitcc.codec.cuda` launches what this names."""

from __future__ import annotations

import concurrent.futures
import functools
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lowbitcc.codec import formats, wire
from lowbitcc.codec.abi import CSRC, ERROR_MODES, FORMAT_CODES, constant

SOURCE = CSRC / "cuda_codec.cu"
OPTIONS = ("--std=c++17", "--fmad=false", f"-I{CSRC}")
TYPES = {torch.float32: "float", torch.bfloat16: "__nv_bfloat16", torch.float16: "__half"}


WIRES = formats.WIRES
"""The (bits, format) pairs the kernels are instantiated for (`formats.WIRES`)."""


def encode_name(dtype: torch.dtype, bits: int, mode: int, stochastic: bool,
                fmt: str = "int") -> str:
    sr = "true" if stochastic else "false"
    return f"loco_cuda::encode<{TYPES[dtype]}, {bits}, {mode}, {sr}, {FORMAT_CODES[fmt]}>"


def encode_sum_name(bits: int, mode: int, stochastic: bool, fmt: str = "int") -> str:
    """The encode that reads its one row as the sum of received messages (``encode_sum``)."""
    sr = "true" if stochastic else "false"
    return f"loco_cuda::encode_sum<{bits}, {mode}, {sr}, {FORMAT_CODES[fmt]}>"


def decode_sum_name(bits: int, fmt: str) -> str:
    return f"loco_cuda::decode_sum<{bits}, {FORMAT_CODES[fmt]}>"


def decode_rows_name(dtype: torch.dtype, bits: int, fmt: str) -> str:
    return f"loco_cuda::decode_rows<{TYPES[dtype]}, {bits}, {FORMAT_CODES[fmt]}>"


def decode_into_name(dtype: torch.dtype, bits: int, fmt: str) -> str:
    return f"loco_cuda::decode_into<{TYPES[dtype]}, {bits}, {FORMAT_CODES[fmt]}>"


DECODE_VEC = constant("kDecodeVec", SOURCE)
"""Consecutive output elements each thread of a decode writes (``kDecodeVec``)."""
COUNT_SET, COUNT_ADD = constant("kCountSet", SOURCE), constant("kCountAdd", SOURCE)
"""``loco_cuda::CallCount::mode``: write the next call number, or add the stride."""
CHECKSUM = "loco_cuda::checksum"
CHECKSUM_FOLD = "loco_cuda::checksum_fold"
CHECKSUM_BLOCKS = 256
"""Most blocks per message row of a checksum launch (each thread then loops over the words)."""
FRAME_BODY = "loco_cuda::frame_body"
FRAME_FOLD = "loco_cuda::frame_fold"
CHECK_FOLD = "loco_cuda::check_fold"
HEADER_WORDS = np.dtype([(f"w{k}", "<u4") for k in range(wire.HEADER_BYTES // 4)])
"""``loco_cuda::Header``, the call's header passed by value to `FRAME_FOLD`."""
CALL_COUNT = np.dtype([("word", "<u8"), ("value", "<u4"), ("read", "<i4"), ("mode", "<i4"),
                       ("out_at", "<u8")], align=True)
"""``loco_cuda::CallCount``: a place's call counter on the device and what a launch does with
it (`interface.CallCount`)."""
ROW_CHECK = np.dtype([("header", HEADER_WORDS), ("shard0", "<i8"), ("shard_step", "<i8"),
                      ("rows", "<i8"), ("shard_mod", "<i8"), ("check", "<i4"),
                      ("count", CALL_COUNT)], align=True)
"""``loco_cuda::RowCheck``, passed by value to the decodes: what they check themselves."""
FRAME_ARGS = np.dtype([("header", HEADER_WORDS), ("shard0", "<i8"), ("used", "<i8"),
                       ("words", "<u8"), ("answer", "<u8"), ("flags", "<u4"),
                       ("enabled", "<i4"), ("seq_at", "<u8"), ("src_at", "<u8")], align=True)
"""``loco_cuda::FrameArgs``, passed by value to the encode: the frame it writes itself."""
NO_FRAME = np.zeros((), dtype=FRAME_ARGS)[()]
SUM_SOURCE = np.dtype([("msgs", "<u8"), ("k", "<i8"), ("stride", "<i8"), ("verdict", "<u8")],
                      align=True)
"""``loco_cuda::SumSource``, passed by value to ``encode_sum``: the messages it sums."""


def struct_value(dtype: np.dtype, values: tuple) -> np.void:
    """``values`` (one per field, in order) as one ``dtype`` value, its padding zero."""
    value = np.zeros((), dtype=dtype)
    value[()] = values
    return value[()]


@functools.lru_cache(maxsize=16)  # a call's encode and decodes pass the same header
def header_words(header: bytes) -> tuple[int, ...]:
    """``loco_cuda::Header`` of a call's ``header`` bytes (`HEADER_WORDS`), as a field value."""
    return tuple(np.frombuffer(header, dtype=HEADER_WORDS)[0].item())


def encode_warps(rows: int, ng: int, group_size: int, fmt: str) -> int:
    """Warps of work in one encode (its tasks, ``encode`` in ``cuda_codec.cu``): a block of a
    row each for a format with blocks (`formats.Format.block`), else ``32 / segment_lanes``
    consecutive groups each."""
    spec = formats.FORMATS[fmt]
    if spec.block:
        if group_size != spec.default_group:  # a warp takes a block: its groups, 2 lanes each
            raise ValueError(f"lowbitcc: the CUDA encode takes {fmt} groups of "
                             f"{spec.default_group}, not {group_size}")
        return rows * -(-ng // spec.block)
    return -(-rows * ng // (32 // segment_lanes(group_size)))


def segment_lanes(group_size: int) -> int:
    """Lanes of a warp that encode one group (``segment_lanes`` in ``cuda_codec.cu``): G/8
    where that is a power of two, so that a warp encodes 32/(G/8) groups at once, else 32."""
    lanes = group_size // 8
    return lanes if group_size % 8 == 0 and 0 < lanes <= 32 and lanes & (lanes - 1) == 0 else 32


def name_expressions() -> list[str]:
    """Every kernel instance the launcher may call (NVRTC compiles exactly these)."""
    names = [CHECKSUM, CHECKSUM_FOLD, FRAME_BODY, FRAME_FOLD, CHECK_FOLD]
    names += [encode_name(t, b, mode, sr, fmt) for t in TYPES for b, fmt in WIRES
             for mode in ERROR_MODES.values() for sr in (False, True)
             if not sr or "stochastic" in formats.FORMATS[fmt].roundings]
    names += [encode_sum_name(b, mode, sr, fmt) for b, fmt in WIRES
              for mode in ERROR_MODES.values() for sr in (False, True)
              if not sr or "stochastic" in formats.FORMATS[fmt].roundings]
    names += [decode_sum_name(b, fmt) for b, fmt in WIRES]
    names += [decode_into_name(t, b, fmt) for t in TYPES for b, fmt in WIRES]
    names += [decode_rows_name(t, b, fmt) for t in TYPES for b, fmt in WIRES]
    return names


def include_dirs() -> list[str]:
    """Directories holding the CUDA headers the source includes (``cuda_bf16.h``,
    ``cuda_fp16.h``): the ``nvidia-cuda-runtime-cu12`` wheel's, then ``$CUDA_PATH``,
    ``$CUDA_HOME`` and ``/usr/local/cuda``; only those that exist."""
    found = []
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        found.append(Path(root) / "cuda_runtime" / "include")
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            found.append(Path(os.environ[var]) / "include")
    found.append(Path("/usr/local/cuda/include"))
    return [str(d) for d in found if (d / "cuda_bf16.h").exists()]


def options() -> tuple[str, ...]:
    return (*OPTIONS, *(f"-I{d}" for d in include_dirs()))


@dataclass
class NvrtcBuild:
    """One NVRTC compilation of the CUDA codec for a real architecture (no GPU needed), in
    parts (each a program of some of the instances, compiled at once)."""

    arch: str
    cubins: list[bytes]  # one per part
    log: str  # the parts' logs, one after the other
    lowered: dict[str, str]  # name expression -> mangled kernel name


def compile_with_nvrtc(arch: str, ptxas_verbose: bool = True, parts: int | None = None) -> NvrtcBuild:
    """Compile `SOURCE` with NVRTC (CuPy's binding) to cubins for ``sm_<arch>``, with every
    instance of `name_expressions`, in ``parts`` programs compiled in as many threads (NVRTC
    lets go of the GIL; default: a part per core, at most 4; each instance is compiled as in
    one program: the same registers, checked for sm_90 on 2026-11-27). Raises RuntimeError
    with NVRTC's log on a compile error, ImportError without CuPy."""
    from cupy_backends.cuda.libs import nvrtc  # noqa: F401 (ImportError before any thread)

    names = name_expressions()
    parts = parts or max(1, min(4, os.cpu_count() or 1))
    flags = [*options(), f"-arch=sm_{arch}"]
    if ptxas_verbose:
        flags.append("--ptxas-options=-v")
    with concurrent.futures.ThreadPoolExecutor(parts) as pool:
        built = list(pool.map(functools.partial(_nvrtc_part, arch, flags),
                              [names[k::parts] for k in range(parts)]))
    return NvrtcBuild(arch, [b[0] for b in built], "\n".join(b[1] for b in built),
                      {n: m for b in built for n, m in b[2].items()})


def _nvrtc_part(arch: str, flags: list[str], names: list[str]) -> tuple[bytes, str, dict[str, str]]:
    """One program of `compile_with_nvrtc`: its cubin, log and lowered names."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(SOURCE.read_text(), SOURCE.name, [], [])
    try:
        for name in names:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, flags)
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"NVRTC failed for sm_{arch}: {exc}\n"
                               f"{nvrtc.getProgramLog(prog)}") from exc
        return (nvrtc.getCUBIN(prog), nvrtc.getProgramLog(prog),
                {n: nvrtc.getLoweredName(prog, n) for n in names})
    finally:
        nvrtc.destroyProgram(prog)


