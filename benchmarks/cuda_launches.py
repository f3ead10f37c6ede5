"""Per compressed all-reduce on one GPU: host time, GPU kernels and copies, world size 1.

Feeds the records of GPU runs (docs/gpu/runs-2026-11.md: the table of a world-size-1
all-reduce's host time, descriptor exchanges, kernels and copies per call) and the ``launches``
phase of `benchmarks/gpu_suite.sh`, whose lines docs/gpu.md's "What has run on which GPU" cites.
Needs a GPU.

One process, world size 1 ("loco" with its inner NCCL group on GPU 0), fp32 tensors of each
size; each row times ``--iters`` calls on the host (enqueue only, then with the GPU's finish)
and counts, with torch.profiler (CUPTI: every kernel, CuPy's included), the kernels, memsets
and host<->device copies of ``--profiled`` calls. Rows: compressed (``lowbitcc.compressed()``),
and the same call exact (``lowbitcc.exact()``, the inner NCCL all-reduce) as the baseline
measured in the same run; ``exchanges`` counts the host-side descriptor agreements per call
(`CallAgreement.agree` wrapped: `agreements`). The group's config is the environment's with
``min_size`` 1 and the cost model off. At world size 1 nothing crosses a wire: a compressed call
is two encodes and two decodes plus the bookkeeping, which is what this counts.

    python benchmarks/cuda_launches.py [--sizes 65536 1048576 16777216] [--iters 50] [--names]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import tempfile
import time
from typing import Any

_AGREEMENTS: list[int] | None = None
"""This process's descriptor agreements since `agreements` was first called (one entry each)."""


def device_events(prof: Any) -> tuple[dict[str, int], collections.Counter]:
    """Kernels, memsets and copies the GPU ran in the torch.profiler ``prof``, and how often
    each name ran."""
    import torch

    counts = {"kernels": 0, "memsets": 0, "copies": 0}
    names: collections.Counter = collections.Counter()
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name.lower()
        kind = "memsets" if "memset" in name else "copies" if "memcpy" in name else "kernels"
        counts[kind] += 1
        names[e.name[:90]] += 1
    return counts, names


def agreements() -> list[int]:
    """This process's descriptor agreements from the first call on, one entry each: the first
    call wraps `CallAgreement.agree` (once per process; `planned_call_goals.py` reads it too)."""
    global _AGREEMENTS
    if _AGREEMENTS is None:
        from lowbitcc.backend.call_agreement import CallAgreement

        seen: list[int] = []
        agree = CallAgreement.agree

        def counted(self: Any, call: Any) -> Any:
            seen.append(1)
            return agree(self, call)

        CallAgreement.agree = counted
        _AGREEMENTS = seen
    return _AGREEMENTS


def _row(x: Any, mode: str, iters: int, profiled: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import lowbitcc

    ctx = lowbitcc.compressed if mode == "compressed" else lowbitcc.exact
    seen = agreements()

    def call() -> None:
        with ctx():
            dist.all_reduce(x)
        lowbitcc.end_step()

    for _ in range(70):  # past the call schedule's learning and the descriptor's first uses
        call()
    torch.cuda.synchronize()
    before = len(seen)
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    t1 = time.perf_counter()
    exchanges = (len(seen) - before) / iters
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(profiled):
            call()
        torch.cuda.synchronize()
    counts, names = device_events(prof)
    per_call = {k: v / profiled for k, v in counts.items()}
    return {"numel": x.numel(), "mode": mode, "host_us": (t1 - t0) / iters * 1e6,
            "with_gpu_us": (t2 - t0) / iters * 1e6, "exchanges": exchanges, **per_call,
            "names": {n: c / profiled for n, c in names.most_common()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[65536, 1 << 20, 1 << 24])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--profiled", type=int, default=10)
    parser.add_argument("--names", action="store_true",
                        help="also list what the GPU ran per compressed call, by name")
    opts = parser.parse_args()
    import torch
    import torch.distributed as dist

    import lowbitcc

    agreements()
    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as tmp:
        config = lowbitcc.LocoConfig.from_env().replace(min_size=1, cost_model=False)
        dist.init_process_group(
            "loco", init_method=f"file://{tmp}/store", rank=0, world_size=1,
            pg_options=config, device_id=torch.device("cuda", 0))
        print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
        print(f"{'elements':>10} {'mode':>10} {'host us':>9} {'+gpu us':>9} {'exchanges':>9} "
              f"{'kernels':>8} {'memsets':>8} {'copies':>7}")
        try:
            for numel in opts.sizes:
                x = torch.randn(numel, device="cuda")
                for mode in ("compressed", "exact"):
                    r = _row(x, mode, opts.iters, opts.profiled)
                    print(f"{numel:>10} {mode:>10} {r['host_us']:>9.1f} {r['with_gpu_us']:>9.1f} "
                          f"{r['exchanges']:>9.2f} {r['kernels']:>8.1f} {r['memsets']:>8.1f} "
                          f"{r['copies']:>7.1f}", flush=True)
                    if opts.names and mode == "compressed":
                        for name, per in r["names"].items():
                            print(f"{'':>12}{per:>5.1f} x {name}")
        finally:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


if __name__ == "__main__":
    main()
