"""`lowbitcc demo`: DDP over "loco" and over the exact backend, side by side, in the same processes.

Each rank builds two identical MLPs from the same seed; one is wrapped in DDP over a "loco"
group, the other over the device's exact backend (gloo on the CPU, nccl on a GPU). Both see
the same batches. Rank 0 prints, per step, the loss of each, the time of each step, and at the
end what the cost model decided, the bytes each put on the wire and the speed of each. The
demo runs on local ranks over loopback (where compression rarely pays and the cost model sends
the calls exact), then, on the CPU and where this machine can emulate a slow network (root,
``ip`` and ``tc``: `lowbitcc.tools.netem`), once more with every rank behind a link of
``link`` (1 Gbit/s by default), where compression pays.

``device`` "auto" trains on GPUs where torch sees one and has NCCL (each rank on GPU
``LOCAL_RANK`` or its rank, modulo the GPUs; ranks sharing one as `spawn.gpu_rank_env` places
them), else on the CPU. (On a GPU, written 2026-11-27 and not yet run on one: docs/gpu.md.)
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lowbitcc
from lowbitcc.backend import rendezvous
from lowbitcc.tools import netem, spawn
from lowbitcc.tools.spawn import launch


def _model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(128, width), nn.GELU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    layers.append(nn.Linear(width, 16))
    return nn.Sequential(*layers)


def _rank_main(rank: int, world: int, steps: int, width: int, depth: int,
               gpu: bool = False) -> None:
    device = spawn.local_gpu(rank) if gpu else torch.device("cpu")
    exact = "nccl" if gpu else "gloo"  # the device's exact backend, the reference
    gloo = dist.new_group(backend="gloo")  # the printed losses' mean
    groups = {exact: dist.new_group(backend=exact), "loco": dist.new_group(backend="loco")}
    ids = [device.index] if gpu else None
    models = {k: DDP(_model(width, depth).to(device), device_ids=ids, process_group=g)
              for k, g in groups.items()}
    opts = {k: torch.optim.Adam(m.parameters(), lr=1e-3) for k, m in models.items()}
    teacher = torch.randn(128, 16, generator=torch.Generator().manual_seed(7))
    data = torch.Generator().manual_seed(100 + rank)
    params = sum(p.numel() for p in models["loco"].parameters())
    if rank == 0:
        print(f"lowbitcc demo: {world} ranks on {'GPUs' if gpu else 'the CPU'}, MLP of "
              f"{params / 1e6:.2f} M parameters, gradients {params * 4 / 2**20:.1f} MiB fp32 per "
              f"step; loco at {lowbitcc.LocoConfig.from_env().bits} bits")
        print(f"{'step':>5} {'loss ' + exact:>11} {'loss loco':>11} {'ms ' + exact:>9} "
              f"{'ms loco':>9}")
    times = {exact: 0.0, "loco": 0.0}
    late = {exact: 0.0, "loco": 0.0}  # the second half of the steps
    lowbitcc.reset_stats()
    for step in range(steps):
        x = torch.randn(64, 128, generator=data)
        y = torch.tanh(x @ teacher)
        x, y = x.to(device), y.to(device)
        row = {}
        # Alternate which model goes first, so that neither always finds the caches the other
        # left, nor always runs right after the loss all-reduce.
        for name in (exact, "loco") if step % 2 == 0 else ("loco", exact):
            model = models[name]
            start = time.perf_counter()
            loss = nn.functional.mse_loss(model(x), y)
            opts[name].zero_grad()
            loss.backward()
            opts[name].step()
            if gpu:
                torch.cuda.synchronize(device)  # the step's time is the GPU's too
            elapsed = time.perf_counter() - start
            times[name] += elapsed
            if step >= steps // 2:
                late[name] += elapsed
            mean = loss.detach().to("cpu", copy=True)
            dist.all_reduce(mean, op=dist.ReduceOp.AVG, group=gloo)
            row[name] = (float(mean), elapsed * 1e3)
        if rank == 0 and (step % max(1, steps // 20) == 0 or step == steps - 1):
            print(f"{step:>5} {row[exact][0]:>11.5f} {row['loco'][0]:>11.5f} "
                  f"{row[exact][1]:>9.1f} {row['loco'][1]:>9.1f}")
    if rank == 0:
        _report(exact, world, params, steps, times, late)


def _report(exact: str, world: int, params: int, steps: int, times: dict[str, float],
            late: dict[str, float]) -> None:
    """Rank 0's closing lines: the cost model's decisions, bytes, step times, error."""
    stats = lowbitcc.stats()
    s = stats["compressed"]
    print(f"cost model: {s['calls']} gradient all-reduces compressed, "
          f"{stats['exact']['model_exact']} sent exact because exact was faster here "
          "(LOCO_COST_MODEL=0 compresses them all)")
    exact_bytes = 2 * (world - 1) / world * params * 4 * steps
    t = stats["total"]
    print(f"wire bytes per rank: {exact} {exact_bytes / 2**20:.1f} MiB (ring estimate), "
          f"loco {t['wire_bytes'] / 2**20:.1f} MiB for {t['logical_bytes'] / 2**20:.1f} MiB "
          f"logical over all calls, exact ones at their ring volume (ratio {t['ratio']:.3f}, "
          f"{1 / t['ratio'] if t['ratio'] else 0:.1f}x less; the compressed calls alone "
          f"{s['ratio']:.3f})")
    print(f"mean step: {exact} {times[exact] / steps * 1e3:.1f} ms, "
          f"loco {times['loco'] / steps * 1e3:.1f} ms (codec {s['codec_s'] / steps * 1e3:.1f} ms, "
          f"wire {s['wire_s'] / steps * 1e3:.1f} ms per step)")
    half = steps - steps // 2
    print(f"mean step over the last {half} steps (the cost model has settled): {exact} "
          f"{late[exact] / half * 1e3:.1f} ms, loco {late['loco'] / half * 1e3:.1f} ms "
          f"({late[exact] / late['loco'] if late['loco'] else 0:.2f}x {exact}'s speed)")
    print(f"quantization relative error (RMS over calls): {s['relative_error']:.4f}")


def uses_gpu(device: str) -> bool:
    """Whether the demo trains on GPUs: ``device`` "cuda" (refused without a usable GPU), or
    "auto" where torch sees a GPU and has NCCL."""
    usable = torch.cuda.is_available() and dist.is_nccl_available()
    if device == "cuda" and not usable:
        raise ValueError("lowbitcc demo --device cuda: needs a GPU and torch with NCCL")
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"lowbitcc demo: --device must be auto, cpu or cuda, got {device!r}")
    return device == "cuda" or (device == "auto" and usable)


def run(nprocs: int = 2, steps: int = 40, width: int = 512, depth: int = 3,
        link: str | None = "1gbit", device: str = "auto") -> int:
    """Run the demo on ``nprocs`` local ranks (or on the ranks of a launcher that started us),
    then, on the CPU, with ``link`` and where `netem` can, on ``nprocs`` ranks behind links of
    that rate. ``device``: see `uses_gpu`. Returns the exit status."""
    gpu = uses_gpu(device)
    launched = rendezvous.detect() is not None
    if not launched:
        print(f"== on local ranks over loopback{', on GPUs' if gpu else ''} ==", flush=True)
    status = launch(_rank_main, nprocs, None, [], steps, width, depth, gpu, gpu=gpu)
    if launched or status or not link:
        return status
    if gpu:
        print("(the emulated link runs on the CPU: `lowbitcc demo --device cpu`; on GPUs, "
              "`lowbitcc bench-train --device cuda --link RATE`)")
        return 0
    missing = netem.missing_requirements()
    if missing:
        print(f"(an emulated {link} link would show where compression pays; this machine lacks "
              + "; ".join(missing) + ")")
        return 0
    print(f"\n== each rank behind an emulated {link} link (tc) ==", flush=True)
    argv = ["demo", "--np", str(nprocs), "--steps", str(steps), "--width", str(width),
            "--depth", str(depth), "--device", "cpu"]
    return launch(_rank_main, nprocs, link, argv, steps, width, depth)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`lowbitcc demo`'s options, its command the parser's ``func``."""
    parser.add_argument("--np", type=int, default=2, help="local ranks to start (default 2)")
    parser.add_argument("--steps", type=int, default=40,
                        help="training steps (default 40; about 20 of them printed)")
    parser.add_argument("--width", type=int, default=512, help="hidden width of the MLP")
    parser.add_argument("--depth", type=int, default=3, help="hidden layers of the MLP")
    parser.add_argument("--link", default="1gbit",
                        help="after loopback, run again behind emulated links of this rate where "
                        "the machine allows it (root, ip, tc); none: loopback only (default 1gbit)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="train on GPUs where there are (auto; against nccl) or on the CPU "
                             "(against gloo)")
    parser.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    """`lowbitcc demo`: its exit status (2 with the error logged for a device it cannot use)."""
    try:
        return run(nprocs=args.np, steps=args.steps, width=args.width, depth=args.depth,
                   link=None if args.link == "none" else args.link, device=args.device)
    except ValueError as exc:
        logging.getLogger("lowbitcc").error("%s", exc)
        return 2
