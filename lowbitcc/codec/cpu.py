"""The fused C++/OpenMP CPU kernels (``csrc/cpu_codec.cpp``, the encodes in ``csrc/cpu_encode.h``),
built on first use and cached.

Built with torch's ``cpp_extension`` (ninja) into torch's extension cache (`build_directory`)
when the first "loco" group is created (not inside a collective), with a warning while a build
runs; every process of an install shares the build (torch serialises concurrent builds with a
lock file, and a process that finds the build made and unlocked imports it without torch). The cache
entry's name hashes everything that changes the binary: the sources and flags, where they are
(torch's own rebuild check hashes the absolute include path, so two checkouts sharing one entry
rebuilt each other's), torch's version and location, Python's version and the compiler. If no
compiler is available, `load` returns None after one warning and `kernels.select` falls back to
the reference. Calls run in the calling thread with ``args.threads`` OpenMP threads.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType

import torch

from lowbitcc.codec import reference, wire
from lowbitcc.codec.abi import CSRC, FORMAT_CODES, HEADER
from lowbitcc.codec.framing import TorchFraming
from lowbitcc.codec.interface import EncodeArgs

SOURCES = [CSRC / "cpu_codec.cpp", CSRC / "cpu_encode_fp32.cpp", CSRC / "cpu_encode_fp16.cpp"]
"""The translation units, which ninja compiles in parallel (the encodes' with c10's BFloat16 and
Half headers only)."""
HEADERS = [HEADER, CSRC / "cpu_codec.h", CSRC / "cpu_encode.h"]
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno",
          "-std=c++17"]
LDFLAGS = ["-fopenmp"]


@functools.cache
def load() -> ModuleType | None:
    """The compiled module (``encode``, ``decode_sum``, ``decode_into``, ``checksum``,
    ``frame``, ``verify``, ``vector_path``, ``encode_args_layout``), or None when it cannot be built.
    A build that is there and not being made (no lock file of torch's) is imported directly:
    importing ``cpp_extension`` (setuptools) and its lock took about 0.4 s of every rank's
    first "loco" group."""
    name = f"lowbitcc_cpu_codec_{_build_digest()}"
    directory = build_directory(name)
    built = directory / f"{name}.so"
    if built.exists() and not (directory / "lock").exists():
        try:
            return _import(name, built)
        except ImportError:  # torch's path decides: ninja rebuilds only where an input changed,
            pass             # else its import fails too and the reference codec is used
    try:
        from torch.utils import cpp_extension

        if not built.exists():
            warnings.warn(f"lowbitcc: building the C++ CPU codec into {directory} "
                          "(once per install; about a minute)", RuntimeWarning, stacklevel=2)
        directory.mkdir(parents=True, exist_ok=True)
        return cpp_extension.load(
            name=name,
            sources=[str(s) for s in SOURCES],
            extra_include_paths=[str(CSRC)],
            extra_cflags=CFLAGS,
            extra_ldflags=LDFLAGS,
            build_directory=str(directory),
            verbose=os.environ.get("LOWBITCC_BUILD_VERBOSE") == "1",
        )
    except Exception as exc:  # noqa: BLE001 (any build failure means: use the reference)
        warnings.warn(
            f"lowbitcc: the C++ CPU codec could not be built ({type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else exc}); "
            "using the pure-torch reference codec, which is about 20x slower",
            RuntimeWarning, stacklevel=2,
        )
        return None


def build_directory(name: str) -> Path:
    """Where the module ``name`` is built: ``lowbitcc/<name>`` under ``TORCH_EXTENSIONS_DIR``,
    else under ``torch_extensions`` in the user's cache folder (``XDG_CACHE_HOME`` or
    ``~/.cache``), as torch's own extensions."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torch_extensions")
    return Path(root) / "lowbitcc" / name


def _import(name: str, path: Path) -> ModuleType:
    """The extension module ``name`` built at ``path`` (as torch's loader imports it)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"lowbitcc: {path} is not an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build_digest() -> str:
    """Hash of everything that changes the built module (see the module docstring)."""
    h = hashlib.sha256()
    for path in [*SOURCES, *HEADERS]:  # each file's name and length: a move between files shows
        data = path.read_bytes()
        h.update(f"{path.name}\0{len(data)}\0".encode() + data)
    for part in (" ".join(CFLAGS), " ".join(LDFLAGS), str(CSRC.resolve()), torch.__version__,
                 os.path.dirname(torch.__file__), sys.version, os.environ.get("CXX", "c++")):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:12]


_CHECKSUM_STEP = reference.as_int64(wire.CHECKSUM_STEP)
"""`wire.CHECKSUM_STEP` as the C++ checksum takes it."""


class CpuKernels(TorchFraming):
    """`kernels.Kernels` on the C++ module; CPU tensors only."""

    name = "cpu"
    writes_every_byte = True
    reads_poison = False

    def encode(self, args: EncodeArgs) -> None:
        if args.summed is not None:  # the sum is not in args.source: `fuses_sum` kernels only
            raise ValueError("lowbitcc: the C++ kernels do not decode a sum inside the encode")
        load().encode(args)

    def decode_sum(self, messages: torch.Tensor, m: int, bits: int, group_size: int, fmt: str,
                   out: torch.Tensor, verdict: torch.Tensor | None = None) -> None:
        """(CPU messages are checked on the host before: ``verdict`` is for device calls.)"""
        load().decode_sum(messages, m, bits, group_size, FORMAT_CODES[fmt],
                          torch.get_num_threads(), out)

    def decode_into(self, messages: torch.Tensor, m: int, bits: int, group_size: int, fmt: str,
                    out: torch.Tensor, verdict: torch.Tensor | None = None) -> None:
        load().decode_into(messages, m, bits, group_size, FORMAT_CODES[fmt], out,
                           torch.get_num_threads())

    def checksum(self, messages: torch.Tensor) -> torch.Tensor:
        return load().checksum(messages, _CHECKSUM_STEP,
                               torch.get_num_threads())

    def frame(self, messages: torch.Tensor, header: bytes, shards: list[int],
              nonfinite: torch.Tensor, used: int, flags: int, checksum: bool,
              verdict: torch.Tensor | None = None) -> bool:
        """The answer is a host bool (``verdict`` is for calls on a device)."""
        return load().frame(messages, header, shards, nonfinite, used, flags, checksum,
                            _CHECKSUM_STEP, torch.get_num_threads())

    def verify(self, messages: torch.Tensor, header: bytes, shards: list[int],
               checksum: bool) -> int:
        return load().verify(messages, header, shards, checksum,
                             _CHECKSUM_STEP, torch.get_num_threads())


KERNELS = CpuKernels()
