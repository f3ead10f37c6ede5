"""The fused C++/OpenMP CPU kernels (``csrc/cpu_codec.cpp``, the encodes in ``csrc/cpu_encode.h``),
built on first use and cached (`cpp_build.Extension`: when the first "loco" group is created,
not inside a collective). If no compiler is available, `load` returns None after one warning
and `kernels.select` falls back to the reference. Calls run in the calling thread with
``args.threads`` OpenMP threads.
"""

from __future__ import annotations

import torch

from lowbitcc.codec import cpp_build, reference, wire
from lowbitcc.codec.abi import CSRC, FORMAT_CODES, HEADER
from lowbitcc.codec.framing import TorchFraming
from lowbitcc.codec.interface import EncodeArgs

SOURCES = [CSRC / "cpu_codec.cpp", CSRC / "cpu_encode_fp32.cpp", CSRC / "cpu_encode_fp16.cpp"]
"""The translation units, which ninja compiles in parallel (the encodes' with c10's BFloat16 and
Half headers only)."""
HEADERS = [HEADER, CSRC / "codec_api.h", CSRC / "cpu_codec.h", CSRC / "cpu_encode.h"]
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno",
          "-std=c++17"]
LDFLAGS = ["-fopenmp"]


EXTENSION = cpp_build.Extension(
    "lowbitcc_cpu_codec", SOURCES, HEADERS, [CSRC], CFLAGS, LDFLAGS, what="the C++ CPU codec",
    fallback="using the pure-torch reference codec, which is about 20x slower")
load = EXTENSION.load
"""The compiled module (``encode``, ``decode_sum``, ``decode_into``, ``checksum``, ``frame``,
``verify``, ``vector_path``, ``encode_args_layout``, and ``codec_api``: the capsule of
``csrc/codec_api.h`` that the steady runner calls), or None when it cannot be built
(`cpp_build.Extension.load`)."""


CHECKSUM_STEP = reference.as_int64(wire.CHECKSUM_STEP)
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
        return load().checksum(messages, CHECKSUM_STEP,
                               torch.get_num_threads())

    def frame(self, messages: torch.Tensor, header: bytes, shards: list[int],
              nonfinite: torch.Tensor, used: int, flags: int, checksum: bool,
              verdict: torch.Tensor | None = None) -> bool:
        """The answer is a host bool (``verdict`` is for calls on a device)."""
        return load().frame(messages, header, shards, nonfinite, used, flags, checksum,
                            CHECKSUM_STEP, torch.get_num_threads())

    def verify(self, messages: torch.Tensor, header: bytes, shards: list[int],
               checksum: bool) -> int:
        return load().verify(messages, header, shards, checksum,
                             CHECKSUM_STEP, torch.get_num_threads())


KERNELS = CpuKernels()
