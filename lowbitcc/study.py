"""`lowbitcc study`: does LoCo at 4 bits train like full precision, and naive 4-bit not?

Trains a small byte-level GPT on the Python standard library's own source files (present on
every Python install, nothing downloaded), with DDP on ``world`` local CPU ranks, once per
variant, with the same seed, initial weights and data order for every variant:

- ``exact``: gloo, fp32 all-reduce (the reference);
- ``loco4``, ``loco4-ef``, ``loco4-nofb``, ``loco8``, ``loco2``: the "loco" backend at 4 bits
  with LoCo (beta 0.8), classic error feedback (beta 0), no feedback; 8 and 2 bits with LoCo;
- ``loco4-g64``: 4-bit LoCo with one scale per 64 elements instead of the default 128 (0.25
  bits more per element);
- ``fp16-hook``: gloo with torch's ``fp16_compress_hook`` (its ``bf16_compress_hook`` refuses
  CPU tensors), the 16-bit compression users have today;
- ``powersgd``: gloo with torch's PowerSGD hook (rank 2, exact for the first 10 steps);
- ``fsdp2-loco4``: FSDP2 (``fully_shard`` per block) over "loco" at 4 bits.

Per variant it records train loss (mean over ranks) every step, validation loss every
``eval_every`` steps on ``eval_batches`` fixed batches and after the last step on
``final_eval_batches`` (the number the gaps to exact are computed from), wall time, and bytes
each rank put on the wire for gradients: measured by lowbitcc for "loco", and for gloo the bytes
a ring all-reduce sends (``2 (n-1)/n`` times the payload; PowerSGD's payload computed from its P
and Q shapes). Results go to JSON, and to a PNG with matplotlib installed.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import os
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

log = logging.getLogger("lowbitcc.study")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One training run: backend, the ``LOCO_*`` settings of the "loco" group, DDP hook, FSDP."""

    name: str
    backend: str = "gloo"
    env: tuple[tuple[str, str], ...] = ()
    hook: str | None = None  # "fp16" or "powersgd"
    fsdp: bool = False


VARIANTS = {
    v.name: v for v in [
        Variant("exact"),
        Variant("loco4", "loco", (("LOCO_BITS", "4"), ("LOCO_BETA", "0.8"))),
        Variant("loco4-ef", "loco", (("LOCO_BITS", "4"), ("LOCO_BETA", "0"))),
        Variant("loco4-nofb", "loco", (("LOCO_BITS", "4"), ("LOCO_FEEDBACK", "0"))),
        Variant("loco4-g64", "loco", (("LOCO_BITS", "4"), ("LOCO_BETA", "0.8"),
                                      ("LOCO_GROUP_SIZE", "64"))),
        Variant("loco8", "loco", (("LOCO_BITS", "8"), ("LOCO_BETA", "0.8"))),
        Variant("loco2", "loco", (("LOCO_BITS", "2"), ("LOCO_BETA", "0.8"))),
        Variant("fp16-hook", hook="fp16"),
        Variant("powersgd", hook="powersgd"),
        Variant("fsdp2-loco4", "loco", (("LOCO_BITS", "4"), ("LOCO_BETA", "0.8")), fsdp=True),
    ]
}


@dataclasses.dataclass(frozen=True)
class StudyConfig:
    """Model, data and schedule of a study (defaults: the documented study)."""

    steps: int = 300
    batch: int = 16  # sequences per rank per step
    context: int = 64
    d_model: int = 192
    layers: int = 4
    heads: int = 4
    lr: float = 2e-3
    warmup: int = 20
    eval_every: int = 25
    # validation batches of each evaluation during training and of the final one (rounded up to
    # a multiple of ``world``: each rank evaluates its share)
    eval_batches: int = 16
    final_eval_batches: int = 128
    corpus_bytes: int = 4 << 20
    world: int = 2


DEFAULT_VARIANTS = list(VARIANTS)
DEFAULT_SEEDS = [0, 1, 2]
EXTRA_SEED_VARIANTS = ["exact", "loco4", "loco4-nofb", "loco4-g64"]
DEFAULT_TRACKED = ["loco4", "loco4-ef", "loco4-nofb", "loco4-g64", "loco8", "loco2"]  # tracking.py
# the smoke run of the test suite: a tiny model and little data
QUICK = {"d_model": 64, "layers": 2, "heads": 2, "batch": 8, "context": 32, "eval_every": 10,
         "eval_batches": 4, "final_eval_batches": 32, "corpus_bytes": 1 << 20}


# ---------------------------------------------------------------------------------------------
# data and model


def corpus(max_bytes: int) -> bytes:
    """The standard library's ``.py`` files (tests excluded), in sorted path order, concatenated
    up to ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = bytearray()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if rel[0] in ("site-packages", "dist-packages", "test", "idlelib") or "tests" in rel:
            continue
        try:
            out += path.read_bytes()
        except OSError:
            continue
        if len(out) >= max_bytes:
            break
    if len(out) < 1 << 16:
        raise RuntimeError(f"lowbitcc study: found only {len(out)} bytes of Python source in {root}")
    return bytes(out[:max_bytes])


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Byte-level decoder: vocabulary 256, learned positions, pre-norm blocks."""

    def __init__(self, cfg: StudyConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.heads) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, 256)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def split_corpus(cfg: StudyConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, val)``: the first 90% and the last 10% of the corpus, uint8."""
    data = torch.frombuffer(bytearray(corpus(cfg.corpus_bytes)), dtype=torch.uint8)
    split = int(len(data) * 0.9)
    return data[:split], data[split:]


def sample_batch(data: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, ...]:
    """Inputs and next-byte targets, ``(len(starts), context)`` int64 each."""
    rows = torch.stack([data[s:s + context + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


def train_batches(train: torch.Tensor, cfg: StudyConfig, seed: int, rank: int) -> Iterator[
        tuple[torch.Tensor, torch.Tensor]]:
    """The training batches of ``rank``, one per step: the same for every variant of a seed."""
    order = torch.Generator().manual_seed(seed * 1000 + rank)
    for _ in range(cfg.steps):
        starts = torch.randint(len(train) - cfg.context - 1, (cfg.batch,), generator=order)
        yield sample_batch(train, starts, cfg.context)


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))


def optimizer(params: Iterable[nn.Parameter], cfg: StudyConfig) -> tuple[
        torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW at ``cfg.lr`` (no weight decay), linear warm-up then cosine decay to 0."""
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / cfg.warmup)
        * 0.5 * (1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps)))
    return opt, sched


# ---------------------------------------------------------------------------------------------
# one variant on one rank


def _wire_bytes_per_step(model: nn.Module, variant: Variant, world: int) -> float:
    """Ring all-reduce bytes per rank per step for the gloo variants (analytic)."""
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
    return ring * 4 * sum(p.numel() for p in model.parameters())


def _rank_main(rank: int, world: int, variant: Variant, cfg: StudyConfig, seed: int,
               init_file: str, result_file: str) -> None:
    for key, value in variant.env:
        os.environ[key] = value
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    import lowbitcc

    dist.init_process_group(variant.backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    try:
        metrics = dist.new_group(backend="gloo")
        train, val = split_corpus(cfg)
        torch.manual_seed(seed)
        model = TinyGPT(cfg)
        if variant.fsdp:
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP

            # PowerSGD's hook issues a bucket's second and third all-reduce from the future
            # callbacks of its first. DDP's default small first bucket makes two buckets, and
            # when the ranks drift apart in time they issue those calls in different orders:
            # gloo aborts ("Received data size doesn't match expected size"). One bucket (an
            # explicit cap turns the small first bucket off) leaves one order.
            model = DDP(model, bucket_cap_mb=64 if variant.hook == "powersgd" else None)
            if variant.hook == "fp16":
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                model.register_comm_hook(None, default_hooks.fp16_compress_hook)
            elif variant.hook == "powersgd":
                from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

                state = powerSGD_hook.PowerSGDState(
                    process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=10,
                    random_seed=seed)
                model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        opt, sched = optimizer(model.parameters(), cfg)
        val_gen = torch.Generator().manual_seed(12345)
        val_starts = [torch.randint(len(val) - cfg.context - 1, (cfg.batch,), generator=val_gen)
                      for _ in range(_whole_shares(max(cfg.eval_batches, cfg.final_eval_batches),
                                                   world))]
        lowbitcc.reset_stats()
        train_loss: list[float] = []
        val_loss: list[tuple[int, float]] = []
        start = time.perf_counter()
        show = rank == 0 and sys.stderr.isatty()
        bar = None
        if show:
            from tqdm import tqdm

            bar = tqdm(total=cfg.steps, desc=f"{variant.name} seed {seed}", leave=False)

        def evaluate(step: int, batches: int) -> None:
            # rank r takes batches r, r + world, ...: the same count on every rank (FSDP2's
            # forward all-gathers), the mean over all of them on every rank
            model.eval()
            mine = val_starts[rank:_whole_shares(batches, world):world]
            with torch.no_grad():
                total = torch.tensor(sum(float(lm_loss(model, *sample_batch(val, s, cfg.context)))
                                         for s in mine), dtype=torch.float64)
            dist.all_reduce(total, group=metrics)
            model.train()
            val_loss.append((step, float(total) / (len(mine) * world)))

        for step, (x, y) in enumerate(train_batches(train, cfg, seed, rank)):
            if step % cfg.eval_every == 0:
                evaluate(step, cfg.eval_batches)
            loss = lm_loss(model, x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean, group=metrics)
            train_loss.append(float(mean) / world)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{train_loss[-1]:.3f}")
        evaluate(cfg.steps, cfg.final_eval_batches)
        elapsed = time.perf_counter() - start
        if bar is not None:
            bar.close()
        inner = model.module if hasattr(model, "module") else model
        if variant.backend == "loco":
            s = lowbitcc.stats()
            wire = (s["compressed"]["wire_bytes"] + s["exact"]["wire_bytes"]) / cfg.steps
        else:
            wire = _wire_bytes_per_step(inner, variant, world)
        params = torch.cat([p.detach().full_tensor().reshape(-1) if hasattr(p, "full_tensor")
                            else p.detach().reshape(-1) for p in inner.parameters()])
        if rank == 0:
            torch.save(params, result_file + ".params")
            Path(result_file).write_text(json.dumps({
                "variant": variant.name, "seed": seed, "train_loss": train_loss,
                "val_loss": val_loss, "seconds": elapsed, "wire_bytes_per_step": wire,
                "parameters": sum(p.numel() for p in inner.parameters()),
            }))
    finally:
        dist.destroy_process_group()


def _whole_shares(batches: int, world: int) -> int:
    """``batches`` rounded up to a multiple of ``world``."""
    return -(-batches // world) * world


def run_variant(variant: Variant, cfg: StudyConfig, seed: int, workdir: str) -> dict[str, Any]:
    """Train ``variant`` on ``cfg.world`` fresh local ranks; returns its record (rank 0's)."""
    init_file = os.path.join(workdir, f"store-{variant.name}-{seed}")
    result_file = os.path.join(workdir, f"result-{variant.name}-{seed}.json")
    mp.spawn(_rank_main, args=(cfg.world, variant, cfg, seed, init_file, result_file),
             nprocs=cfg.world, join=True)
    record = json.loads(Path(result_file).read_text())
    record["final_params"] = torch.load(result_file + ".params")
    return record


# ---------------------------------------------------------------------------------------------
# the study


def run(variants: list[str], seeds: list[int], cfg: StudyConfig, out_dir: str | None = None,
        extra_seed_variants: list[str] | None = None,
        tracked: list[str] | None = None) -> dict[str, Any]:
    """Run every variant for ``seeds[0]`` and the ``extra_seed_variants`` for every seed; then,
    with ``tracked``, measure those variants on the exact run's gradient stream of ``seeds[0]``
    (`lowbitcc.tracking`).

    Returns ``{"config", "runs": [records], "summary", "across_seeds"}`` (and ``"tracking"``);
    with ``out_dir``, writes ``study.json`` and (matplotlib permitting) ``study.png`` and
    ``tracking.png`` there."""
    unknown = [v for v in [*variants, *(extra_seed_variants or [])] if v not in VARIANTS]
    if unknown:
        raise ValueError(f"lowbitcc study: unknown variants {unknown}; known: {list(VARIANTS)}")
    check_trackable(tracked or [])
    plan = [(v, seeds[0]) for v in variants]
    for seed in seeds[1:]:
        plan += [(v, seed) for v in (extra_seed_variants or variants)]
    runs = []
    with tempfile.TemporaryDirectory(prefix="lowbitcc-study-") as tmp:
        for i, (name, seed) in enumerate(plan):
            log.info("[%d/%d] %s, seed %d", i + 1, len(plan), name, seed)
            runs.append(run_variant(VARIANTS[name], cfg, seed, tmp))
    summary = summarize(runs)
    result = {"config": dataclasses.asdict(cfg), "runs": runs, "summary": summary,
              "across_seeds": across_seeds(summary)}
    if tracked:
        from lowbitcc import tracking

        log.info("tracking %s on the gradients of exact, seed %d", ", ".join(tracked), seeds[0])
        result["tracking"] = tracking.run(tracked, cfg, seeds[0])
    if out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        serializable = {**result, "runs": [{k: v for k, v in r.items() if k != "final_params"}
                                           for r in runs]}
        (out / "study.json").write_text(json.dumps(serializable, indent=1))
        plot(runs, summary, out / "study.png")
        if "tracking" in result:
            from lowbitcc import tracking

            tracking.plot(result["tracking"], out / "tracking.png")
    return result


def check_trackable(names: list[str]) -> None:
    """Raise `ValueError` unless every name is a DDP-over-"loco" variant (what tracking runs)."""
    trackable = [n for n, v in VARIANTS.items() if v.backend == "loco" and not v.fsdp]
    bad = [n for n in names if n not in trackable]
    if bad:
        raise ValueError(f"lowbitcc study: cannot track {bad}; trackable: {trackable}")


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per run: final validation loss, its gap to the exact run of the same seed, the distance of
    the final weights from exact's (relative L2), mean |train loss - exact's|, bytes, time."""
    exact = {r["seed"]: r for r in runs if r["variant"] == "exact"}
    rows = []
    for r in runs:
        ref = exact.get(r["seed"])
        final = r["val_loss"][-1][1]
        row = {"variant": r["variant"], "seed": r["seed"], "final_val_loss": final,
               "seconds": r["seconds"], "wire_bytes_per_step": r["wire_bytes_per_step"]}
        if ref is not None:
            ref_final = ref["val_loss"][-1][1]
            row["gap_to_exact"] = (final - ref_final) / ref_final
            a, b = r["final_params"], ref["final_params"]
            row["weight_distance"] = float((a - b).norm() / b.norm())
            n = min(len(r["train_loss"]), len(ref["train_loss"]))
            row["train_curve_distance"] = sum(
                abs(x - y) for x, y in zip(r["train_loss"][:n], ref["train_loss"][:n])) / n
            row["bytes_vs_exact"] = r["wire_bytes_per_step"] / ref["wire_bytes_per_step"]
        rows.append(row)
    return rows


def across_seeds(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per compared variant (in first-seen order): the seeds it ran, the mean, lowest and highest
    gap to exact, and the mean of ``gap - loco4's gap`` over the seeds both ran (positive: worse
    than 4-bit LoCo)."""
    gaps: dict[str, dict[int, float]] = {}
    for row in summary:
        if "gap_to_exact" in row and row["variant"] != "exact":
            gaps.setdefault(row["variant"], {})[row["seed"]] = row["gap_to_exact"]
    loco = gaps.get("loco4", {})
    rows = []
    for variant, by_seed in gaps.items():
        values = list(by_seed.values())
        row = {"variant": variant, "seeds": sorted(by_seed), "mean_gap": sum(values) / len(values),
               "min_gap": min(values), "max_gap": max(values)}
        paired = [by_seed[s] - loco[s] for s in by_seed if s in loco]
        if paired and variant != "loco4":
            row["vs_loco4"] = sum(paired) / len(paired)
            row["vs_loco4_each"] = paired
        rows.append(row)
    return rows


def format_table(summary: list[dict[str, Any]]) -> str:
    lines = [f"{'variant':<13} {'seed':>4} {'val loss':>9} {'gap':>8} {'w dist':>7} "
             f"{'MiB/step':>9} {'vs exact':>8} {'s':>7}"]
    for r in summary:
        lines.append(
            f"{r['variant']:<13} {r['seed']:>4} {r['final_val_loss']:>9.4f} "
            f"{100 * r.get('gap_to_exact', float('nan')):>7.2f}% "
            f"{r.get('weight_distance', float('nan')):>7.4f} "
            f"{r['wire_bytes_per_step'] / 2**20:>9.3f} {r.get('bytes_vs_exact', float('nan')):>8.3f} "
            f"{r['seconds']:>7.1f}")
    return "\n".join(lines)


def format_across_seeds(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'variant':<13} {'seeds':>6} {'mean gap':>9} {'min':>7} {'max':>7} "
             f"{'vs loco4':>9}  per seed"]
    for r in rows:
        each = " ".join(f"{100 * d:+.2f}%" for d in r.get("vs_loco4_each", []))
        vs = f"{100 * r['vs_loco4']:+8.2f}%" if "vs_loco4" in r else f"{'':>9}"
        lines.append(f"{r['variant']:<13} {len(r['seeds']):>6} {100 * r['mean_gap']:>8.2f}% "
                     f"{100 * r['min_gap']:>6.2f}% {100 * r['max_gap']:>6.2f}% {vs}  {each}")
    return "\n".join(lines)


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or None (with a warning) when not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed (pip install lowbitcc[plot]); no plot written")
        return None
    return plt


def plot(runs: list[dict[str, Any]], summary: list[dict[str, Any]], path: Path) -> None:
    """Three panels: train loss and validation loss of the first seed's runs (the curve is the
    ``eval_batches`` evaluations, the cross the final one on ``final_eval_batches``), and every
    run's final gap to exact of its seed (``summary``, from `summarize`)."""
    plt = pyplot()
    if plt is None:
        return
    fig, (ax_train, ax_val, ax_gap) = plt.subplots(
        1, 3, figsize=(18, 4.8), gridspec_kw={"width_ratios": [1, 1, 0.8]})
    seed0 = runs[0]["seed"]
    for r in runs:
        if r["seed"] != seed0:
            continue
        k = 10
        smooth = [sum(r["train_loss"][max(0, i - k + 1):i + 1])
                  / len(r["train_loss"][max(0, i - k + 1):i + 1])
                  for i in range(len(r["train_loss"]))]
        ax_train.plot(smooth, label=r["variant"], linewidth=1)
        steps, losses = zip(*r["val_loss"][:-1])
        line, = ax_val.plot(steps, losses, marker=".", label=r["variant"], linewidth=1)
        ax_val.plot(*r["val_loss"][-1], marker="x", color=line.get_color())
    ax_train.set(title=f"train loss (10-step mean), seed {seed0}", xlabel="step",
                 ylabel="nats/byte")
    ax_val.set(title=f"validation loss, seed {seed0} (x: final, larger sample)", xlabel="step",
               ylabel="nats/byte")
    for ax in (ax_train, ax_val):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    lows = [min(l for _, l in r["val_loss"]) for r in runs]
    ax_val.set_ylim(min(lows) - 0.05, min(lows) + 1.0)

    gaps: dict[str, list[float]] = {}
    for row in summary:
        if row["variant"] != "exact" and "gap_to_exact" in row:
            gaps.setdefault(row["variant"], []).append(100 * row["gap_to_exact"])
    shown = {v: g for v, g in gaps.items() if max(abs(x) for x in g) < 5}
    for i, (variant, values) in enumerate(shown.items()):
        ax_gap.plot([i] * len(values), values, "o", color="C0", alpha=0.6)
        mean = sum(values) / len(values)
        ax_gap.plot([i - 0.25, i + 0.25], [mean, mean], color="C3", linewidth=2)
    ax_gap.axhline(0, color="black", linewidth=0.8)
    ax_gap.axhline(1, color="gray", linewidth=0.8, linestyle="--")
    ax_gap.set_xticks(range(len(shown)), list(shown), rotation=30, ha="right", fontsize=8)
    off = ", ".join(f"{v} {sum(g) / len(g):+.1f}%" for v, g in gaps.items() if v not in shown)
    ax_gap.set(title="final validation loss vs exact, each seed (bar: mean)", ylabel="gap %",
               xlabel=f"off scale: {off}" if off else "")
    ax_gap.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
