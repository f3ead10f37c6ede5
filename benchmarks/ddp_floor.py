"""DDP over "loco" with its calls exact, against DDP over gloo and over the floor of any Python
process group: one that only forwards each call to a gloo group of its own.

Feeds docs/performance.md, "Training end to end" (its "DDP on loopback": the pass-through group
and loco against gloo's step rate).

A process group written in Python costs DDP something on every bucket whatever it does: the
reducer calls it from C++ through the GIL, in the thread that runs backward, while gloo's
threads reduce the bucket before it on the same cores. This measures that floor beside loco, so
that loco's own per-call cost (its call schedule, counting, the Work it returns) is what
separates the two. Each rank builds the demo's MLP three times from one seed, wrapped in DDP
over a gloo group, a "loco" group (the environment's settings) and the pass-through group; the
three take turns on the same batches, in a rotating order, and the mean step time after
``--warmup`` steps is printed with each one's speed against gloo's (rank 0's clock).

    python benchmarks/ddp_floor.py [--steps 300] [--warmup 100] [--np 2]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

PASS_THROUGH = "lowbitcc-bench-pass-through"
"""The floor's backend name (registered in each rank)."""


def _pass_through(store: Any, rank: int, size: int, timeout: Any) -> Any:
    """A Python process group that forwards each call DDP makes to a gloo group of its own (the
    class made here, so that torch is imported only in the ranks)."""
    import torch
    import torch.distributed as dist

    class PassThrough(dist.ProcessGroup):
        def __init__(self) -> None:
            super().__init__(rank, size)
            self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("pass-through", store), rank,
                                               size, timeout)

        def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
            return self._gloo.allreduce(tensors, opts or dist.AllreduceOptions())

        def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
            return self._gloo.broadcast(tensors, opts or dist.BroadcastOptions())

        def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                      opts: Any = None) -> dist.Work:
            return self._gloo.allgather(outputs, inputs, opts or dist.AllgatherOptions())

        def barrier(self, opts: Any = None) -> dist.Work:
            return self._gloo.barrier(opts or dist.BarrierOptions())

        def getBackendName(self) -> str:  # noqa: N802 (c10d's name)
            return PASS_THROUGH

    return PassThrough()


def _model() -> Any:
    """The demo's MLP (`lowbitcc.tools.demo`): 0.86 M parameters, two DDP buckets."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(128, 512), nn.GELU()]
    for _ in range(3):
        layers += [nn.Linear(512, 512), nn.GELU()]
    layers.append(nn.Linear(512, 16))
    return nn.Sequential(*layers)


def _rank(rank: int, world: int, steps: int, warmup: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lowbitcc

    if PASS_THROUGH not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            PASS_THROUGH, lambda o, _opts=None: _pass_through(o.store, o.group_rank, o.group_size,
                                                              o.timeout),
            extended_api=True, devices=["cpu"])
    groups = {"gloo": dist.new_group(backend="gloo"),
              "loco": dist.new_group(backend="loco",
                                     pg_options=lowbitcc.LocoConfig.from_env()),
              "pass-through": dist.new_group(backend=PASS_THROUGH)}
    models = {name: DDP(_model(), process_group=g) for name, g in groups.items()}
    optims = {name: torch.optim.Adam(m.parameters(), lr=1e-3) for name, m in models.items()}
    names = list(models)
    data = torch.Generator().manual_seed(rank)
    total = dict.fromkeys(names, 0.0)
    for step in range(steps):
        x = torch.randn(64, 128, generator=data)
        for name in names[step % 3:] + names[:step % 3]:
            start = time.perf_counter()
            loss = models[name](x).square().mean()
            optims[name].zero_grad()
            loss.backward()
            optims[name].step()
            if step >= warmup:
                total[name] += time.perf_counter() - start
            lowbitcc.end_step()
    return {name: t / (steps - warmup) for name, t in total.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--np", type=int, default=2)
    args = parser.parse_args()
    from lowbitcc.tools import spawn

    result = spawn.run_ranks(_rank, args.np, args.steps, args.warmup, backend="gloo")[0]
    print(f"{'process group':>14} {'ms/step':>8} {'x gloo':>7}")
    for name, seconds in result.items():
        print(f"{name:>14} {seconds * 1e3:>8.2f} {result['gloo'] / seconds:>7.3f}")


if __name__ == "__main__":
    main()
