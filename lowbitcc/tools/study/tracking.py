"""How far each compressed all-reduce lands from exact on one and the same gradient stream.

A training run's final loss mixes the compressor's error with where its own trajectory went.
This measurement removes the second part: the study's model trains with exact (gloo) gradients,
and at every step the same per-rank gradients (all parameters' in one flat tensor, divided by
the ranks as DDP does; DDP itself would send two buckets) are also all-reduced by each "loco"
configuration, each on its own process group with its own error state. Per configuration it
records, against the exact all-reduce of the same step:

- ``step_error``: ``|c_t - x_t| / |x_t|``, the error of one call;
- ``sum_error``: ``|sum c - sum x| / |sum x|`` over the steps so far, the bias that error
  feedback exists to remove (without feedback it stays; with it, it telescopes away);
- ``adam_error``: the relative distance of Adam's update direction ``m_hat / (sqrt(v_hat) +
  eps)`` (betas 0.9 and 0.999, eps 1e-8, as `torch.optim.AdamW`) fed with ``c`` from the one fed
  with ``x``: what the optimizer of the study actually acts on.

All ranks hold the same reduced values, so rank 0 measures alone.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import lowbitcc
from lowbitcc.config import LocoConfig
from lowbitcc.tools.plotting import pyplot
from lowbitcc.tools.spawn import run_ranks
from lowbitcc.tools.study.formats import LAB_VARIANTS, LabState
from lowbitcc.tools.study.model import TinyGPT, lm_loss, optimizer, split_corpus, train_batches
from lowbitcc.tools.study.variants import VARIANTS, StudyConfig, check_trackable

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


class _ShadowAdam:
    """Adam's moments of one gradient stream (flat fp32); `direction` is its update direction."""

    def __init__(self, numel: int) -> None:
        self.m = torch.zeros(numel)
        self.v = torch.zeros(numel)
        self.t = 0

    def direction(self, grad: torch.Tensor) -> torch.Tensor:
        b1, b2 = ADAM_BETAS
        self.t += 1
        self.m.mul_(b1).add_(grad, alpha=1 - b1)
        self.v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        v_hat = self.v / (1 - b2 ** self.t)
        return (self.m / (1 - b1 ** self.t)) / (v_hat.sqrt_().add_(ADAM_EPS))


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _track_rank(rank: int, world: int, names: list[str], cfg: StudyConfig,
                seed: int) -> dict[str, dict[str, list[float]]] | None:
    """Train with exact gradients on the initialised gloo group and replay them through every
    tracked "loco" group (and format-lab variant: its two stages around an exact all-reduce);
    rank 0 returns the series."""
    configs = {name: LocoConfig.from_env(dict(VARIANTS[name].env)) for name in names
               if name not in LAB_VARIANTS}
    groups = {name: dist.new_group(backend="loco", pg_options=config)
              for name, config in configs.items()}
    labs = {name: LabState(LAB_VARIANTS[name], seed) for name in names if name in LAB_VARIANTS}
    train, _ = split_corpus(cfg)
    torch.manual_seed(seed)
    model = TinyGPT(cfg)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    opt, sched = optimizer(params, cfg)
    exact_adam = _ShadowAdam(numel)
    adams = {name: _ShadowAdam(numel) for name in names}
    exact_sum = torch.zeros(numel)
    sums = {name: torch.zeros(numel) for name in names}
    series: dict[str, dict[str, list[float]]] = {
        name: {"step_error": [], "sum_error": [], "adam_error": []} for name in names}
    for x, y in train_batches(train, cfg, seed, rank):
        opt.zero_grad(set_to_none=True)
        lm_loss(model, x, y).backward()
        local = torch.cat([p.grad.reshape(-1) for p in params]).div_(world)
        exact = local.clone()
        dist.all_reduce(exact)
        exact_sum += exact
        exact_direction = exact_adam.direction(exact)
        for name in names:
            got = local.clone()
            if name in labs:
                got = labs[name].apply(0, "rs", got)
                dist.all_reduce(got)
                got = labs[name].apply(0, "ag", got)
            else:
                with lowbitcc.compressed(), lowbitcc.feedback_key(name):
                    dist.all_reduce(got, group=groups[name])
            sums[name] += got
            record = series[name]
            record["step_error"].append(_relative(got, exact))
            record["sum_error"].append(_relative(sums[name], exact_sum))
            record["adam_error"].append(_relative(adams[name].direction(got), exact_direction))
        offset = 0
        for p in params:
            p.grad.copy_(exact[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        opt.step()
        sched.step()
    return series if rank == 0 else None


def run(names: list[str], cfg: StudyConfig, seed: int = 0) -> dict[str, Any]:
    """Track ``names`` (study variants over "loco" with DDP) for ``cfg.steps`` steps on
    ``cfg.world`` fresh local ranks. Returns ``{"config", "seed", "series", "summary"}``:
    per variant the three series above, and a summary row with each error's mean over the
    steps after the first tenth (``adam_error``, ``step_error``) or final value (``sum_error``)."""
    if cfg.steps < 1:
        raise ValueError(f"lowbitcc study: steps = {cfg.steps}; tracking needs at least 1")
    check_trackable(names)
    series = run_ranks(_track_rank, cfg.world, names, cfg, seed, backend="gloo",
                       pg_timeout_s=600.0, timeout_s=3600.0)[0]
    skip = cfg.steps // 10
    summary = []
    for name in names:
        record = series[name]
        summary.append({
            "variant": name,
            "step_error": sum(record["step_error"][skip:]) / len(record["step_error"][skip:]),
            "sum_error": record["sum_error"][-1],
            "adam_error": sum(record["adam_error"][skip:]) / len(record["adam_error"][skip:]),
        })
    return {"config": dataclasses.asdict(cfg), "seed": seed, "series": series,
            "summary": summary}


def format_table(summary: list[dict[str, Any]]) -> str:
    lines = [f"{'variant':<22} {'step error':>10} {'sum error':>10} {'Adam error':>10}"]
    for r in summary:
        lines.append(f"{r['variant']:<22} {100 * r['step_error']:>9.2f}% "
                     f"{100 * r['sum_error']:>9.2f}% {100 * r['adam_error']:>9.2f}%")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Sum error and Adam error per step of every tracked variant (matplotlib PNG)."""
    plt = pyplot("tracking plot")
    if plt is None:
        return

    fig, (ax_sum, ax_adam) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, record in result["series"].items():
        ax_sum.plot([100 * e for e in record["sum_error"]], label=name, linewidth=1)
        ax_adam.plot([100 * e for e in record["adam_error"]], label=name, linewidth=1)
    ax_sum.set(title="|sum of compressed - sum of exact| / |sum of exact|", xlabel="step",
               ylabel="%", yscale="log")
    ax_adam.set(title="Adam update direction: relative distance from exact's", xlabel="step",
                ylabel="%", yscale="log")
    for ax in (ax_sum, ax_adam):
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
