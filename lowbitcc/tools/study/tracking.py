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
  with ``x``: what the optimizer of the study actually acts on (Adam divides by the root of its
  second moment, so noise in small coordinates is amplified);
- ``step_cosine`` and ``adam_cosine``: the cosine of ``c_t`` with ``x_t``, and of the two
  update directions;
- per parameter tensor, the mean of its own ``step_error`` and ``adam_error`` after the first
  tenth of the steps (``per_tensor``): a layer the compressor hurts stands out.

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
from lowbitcc.tools.study.model import optimizer
from lowbitcc.tools.study.tasks import task
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


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


SERIES = ("step_error", "sum_error", "adam_error", "step_cosine", "adam_cosine")
"""The per-step series of each tracked variant (the module's docstring says what each is)."""


class _PerTensor:
    """Sums of each parameter tensor's step and Adam errors over the measured steps."""

    def __init__(self, names: list[str], sizes: list[int]) -> None:
        self.names, self.sizes = names, sizes
        self.sums = {name: [0.0, 0.0] for name in names}
        self.count = 0

    def add(self, got: torch.Tensor, exact: torch.Tensor, direction: torch.Tensor,
            exact_direction: torch.Tensor) -> None:
        parts = (t.split(self.sizes) for t in (got, exact, direction, exact_direction))
        for name, g, x, d, xd in zip(self.names, *parts, strict=True):
            self.sums[name][0] += _relative(g, x) if x.norm() > 0 else 0.0
            self.sums[name][1] += _relative(d, xd) if xd.norm() > 0 else 0.0
        self.count += 1

    def means(self) -> dict[str, dict[str, float]]:
        return {name: {"step_error": s / max(1, self.count), "adam_error": a / max(1, self.count)}
                for name, (s, a) in self.sums.items()}


def _track_rank(rank: int, world: int, names: list[str], cfg: StudyConfig,
                seed: int) -> dict[str, Any] | None:
    """Train with exact gradients on the initialised gloo group and replay them through every
    tracked "loco" group (and format-lab variant: its stages around an exact all-reduce, one
    stage on two ranks as its hook); rank 0 returns ``{"series", "per_tensor"}``."""
    configs = {name: LocoConfig.from_env(dict(VARIANTS[name].env)) for name in names
               if name not in LAB_VARIANTS}
    groups = {name: dist.new_group(backend="loco", pg_options=config)
              for name, config in configs.items()}
    labs = {name: LabState(LAB_VARIANTS[name], seed) for name in names if name in LAB_VARIANTS}
    job = task(cfg)
    torch.manual_seed(seed)
    model = job.model()
    named = list(model.named_parameters())
    params = [p for _, p in named]
    numel = sum(p.numel() for p in params)
    opt, sched = optimizer(params, cfg)
    exact_adam = _ShadowAdam(numel)
    adams = {name: _ShadowAdam(numel) for name in names}
    exact_sum = torch.zeros(numel)
    sums = {name: torch.zeros(numel) for name in names}
    series: dict[str, dict[str, list[float]]] = {name: {k: [] for k in SERIES} for name in names}
    per_tensor = {name: _PerTensor([n for n, _ in named], [p.numel() for p in params])
                  for name in names}
    for step, (x, y) in enumerate(job.train_batches(seed, rank)):
        opt.zero_grad(set_to_none=True)
        job.loss(model, x, y).backward()
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
                if world > 2:
                    got = labs[name].apply(0, "ag", got)
            else:
                with lowbitcc.compressed(), lowbitcc.feedback_key(name):
                    dist.all_reduce(got, group=groups[name])
            sums[name] += got
            direction = adams[name].direction(got)
            record = series[name]
            record["step_error"].append(_relative(got, exact))
            record["sum_error"].append(_relative(sums[name], exact_sum))
            record["adam_error"].append(_relative(direction, exact_direction))
            record["step_cosine"].append(_cosine(got, exact))
            record["adam_cosine"].append(_cosine(direction, exact_direction))
            if step >= cfg.steps // 10 and rank == 0:
                per_tensor[name].add(got, exact, direction, exact_direction)
        offset = 0
        for p in params:
            p.grad.copy_(exact[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        opt.step()
        sched.step()
    if rank != 0:
        return None
    return {"series": series, "per_tensor": {name: t.means() for name, t in per_tensor.items()}}


def run(names: list[str], cfg: StudyConfig, seed: int = 0) -> dict[str, Any]:
    """Track ``names`` (study variants over "loco" with DDP) for ``cfg.steps`` steps on
    ``cfg.world`` fresh local ranks. Returns ``{"config", "seed", "series", "summary"}``:
    per variant the three series above, and a summary row with each error's mean over the
    steps after the first tenth (``adam_error``, ``step_error``) or final value (``sum_error``)."""
    if cfg.steps < 1:
        raise ValueError(f"lowbitcc study: steps = {cfg.steps}; tracking needs at least 1")
    check_trackable(names)
    measured = run_ranks(_track_rank, cfg.world, names, cfg, seed, backend="gloo",
                         pg_timeout_s=600.0, timeout_s=3600.0)[0]
    series, per_tensor = measured["series"], measured["per_tensor"]
    skip = cfg.steps // 10
    summary = []
    for name in names:
        row: dict[str, Any] = {"variant": name}
        for key, values in series[name].items():
            tail = values[skip:] or values
            row[key] = values[-1] if key == "sum_error" else sum(tail) / len(tail)
        row["worst_tensor"] = max(per_tensor[name], key=lambda t: per_tensor[name][t]["adam_error"])
        summary.append(row)
    return {"config": dataclasses.asdict(cfg), "seed": seed, "series": series,
            "per_tensor": per_tensor, "summary": summary}


def format_table(summary: list[dict[str, Any]]) -> str:
    lines = [f"{'variant':<22} {'step error':>10} {'sum error':>10} {'Adam error':>10} "
             f"{'step cos':>8} {'Adam cos':>8}  worst tensor (Adam error)"]
    for r in summary:
        lines.append(f"{r['variant']:<22} {100 * r['step_error']:>9.2f}% "
                     f"{100 * r['sum_error']:>9.2f}% {100 * r['adam_error']:>9.2f}% "
                     f"{r.get('step_cosine', float('nan')):>8.4f} "
                     f"{r.get('adam_cosine', float('nan')):>8.4f}  {r.get('worst_tensor', '')}")
    return "\n".join(lines)


PANELS = (("step_error", "|c - x| / |x| of each step's all-reduce"),
          ("sum_error", "|sum of compressed - sum of exact| / |sum of exact|"),
          ("adam_error", "Adam update direction: relative distance from exact's"),
          ("adam_cosine", "1 - cosine of the Adam update directions"))


def plot(result: dict[str, Any], path: Path, title: str = "") -> None:
    """`PANELS` per step of every tracked variant, log scale (matplotlib PNG)."""
    plt = pyplot("tracking plot")
    if plt is None:
        return

    fig, axes = plt.subplots(1, len(PANELS), figsize=(6 * len(PANELS), 4.5))
    for ax, (key, label) in zip(axes, PANELS, strict=True):
        for name, record in result["series"].items():
            values = record.get(key, [])
            if key.endswith("cosine"):
                values = [max(1 - c, 1e-9) for c in values]
            else:
                values = [100 * e for e in values]
            ax.plot(values, label=name, linewidth=1)
        ax.set(title=label, xlabel="step", ylabel="" if key.endswith("cosine") else "%",
               yscale="log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
