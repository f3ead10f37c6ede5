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
from lowbitcc.tools.spawn import run_ranks
from lowbitcc.tools.study.formats import LAB_VARIANTS, LabState, lab_hook
from lowbitcc.tools.study.model import (
    TinyGPT,
    lm_loss,
    optimizer,
    sample_batch,
    split_corpus,
    train_batches,
)
from lowbitcc.tools.study.variants import StudyConfig, Variant

GROUP_TIMEOUT_S = 600.0
RUN_TIMEOUT_S = 3600.0


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

        for block in model.blocks:
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


def evaluate(model: nn.Module, val: torch.Tensor, starts: list[torch.Tensor], cfg: StudyConfig,
             batches: int, metrics: dist.ProcessGroup) -> float:
    """Mean validation loss over the first ``batches`` (rounded up to whole shares) of ``starts``.

    Rank r takes batches r, r + world, ...: the same count on every rank (FSDP2's forward
    all-gathers), the mean over all of them on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model.eval()
    mine = starts[rank:whole_shares(batches, world):world]
    with torch.no_grad():
        total = torch.tensor(sum(float(lm_loss(model, *sample_batch(val, s, cfg.context)))
                                 for s in mine), dtype=torch.float64)
    dist.all_reduce(total, group=metrics)
    model.train()
    return float(total) / (len(mine) * world)


def train_rank(rank: int, world: int, variant: Variant, cfg: StudyConfig,
               seed: int) -> dict[str, Any] | None:
    """Train on the initialised default group (the variant's backend); rank 0 returns the
    record (losses, time, wire bytes per step, final parameters), the others None. A DiLoCo
    variant's evaluations before the last step average the sites' own replicas."""
    metrics = dist.new_group(backend="gloo")
    train, val = split_corpus(cfg)
    torch.manual_seed(seed)
    model = wrap(TinyGPT(cfg), variant, seed)
    opt, sched = optimizer(model.parameters(), cfg)
    outer = outer_sync(model, variant)
    val_gen = torch.Generator().manual_seed(12345)
    val_starts = [torch.randint(len(val) - cfg.context - 1, (cfg.batch,), generator=val_gen)
                  for _ in range(whole_shares(max(cfg.eval_batches, cfg.final_eval_batches),
                                              world))]
    lowbitcc.reset_stats()
    train_loss: list[float] = []
    val_loss: list[tuple[int, float]] = []
    start = time.perf_counter()
    bar = tqdm(total=cfg.steps, desc=f"{variant.name} seed {seed}", leave=False,
               disable=rank != 0 or not sys.stderr.isatty())
    for step, (x, y) in enumerate(train_batches(train, cfg, seed, rank)):
        if step % cfg.eval_every == 0:
            val_loss.append((step, evaluate(model, val, val_starts, cfg, cfg.eval_batches,
                                            metrics)))
        loss = lm_loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if outer is not None:
            outer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=metrics)
        train_loss.append(float(mean) / world)
        bar.update(1)
        bar.set_postfix(loss=f"{train_loss[-1]:.3f}")
    val_loss.append((cfg.steps, evaluate(model, val, val_starts, cfg, cfg.final_eval_batches,
                                         metrics)))
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
            "val_loss": val_loss, "seconds": elapsed, "wire_bytes_per_step": wire,
            "parameters": sum(p.numel() for p in inner.parameters()), "final_params": params}


def run_variant(variant: Variant, cfg: StudyConfig, seed: int) -> dict[str, Any]:
    """Train ``variant`` on ``cfg.world`` fresh local ranks; returns its record (rank 0's)."""
    return run_ranks(train_rank, cfg.world, variant, cfg, seed, backend=variant.backend,
                     env=dict(variant.env), pg_timeout_s=GROUP_TIMEOUT_S,
                     timeout_s=RUN_TIMEOUT_S)[0]
