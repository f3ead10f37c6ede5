"""`lowbitcc demo`: DDP over "loco" and over gloo, side by side, in the same processes.

Each rank builds two identical MLPs from the same seed; one is wrapped in DDP over a "loco"
group, the other over a gloo group. Both see the same batches. Rank 0 prints, per step, the
loss of each, the time of each step, and at the end what the cost model decided, the bytes each
put on the wire and the speed of each. The demo runs on local ranks over loopback (where
compression rarely pays and the cost model sends the calls exact), then, where this machine can
emulate a slow network (root, ``ip`` and ``tc``: `lowbitcc.tools.netem`), once more with every
rank behind a link of ``link`` (1 Gbit/s by default), where compression pays.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lowbitcc
from lowbitcc.backend import rendezvous
from lowbitcc.tools import netem
from lowbitcc.tools.spawn import launch


def _model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(128, width), nn.GELU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    layers.append(nn.Linear(width, 16))
    return nn.Sequential(*layers)


def _rank_main(rank: int, world: int, steps: int, width: int, depth: int) -> None:
    gloo = dist.new_group(backend="gloo")
    loco = dist.new_group(backend="loco")
    models = {"gloo": DDP(_model(width, depth), process_group=gloo),
              "loco": DDP(_model(width, depth), process_group=loco)}
    opts = {k: torch.optim.Adam(m.parameters(), lr=1e-3) for k, m in models.items()}
    teacher = torch.randn(128, 16, generator=torch.Generator().manual_seed(7))
    data = torch.Generator().manual_seed(100 + rank)
    params = sum(p.numel() for p in models["loco"].parameters())
    if rank == 0:
        print(f"lowbitcc demo: {world} ranks, MLP of {params / 1e6:.2f} M parameters, "
              f"gradients {params * 4 / 2**20:.1f} MiB fp32 per step; loco at "
              f"{lowbitcc.LocoConfig.from_env().bits} bits")
        print(f"{'step':>5} {'loss gloo':>11} {'loss loco':>11} {'ms gloo':>9} {'ms loco':>9}")
    times = {"gloo": 0.0, "loco": 0.0}
    late = {"gloo": 0.0, "loco": 0.0}  # the second half of the steps
    lowbitcc.reset_stats()
    for step in range(steps):
        x = torch.randn(64, 128, generator=data)
        y = torch.tanh(x @ teacher)
        row = {}
        # Alternate which model goes first, so that neither always finds the caches the other
        # left, nor always runs right after the loss all-reduce.
        for name in ("gloo", "loco") if step % 2 == 0 else ("loco", "gloo"):
            model = models[name]
            start = time.perf_counter()
            loss = nn.functional.mse_loss(model(x), y)
            opts[name].zero_grad()
            loss.backward()
            opts[name].step()
            elapsed = time.perf_counter() - start
            times[name] += elapsed
            if step >= steps // 2:
                late[name] += elapsed
            mean = loss.detach().clone()
            dist.all_reduce(mean, op=dist.ReduceOp.AVG, group=gloo)
            row[name] = (float(mean), elapsed * 1e3)
        if rank == 0 and (step % max(1, steps // 20) == 0 or step == steps - 1):
            print(f"{step:>5} {row['gloo'][0]:>11.5f} {row['loco'][0]:>11.5f} "
                  f"{row['gloo'][1]:>9.1f} {row['loco'][1]:>9.1f}")
    stats = lowbitcc.stats()
    s = stats["compressed"]
    if rank == 0:
        print(f"cost model: {s['calls']} gradient all-reduces compressed, "
              f"{stats['exact']['model_exact']} sent exact because exact was faster here "
              "(LOCO_COST_MODEL=0 compresses them all)")
        gloo_bytes = 2 * (world - 1) / world * params * 4 * steps
        t = stats["total"]
        print(f"wire bytes per rank: gloo {gloo_bytes / 2**20:.1f} MiB (ring estimate), "
              f"loco {t['wire_bytes'] / 2**20:.1f} MiB for {t['logical_bytes'] / 2**20:.1f} MiB "
              f"logical over all calls, exact ones at their ring volume (ratio {t['ratio']:.3f}, "
              f"{1 / t['ratio'] if t['ratio'] else 0:.1f}x less; the compressed calls alone "
              f"{s['ratio']:.3f})")
        print(f"mean step: gloo {times['gloo'] / steps * 1e3:.1f} ms, "
              f"loco {times['loco'] / steps * 1e3:.1f} ms (codec {s['codec_s'] / steps * 1e3:.1f} ms, "
              f"wire {s['wire_s'] / steps * 1e3:.1f} ms per step)")
        half = steps - steps // 2
        print(f"mean step over the last {half} steps (the cost model has settled): gloo "
              f"{late['gloo'] / half * 1e3:.1f} ms, loco {late['loco'] / half * 1e3:.1f} ms "
              f"({late['gloo'] / late['loco'] if late['loco'] else 0:.2f}x gloo's speed)")
        print(f"quantization relative error (RMS over calls): {s['relative_error']:.4f}")


def run(nprocs: int = 2, steps: int = 40, width: int = 512, depth: int = 3,
        link: str | None = "1gbit") -> int:
    """Run the demo on ``nprocs`` local ranks (or on the ranks of a launcher that started us),
    then, with ``link`` and where `netem` can, on ``nprocs`` ranks behind links of that rate.
    Returns the exit status."""
    launched = rendezvous.detect() is not None
    if not launched:
        print("== on local ranks over loopback ==", flush=True)
    status = launch(_rank_main, nprocs, None, [], steps, width, depth)
    if launched or status or not link:
        return status
    missing = netem.missing_requirements()
    if missing:
        print(f"(an emulated {link} link would show where compression pays; this machine lacks "
              + "; ".join(missing) + ")")
        return 0
    print(f"\n== each rank behind an emulated {link} link (tc) ==", flush=True)
    argv = ["demo", "--np", str(nprocs), "--steps", str(steps), "--width", str(width),
            "--depth", str(depth)]
    return launch(_rank_main, nprocs, link, argv, steps, width, depth)
