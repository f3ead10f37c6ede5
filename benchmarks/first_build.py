"""How long a process's first "loco" group takes to make with an empty extension cache: the
C++ codec's and the C++ Works' builds (`lowbitcc.codec.cpp_build`), which a fresh install pays
once.

Feeds docs/architecture.md, "Codec implementations" (the first group's build time) and the
README's note on a clean clone's first tests.

Each round points ``TORCH_EXTENSIONS_DIR`` at a new empty folder and starts a fresh Python
process that imports torch and lowbitcc (timed apart) and makes a world-1 "loco" group
(``init_process_group``: the group's codec build, with the Works built on a thread of their
own beside it), then all-reduces once and says whether both modules loaded. It imports the
package of the checkout it lies in; to compare revisions, run it from a worktree of each in
turn (alternating), with nothing else running.

    python benchmarks/first_build.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
"""This checkout: its package is the one timed (first on ``PYTHONPATH``)."""

CHILD = """
import tempfile, time
t0 = time.perf_counter()
import torch, torch.distributed as dist
import lowbitcc
t1 = time.perf_counter()
dist.init_process_group("loco", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
t2 = time.perf_counter()
dist.all_reduce(torch.randn(1 << 16))
from lowbitcc.backend import native
from lowbitcc.codec import cpu
print(f"import {t1 - t0:.1f} s, init_process_group {t2 - t1:.1f} s "
      f"(C++ codec loaded: {cpu.load() is not None}, C++ Works: {native.load() is not None})")
dist.destroy_process_group()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="lowbitcc-first-build-") as cache:
            env = {**os.environ, "TORCH_EXTENSIONS_DIR": cache,
                   "PYTHONPATH": os.pathsep.join(
                       [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
            done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                                  text=True, cwd=ROOT)
            if done.returncode != 0:
                sys.exit(f"round {i + 1} failed:\n{done.stderr[-3000:]}")
            print(f"round {i + 1}: {done.stdout.strip()}", flush=True)


if __name__ == "__main__":
    main()
