"""The CUDA codec's kernels built by g++ for the host and launched there (``cuda_on_host/``:
CUDA's keywords, types and intrinsics, a std::thread per CUDA thread), so that `cuda.CudaKernels`
runs on CPU tensors without a GPU: `HostKernels.launch` stands in for `cuda._launch` (the same
name, grid and arguments), a kernel's pointers being the tensors' host addresses. What this
holds: the kernels' indexing, their cooperation (block barriers, warp shuffles, atomics) as the
CUDA model defines it, and the launcher's arguments; not timings, nor what only a GPU's memory
model or scheduling could show. Built with UBSan's alignment check: a vector load or store
at an address a GPU would refuse aborts the process."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import torch

from lowbitcc.codec import abi, cuda_build
from lowbitcc.codec.cuda_args import THREADS

HOST = Path(__file__).resolve().parent / "cuda_on_host"
VECTOR_ACCESSES = {"source loads": "kSourceLoad", "code loads": "kCodesLoad",
                   "code stores": "kCodesStore", "output stores": "kOutputStore"}
"""The kinds of vector access the kernels make where aligned, by their names in cuda_codec.cu."""


def compiler() -> str | None:
    return shutil.which("g++")


class HostKernels:
    """The kernels named ``names`` (`cuda_build.name_expressions`' spelling), built in
    ``directory`` (about 5 s for every instance, unoptimised: -O0)."""

    def __init__(self, names: list[str], directory: Path) -> None:
        entries = ",\n".join(
            f'  {{"{name}", [](unsigned x, unsigned y, unsigned t, void** p, '
            f"const unsigned long long* s) {{ return host_launch(&{name}, x, y, t, p, s); }}}}"
            for name in names)
        source = directory / "registry.cpp"
        source.write_text(f"""#include "prelude.h"
#include "cuda_codec.cu"
#include "launch.h"
#include <cstring>
namespace {{
struct Entry {{
  const char* name;
  bool (*run)(unsigned, unsigned, unsigned, void**, const unsigned long long*);
}};
const Entry kEntries[] = {{
{entries}
}};
}}  // namespace
static_assert(loco_cuda::kOutputStore < 8, "prelude.h counts 8 kinds of vector access");
extern "C" void lowbitcc_host_vector_accesses(unsigned long long* counts) {{
  for (int kind = 0; kind < 8; ++kind) counts[kind] = host_vector_accesses[kind].exchange(0);
}}
extern "C" int lowbitcc_host_launch(const char* name, unsigned gx, unsigned gy,
                                    unsigned threads, void** params,
                                    const unsigned long long* sizes) {{
  for (const Entry& e : kEntries)
    if (!std::strcmp(e.name, name)) return e.run(gx, gy, threads, params, sizes) ? 0 : -2;
  return -1;
}}
""")
        library = directory / "kernels.so"
        done = subprocess.run(
            [compiler() or "g++", "-std=c++20", "-O0", "-ffp-contract=off", "-fPIC", "-shared",
             "-fsanitize=alignment", "-fno-sanitize-recover=alignment",
             "-pthread", "-Wno-unknown-pragmas", f"-I{HOST}", f"-I{cuda_build.CSRC}", "-o",
             str(library), str(source)], capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"g++ failed:\n{done.stderr[-6000:]}")
        self._library = ctypes.CDLL(str(library))
        self._library.lowbitcc_host_launch.restype = ctypes.c_int
        self.launched: list[str] = []
        kinds = cuda_build.CSRC / "cuda_codec.cu"
        self._access_kinds = {kind: abi.constant(name, kinds)
                              for kind, name in VECTOR_ACCESSES.items()}

    def launch(self, name: str, device: torch.device, grid: int | tuple[int, int],
               args: tuple) -> None:
        """`cuda._launch` on the host: ``args`` are the NumPy scalars the launcher passes."""
        gx, gy = grid if isinstance(grid, tuple) else (grid, 1)
        if gx == 0 or gy == 0:
            return
        values = [np.asarray(a) for a in args]
        held = [ctypes.create_string_buffer(v.tobytes(), v.nbytes) for v in values]
        params = (ctypes.c_void_p * len(held))(*[ctypes.addressof(b) for b in held])
        sizes = (ctypes.c_ulonglong * len(values))(*[v.nbytes for v in values])
        done = self._library.lowbitcc_host_launch(name.encode(), gx, gy, THREADS, params, sizes)
        if done == -1:
            raise KeyError(f"{name} is not in this host build")
        if done == -2:
            raise TypeError(f"{name}: an argument's size is not its parameter's "
                            f"({[v.nbytes for v in values]})")
        self.launched.append(name)

    def vector_accesses(self) -> dict[str, int]:
        """The vector accesses (`VECTOR_ACCESSES`) of every CUDA thread since the last call."""
        counts = (ctypes.c_ulonglong * 8)()
        self._library.lowbitcc_host_vector_accesses(counts)
        return {kind: counts[index] for kind, index in self._access_kinds.items()}
