"""Launcher of the fused CUDA codec (`cuda_codec.cu`), compiled by CuPy's NVRTC and cached.

Used for CUDA tensors when CuPy is installed (``pip install lowbitcc[cuda]``); kernels run on
torch's current CUDA stream. Layouts and arguments are those of the C++ CPU codec (see
`cpu_codec.cpp`), and the bytes are the same; group sizes above `MAX_GROUP` run the reference.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from lowbitcc.kernels.error_state import ERROR_MODES

HERE = Path(__file__).parent
SOURCE = HERE / "cuda_codec.cu"
OPTIONS = ("--std=c++17", "--fmad=false", f"-I{HERE}")
MAX_GROUP = 256  # one warp per group, 8 elements per lane
THREADS = 256
BITS = (2, 4, 8)
TYPES = {torch.float32: "float", torch.bfloat16: "__nv_bfloat16", torch.float16: "__half"}


def encode_name(dtype: torch.dtype, bits: int, mode: int, stochastic: bool) -> str:
    return f"loco_cuda::encode<{TYPES[dtype]}, {bits}, {mode}, {'true' if stochastic else 'false'}>"


def name_expressions() -> list[str]:
    """Every kernel instance the launcher may call (NVRTC compiles exactly these)."""
    names = [encode_name(t, b, mode, sr) for t in TYPES for b in BITS
             for mode in ERROR_MODES.values() for sr in (False, True)]
    names += [f"loco_cuda::decode_sum<{b}>" for b in BITS]
    names += [f"loco_cuda::decode_into<{TYPES[t]}, {b}>" for t in TYPES for b in BITS]
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
    """One NVRTC compilation of the CUDA codec for a real architecture (no GPU needed)."""

    arch: str
    cubin: bytes
    log: str
    lowered: dict[str, str]  # name expression -> mangled kernel name


def compile_with_nvrtc(arch: str, ptxas_verbose: bool = True) -> NvrtcBuild:
    """Compile `SOURCE` with NVRTC (CuPy's binding) to a cubin for ``sm_<arch>``, with every
    instance of `name_expressions`. Raises RuntimeError with NVRTC's log on a compile error,
    ImportError without CuPy."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(SOURCE.read_text(), SOURCE.name, [], [])
    try:
        for name in name_expressions():
            nvrtc.addNameExpression(prog, name)
        flags = [*options(), f"-arch=sm_{arch}"]
        if ptxas_verbose:
            flags.append("--ptxas-options=-v")
        try:
            nvrtc.compileProgram(prog, flags)
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(f"NVRTC failed for sm_{arch}: {exc}\n"
                               f"{nvrtc.getProgramLog(prog)}") from exc
        return NvrtcBuild(arch, nvrtc.getCUBIN(prog), nvrtc.getProgramLog(prog),
                          {n: nvrtc.getLoweredName(prog, n) for n in name_expressions()})
    finally:
        nvrtc.destroyProgram(prog)


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
def module():  # noqa: ANN201 (cupy.RawModule)
    cp = cupy()
    if cp is None:
        raise RuntimeError("lowbitcc: the CUDA codec needs CuPy and a GPU")
    return cp.RawModule(code=SOURCE.read_text(), options=options(),
                        name_expressions=name_expressions())


def _stream():  # noqa: ANN202
    cp = cupy()
    return cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)


def _p(t: torch.Tensor | None) -> np.uint64:
    """A device pointer as a kernel argument (0 for an absent or empty tensor)."""
    return np.uint64(0 if t is None or t.numel() == 0 else t.data_ptr())


def encode(source: torch.Tensor, rows: int, m: int, factor: float, messages: torch.Tensor,
           mode: int, has_error: bool, ecodes: torch.Tensor | None, escales: torch.Tensor | None,
           eflt: torch.Tensor | None, beta: float, bits: int, group: int,
           keys: tuple[int, int] | None) -> tuple[list[bool], float, float]:
    """Fused encode on the GPU; same contract as the CPU kernel's ``encode``.

    Returns (non-finite flag per row, residual^2, input^2)."""
    ng = -(-m // group)
    groups = rows * ng
    nonfinite = torch.zeros(groups, dtype=torch.uint8, device=source.device)
    sums = torch.zeros(2, dtype=torch.float64, device=source.device)
    k0, k1 = keys or (0, 0)
    args = (
        _p(source), np.int64(source.numel()), np.int64(rows), np.int64(m),
        np.int64(messages.shape[1]), np.float32(factor), np.int32(factor != 1.0), _p(messages),
        np.int32(has_error), _p(ecodes if mode == 1 else None), _p(escales if mode == 1 else None),
        _p(eflt if mode == 2 else None), _p(eflt if mode == 3 else None), np.float32(beta),
        np.float32(1.0 - beta), np.int32(group), np.uint32(k0), np.uint32(k1), _p(nonfinite),
        _p(sums),
    )
    kernel = module().get_function(encode_name(source.dtype, bits, mode, keys is not None))
    blocks = -(-groups * 32 // THREADS)
    with _stream():
        kernel((blocks,), (THREADS,), args)
    flags = nonfinite.view(rows, ng).any(dim=1).tolist()
    rs, ys = sums.tolist()
    return flags, rs, ys


def decode_sum(messages: torch.Tensor, m: int, bits: int, group: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    if out is None:
        out = torch.empty(m, dtype=torch.float32, device=messages.device)
    kernel = module().get_function(f"loco_cuda::decode_sum<{bits}>")
    with _stream():
        kernel((-(-m // THREADS),), (THREADS,),
               (_p(messages), np.int64(messages.shape[0]), np.int64(messages.shape[1]),
                np.int64(m), np.int32(group), _p(out)))
    return out


def decode_into(messages: torch.Tensor, m: int, bits: int, group: int, out: torch.Tensor) -> None:
    n = out.numel()
    kernel = module().get_function(f"loco_cuda::decode_into<{TYPES[out.dtype]}, {bits}>")
    with _stream():
        kernel((-(-n // THREADS),), (THREADS,),
               (_p(messages), np.int64(messages.shape[1]), np.int64(m), np.int32(group),
                np.int64(n), _p(out)))
