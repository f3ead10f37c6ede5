"""Loader of the fused C++/OpenMP CPU codec (`cpu_codec.cpp`), built on first use and cached.

Built with torch's ``cpp_extension`` (ninja) into torch's extension cache; every process of a
machine shares the build (torch serialises concurrent builds with a lock file). If no compiler is
available, `load()` returns None after one warning and the reference codec runs instead.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).parent
SOURCES = [HERE / "cpu_codec.cpp"]
HEADERS = [HERE / "loco_codec.cuh"]
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno",
          "-std=c++17"]

log = logging.getLogger("lowbitcc")


@functools.cache
def load() -> ModuleType | None:
    """The compiled module (functions ``encode``, ``decode_sum``, ``decode_into``), or None."""
    try:
        from torch.utils import cpp_extension

        digest = _source_digest()
        return cpp_extension.load(
            name=f"lowbitcc_cpu_codec_{digest}",
            sources=[str(s) for s in SOURCES],
            extra_include_paths=[str(HERE)],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
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


def _source_digest() -> str:
    import hashlib

    h = hashlib.sha256()
    for path in [*SOURCES, *HEADERS]:
        h.update(path.read_bytes())
    h.update(" ".join(CFLAGS).encode())
    return h.hexdigest()[:12]
