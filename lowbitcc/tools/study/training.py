"""One training run of the study: a variant on one rank (DDP or FSDP2), and the run of a variant
on ``cfg.world`` fresh local ranks."""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

import lowbitcc
from lowbitcc import state
from lowbitcc.tools.spawn import run_ranks
from lowbitcc.tools.study.formats import LAB_VARIANTS, LabState, lab_hook
from lowbitcc.tools.study.model import optimizer
from lowbitcc.tools.study.tasks import Batch, Task, task
from lowbitcc.tools.study.variants import StudyConfig, Variant

GROUP_TIMEOUT_S = 1800.0
"""The process group's timeout in a study's run: long enough that a run survives its ranks
being paused (SIGSTOP) while the machine times other work or runs the test suite (at 600 s a
run paused for 12 minutes died in gloo's send); a hang is still ended by it."""
RUN_TIMEOUT_S = 3600.0
"""The limit of a 300-step run (killed and raised past it); longer runs get it in proportion."""


def ring_bytes_per_step(model: nn.Module, variant: Variant, world: int) -> float:
    """Bytes per rank per step for the gloo variants (analytic): a ring all-reduce's, and for
    the format lab a direct all-reduce's at the variant's bits per element."""
    ring = 2 * (world - 1) / world
    if variant.hook == "fp16":
        return ring * 2 * sum(p.numel() for p in model.parameters())
    if variant.hook == "powersgd":
        total = 0
        for p in model.parameters():
            if p.dim() >= 2:
                n, m = p.shape[0], p.numel() // p.shape[0]
                total += 4 * min(2 * (n + m), n * m)  # P and Q of rank 2, unless larger
            else:
                total += 4 * p.numel()
        return ring * total
    if variant.hook == "lab":
        return ring * LAB_VARIANTS[variant.name].bits_per_element / 8 * sum(
            p.numel() for p in model.parameters())
    return ring * 4 * sum(p.numel() for p in model.parameters()) / max(1, variant.outer_every)


def whole_shares(batches: int, world: int) -> int:
    """``batches`` rounded up to a multiple of ``world``."""
    return -(-batches // world) * world


def wrap(model: nn.Module, variant: Variant, seed: int) -> nn.Module:
    """``model`` under FSDP2 (``fully_shard`` per block) or DDP with the variant's hook; as it is
    for a DiLoCo variant (each rank a site)."""
    if variant.outer_every:
        return model
    if variant.fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in getattr(model, "blocks", []):
            fully_shard(block)
        return fully_shard(model)
    from torch.nn.parallel import DistributedDataParallel as DDP

    # PowerSGD's hook issues a bucket's second and third all-reduce from the future
    # callbacks of its first. DDP's default small first bucket makes two buckets, and
    # when the ranks drift apart in time they issue those calls in different orders:
    # gloo aborts ("Received data size doesn't match expected size"). One bucket (an
    # explicit cap turns the small first bucket off) leaves one order.
    ddp = DDP(model, bucket_cap_mb=64 if variant.hook == "powersgd" else None)
    if variant.hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif variant.hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=10,
            random_seed=seed)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif variant.hook == "lab":
        ddp.register_comm_hook(LabState(LAB_VARIANTS[variant.name], seed), lab_hook)
    return ddp


def outer_sync(model: nn.Module, variant: Variant) -> lowbitcc.OuterSync | None:
    """A DiLoCo variant's outer synchronisation over the default group (compressed always on
    "loco", exact on gloo); None for the others."""
    if not variant.outer_every:
        return None
    return lowbitcc.OuterSync(model.parameters(), every=variant.outer_every, lr=variant.outer_lr,
                              momentum=variant.outer_momentum,
                              compress="always" if variant.backend == "loco" else "never")


def evaluate(model: nn.Module, job: Task, batches: list[Batch],
             metrics: dist.ProcessGroup) -> tuple[float, float | None]:
    """Mean validation loss over ``batches`` (a whole number of shares) and, for a classifier,
    the fraction of their examples classified right.

    Rank r takes batches r, r + world, ...: the same count on every rank (FSDP2's forward
    all-gathers), the mean over all of them on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model.eval()
    mine = batches[rank::world]
    with torch.no_grad():
        total = torch.tensor([sum(float(job.loss(model, x, y)) for x, y in mine),
                              sum(job.correct(model, x, y) for x, y in mine)
                              if job.classifier else 0.0,
                              sum(len(y) for _, y in mine)], dtype=torch.float64)
    dist.all_reduce(total, group=metrics)
    model.train()
    accuracy = float(total[1] / total[2]) if job.classifier else None
    return float(total[0]) / (len(mine) * world), accuracy


def train_rank(rank: int, world: int, variant: Variant, cfg: StudyConfig,
               seed: int) -> dict[str, Any] | None:
    """Train on the initialised default group (the variant's backend); rank 0 returns the
    record (losses, time, wire bytes per step, final parameters), the others None. A DiLoCo
    variant's evaluations before the last step average the sites' own replicas."""
    metrics = dist.new_group(backend="gloo")
    job = task(cfg)
    torch.manual_seed(seed)
    model = wrap(job.model(), variant, seed)
    opt, sched = optimizer(model.parameters(), cfg)
    outer = outer_sync(model, variant)
    val = job.val_batches(whole_shares(max(cfg.eval_batches, cfg.final_eval_batches), world))
    lowbitcc.reset_stats()
    train_loss: list[float] = []
    val_loss: list[tuple[int, float]] = []
    val_accuracy: list[tuple[int, float | None]] = []

    # rank 0 shows progress: a bar on a terminal, else a line per evaluation (a run in the
    # background, its stderr a file, says how far it is every `eval_every` steps)
    bar = tqdm(total=cfg.steps, desc=f"{variant.name} seed {seed}", leave=False,
               disable=rank != 0 or not sys.stderr.isatty())
    lines = rank == 0 and bar.disable

    def record(step: int, batches: int) -> None:
        loss, accuracy = evaluate(model, job, val[:whole_shares(batches, world)], metrics)
        val_loss.append((step, loss))
        val_accuracy.append((step, accuracy))
        if lines and step:
            print(f"{variant.name} seed {seed}, {world} ranks: step {step}/{cfg.steps}, "
                  f"validation loss {loss:.4f}, {time.perf_counter() - start:.0f} s",
                  file=sys.stderr, flush=True)
    start = time.perf_counter()
    for step, (x, y) in enumerate(job.train_batches(seed, rank)):
        if step % cfg.eval_every == 0:
            record(step, cfg.eval_batches)
        loss = job.loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step < variant.feedback_warmup:
            state.FEEDBACK.clear()
        if outer is not None:
            outer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=metrics)
        train_loss.append(float(mean) / world)
        bar.update(1)
        bar.set_postfix(loss=f"{train_loss[-1]:.3f}")
    record(cfg.steps, cfg.final_eval_batches)
    elapsed = time.perf_counter() - start
    bar.close()
    inner = model.module if hasattr(model, "module") else model
    if variant.backend == "loco":
        s = lowbitcc.stats()
        wire = (s["compressed"]["wire_bytes"] + s["exact"]["wire_bytes"]) / cfg.steps
    else:
        wire = ring_bytes_per_step(inner, variant, world)
    params = torch.cat([p.detach().full_tensor().reshape(-1) if hasattr(p, "full_tensor")
                        else p.detach().reshape(-1) for p in inner.parameters()])
    if rank != 0:
        return None
    return {"variant": variant.name, "seed": seed, "train_loss": train_loss,
            "val_loss": val_loss, **({"val_accuracy": val_accuracy} if job.classifier else {}),
            "seconds": elapsed, "wire_bytes_per_step": wire,
            "parameters": sum(p.numel() for p in inner.parameters()), "final_params": params}


def run_variant(variant: Variant, cfg: StudyConfig, seed: int,
                threads: int | None = None) -> dict[str, Any]:
    """Train ``variant`` on ``cfg.world`` fresh local ranks (``threads`` torch threads each,
    default `lowbitcc.tools.spawn.threads_per_rank`); returns its record (rank 0's)."""
    return run_ranks(train_rank, cfg.world, variant, cfg, seed, backend=variant.backend,
                     env=dict(variant.env), pg_timeout_s=GROUP_TIMEOUT_S,
                     timeout_s=RUN_TIMEOUT_S * max(1.0, cfg.steps / 300), threads=threads)[0]
