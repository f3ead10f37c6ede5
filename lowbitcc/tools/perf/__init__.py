"""`lowbitcc perf`: nccl-tests-compatible bandwidth tools for compressed and exact collectives.

``lowbitcc perf all_reduce -b 64K -e 64M -f 4 --backend loco gloo --bits 4 8`` prints the table
of nccl-tests' ``all_reduce_perf`` (size, count, type, redop, root, time, algbw, busbw for
out-of-place and in-place) for every backend side by side, with the relative error against the
exact result in place of ``#wrong`` and the bytes each rank put on the wire.

Starts: under ``torchrun`` or ``mpiexec -n N`` (each rank runs the sweep), standalone with
``--np N`` (spawns N local ranks), or inside an emulated network with ``--link RATE --np N``
(each rank in its own network namespace behind a rate-limited link; root only; see
`lowbitcc.tools.netem`). Modules: `harness` (sweep, timing, table), `collectives` (one adapter per
collective), `backends` (what is compared).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lowbitcc.tools.link_spec import Link
from lowbitcc.tools.perf.harness import PerfOptions, measure
from lowbitcc.tools.perf.outputs import plot, write_json
from lowbitcc.tools.perf.table import parse_table
from lowbitcc.tools.spawn import launch, local_gpu

__all__ = ["PerfOptions", "main", "measure", "parse_table", "rank_main"]


def rank_main(rank: int, world: int, opts: PerfOptions) -> dict[str, Any]:
    """One rank's sweep on the initialised default group; rank 0 writes JSON and plot. With
    ``--device cuda`` each rank takes GPU ``LOCAL_RANK`` (else its rank modulo the count, as
    `spawn.gpu_rank_env` places local ranks, sharing GPUs where there are fewer)."""
    if opts.device == "cuda":
        local_gpu(rank)
    result = measure(opts, progress=True)
    if rank == 0:
        if opts.json_path:
            write_json(result, opts.json_path)
        if opts.plot_path:
            plot([result], opts.plot_path)
    return result


def main(opts: PerfOptions, nprocs: int | None, link: Link | None, argv: Sequence[str],
         timeout_s: float = 1800.0) -> int:
    """Run the sweep under whatever started us; ``argv`` is the command line, for ``--link``."""
    opts.validate()
    return launch(rank_main, nprocs, link, argv, opts, timeout_s=timeout_s,
                  gpu=opts.device == "cuda")
