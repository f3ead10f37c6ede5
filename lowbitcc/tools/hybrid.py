"""`lowbitcc hybrid`: the naive-versus-hybrid study (arXiv 2409.02423 on a small
scale): a GPT with tensor-parallel attention and MLP x FSDP2 data parallelism, trained per
scheme, side by side in the same ranks.

The mesh is ``(dp, tp)`` (default 2 x 2 on 4 ranks): ranks ``i * tp .. i * tp + tp - 1`` form
a tensor-parallel group, as the GPUs of one server do. Every scheme's model is the same
`TPGPT` from the same seed: q, k, v and the MLP's first layer column-parallel, the attention's
output projection and the MLP's second layer row-parallel (torch's
``torch.distributed.tensor.parallel``, Megatron's layout), embeddings, norms and the head
replicated; then ``fully_shard`` per block and on the root over "dp". A scheme is the pair of
configs of its two dimensions (`SCHEMES`; None: exact on gloo):

- ``exact``: both dimensions on gloo;
- ``naive``: every collective at 4 bits: DP over "loco" (MXFP4 LoCo gradients, 4-bit
  parameter all-gathers), TP over "loco" with policy "always" (forward activations and their
  gradients in backward, with LoCo feedback like the gradients);
- ``hybrid``: DP 4-bit LoCo gradients, TP exact on gloo (`lowbitcc.hybrid_mesh`'s default);
- ``hybrid-tp8``: the same with TP at 8 bits (int8 codes per 128, no feedback);
- ``hybrid+pg8`` / ``hybrid+pg4``: hybrid with 8- or 4-bit parameter all-gathers on DP;
- ``naive-nofb`` (not in the default set): naive without feedback on the TP calls, which
  tells the 4-bit activations apart from the carried errors of another batch's activations.

Every "loco" group here has the cost model off (the study measures what compression does,
not which calls a cost model would pick), and a ``min_size`` of 1024 elements (TP) or 16384
(DP: `DP_MIN_SIZE`).

Each step every scheme trains on the same batch (one per DP rank, the same on the ranks of a
TP group), one scheme after the other in an order that rotates per step, the ranks meeting at a
barrier before and after each (outside the timing). Rank 0 prints, per scheme and seed, the
final validation loss and its gap to ``exact``'s, the step time after ``warmup`` steps, and the
bytes each rank sent per step: per dimension where each TP group runs in its own network
namespace (``--link``: DP traffic crosses the namespace's veth and its emulated link, TP
traffic stays on the namespace's loopback device, and both are counted there), else the total
that the "loco" groups counted (compressed calls' codes plus exact calls' input sizes).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import lowbitcc
from lowbitcc.config import LocoConfig
from lowbitcc.tools import netem, side_by_side
from lowbitcc.tools.spawn import launch
from lowbitcc.tools.study.model import TinyGPT, lm_loss, optimizer, sample_batch, split_corpus
from lowbitcc.tools.study.variants import StudyConfig

log = logging.getLogger("lowbitcc.tools.hybrid")

TP_MIN_SIZE = 1024
"""``min_size`` of compressed TP groups: a TP all-reduce holds batch x context x d_model."""
DP_MIN_SIZE = 16384
"""``min_size`` of the DP groups: the study's parameter all-gathers hold 37-49 Ki elements per
rank, under the default of 64 Ki (its gradient reduce-scatters, 74-98 Ki, are over it)."""


def _dp4(param_bits: int = 0) -> LocoConfig:
    return LocoConfig(format="mxfp4", feedback=True, cost_model=False, min_size=DP_MIN_SIZE,
                      param_bits=param_bits)


def _tp(bits: int, feedback: bool) -> LocoConfig:
    return LocoConfig(bits=bits, format="mxfp4" if bits == 4 else "int", feedback=feedback,
                      policy="always", cost_model=False, min_size=TP_MIN_SIZE)


SCHEMES: dict[str, tuple[LocoConfig | None, LocoConfig | None]] = {
    "exact": (None, None),
    "naive": (_dp4(param_bits=4), _tp(4, feedback=True)),
    "hybrid": (_dp4(), None),
    "hybrid-tp8": (_dp4(), _tp(8, feedback=False)),
    "hybrid+pg8": (_dp4(param_bits=8), None),
    "hybrid+pg4": (_dp4(param_bits=4), None),
    "naive-nofb": (_dp4(param_bits=4), _tp(4, feedback=False)),
}
"""Scheme name -> (DP config, TP config); None: exact on gloo. The order of the tables."""
DEFAULT_SCHEMES = tuple(s for s in SCHEMES if s != "naive-nofb")
"""What `lowbitcc hybrid` runs without ``--schemes`` (under 30 minutes here, 3 seeds)."""

CONFIGS = {
    # the study: 0.87 M parameters (0.5 M per TP rank), 8 sequences of 64 bytes per DP rank
    "study": StudyConfig(d_model=128, layers=4, heads=4, batch=8, context=64, steps=150,
                         warmup=15, lr=3e-3, final_eval_batches=32, corpus_bytes=4 << 20,
                         world=4),
    # the test suite's run
    "quick": StudyConfig(d_model=64, layers=2, heads=2, batch=4, context=32, steps=12,
                         warmup=2, lr=3e-3, final_eval_batches=4, corpus_bytes=1 << 20,
                         world=4),
}


class Attention(nn.Module):
    """Causal self-attention with separate q, k, v projections (so that each can be split by
    columns); the number of heads follows from the local width (``head_dim`` fixed)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.head_dim = d // heads
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for m in (self.q, self.k, self.v))
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(att.transpose(1, 2).reshape(b, t, -1))


class TPBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d), Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.fc1, self.act, self.fc2 = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class TPGPT(TinyGPT):
    """The study's byte-level decoder with blocks that tensor parallelism can split
    (`tp_plan`)."""

    def __init__(self, cfg: StudyConfig) -> None:
        super().__init__(cfg, block=TPBlock)


def tp_plan() -> dict[str, Any]:
    """Each block's tensor-parallel layout: Megatron's column- then row-parallel pairs."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(), "attn.proj": RowwiseParallel(),
            "fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


@dataclasses.dataclass(frozen=True)
class HybridOptions:
    """What `rank_main` runs: ``schemes`` (from `SCHEMES`) on model configuration ``config``
    (from `CONFIGS`) for each of ``seeds``, ``steps`` steps (default: the config's) of which
    the first ``warmup`` are not timed, on a ``dp`` x ``tp`` mesh."""

    config: str = "study"
    schemes: tuple[str, ...] = DEFAULT_SCHEMES
    seeds: tuple[int, ...] = (0, 1, 2)
    steps: int | None = None
    warmup: int = 5
    dp: int = 2
    tp: int = 2
    json_path: str | None = None

    def validate(self) -> None:
        bad = "lowbitcc hybrid: "
        if self.config not in CONFIGS:
            raise ValueError(f"{bad}unknown config {self.config!r}; known: {', '.join(CONFIGS)}")
        unknown = [s for s in self.schemes if s not in SCHEMES]
        if unknown or not self.schemes:
            raise ValueError(f"{bad}unknown schemes {unknown}; known: {', '.join(SCHEMES)}")
        if not self.seeds:
            raise ValueError(f"{bad}give at least one seed")
        if not 0 <= self.warmup < self.model().steps:
            raise ValueError(f"{bad}needs 0 <= warmup < steps")
        if self.dp < 1 or self.tp < 1 or self.model().heads % self.tp:
            raise ValueError(f"{bad}the mesh {self.dp} x {self.tp} does not fit "
                             f"{self.model().heads} heads")

    def model(self) -> StudyConfig:
        cfg = CONFIGS[self.config]
        return cfg if self.steps is None else dataclasses.replace(cfg, steps=self.steps)


def _meter(measured: bool) -> dict[str, float]:
    """This rank's counters so far: bytes sent (``netem.sent_bytes()`` where ``measured``, else
    ``loco_counted``: the "loco" groups' compressed codes and exact input sizes) and the "loco"
    groups' compressed ``calls``."""
    stats = lowbitcc.stats()
    sent = netem.sent_bytes() if measured else None
    counted = dict(sent) if sent is not None else {
        "loco_counted": float(stats["compressed"]["wire_bytes"] + stats["exact"]["tensor_bytes"])}
    return {**counted, "calls": float(stats["compressed"]["calls"])}


def build(scheme: str, cfg: StudyConfig, seed: int, dp: int, tp: int) -> nn.Module:
    """``scheme``'s mesh and model (every rank calls it, in the same order): `TPGPT` from
    ``seed``, split over "tp" by `tp_plan`, sharded over "dp" per block and at the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    dp_config, tp_config = SCHEMES[scheme]
    # DTensor takes two meshes of the same ranks, shape and names for one (DeviceMesh's
    # equality ignores the groups): each scheme and seed gets dimension names of its own
    names = (f"dp.{scheme}.{seed}", f"tp.{scheme}.{seed}")
    if dp_config is None:
        override: dict[str, Any] = {names[0]: "gloo",
                                    names[1]: ("loco", tp_config) if tp_config else "gloo"}
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=names,
                                backend_override=override)
    else:
        configs = {names[0]: dp_config, **({names[1]: tp_config} if tp_config else {})}
        with warnings.catch_warnings():  # naive's feedback on TP is deliberate
            warnings.filterwarnings("ignore", message="lowbitcc.hybrid_mesh: dimension")
            mesh = lowbitcc.hybrid_mesh("cpu", (dp, tp), names, configs=configs)
    torch.manual_seed(seed)
    model = TPGPT(cfg)
    for block in model.blocks:
        parallelize_module(block, mesh[names[1]], tp_plan())
        fully_shard(block, mesh=mesh[names[0]])
    return fully_shard(model, mesh=mesh[names[0]])


def _evaluate(model: nn.Module, val: torch.Tensor, cfg: StudyConfig, dp_rank: int, dp: int,
              metrics: dist.ProcessGroup) -> float:
    """Mean validation loss over ``cfg.final_eval_batches`` fixed batches (rounded up to a
    multiple of ``dp``): DP rank r takes batches r, r + dp, ...; a TP group evaluates the
    same ones together."""
    starts = torch.randint(len(val) - cfg.context - 1, (cfg.final_eval_batches + dp, cfg.batch),
                           generator=torch.Generator().manual_seed(7))
    mine = starts[dp_rank:-(-cfg.final_eval_batches // dp) * dp:dp]
    model.eval()
    with torch.no_grad():
        total = sum(float(lm_loss(model, *sample_batch(val, s, cfg.context))) for s in mine)
    model.train()
    out = torch.tensor([total, len(mine)], dtype=torch.float64)
    dist.all_reduce(out, group=metrics)
    return float(out[0] / out[1])


def train_seed(rank: int, world: int, opts: HybridOptions, seed: int,
               metrics: dist.ProcessGroup) -> dict[str, dict[str, Any]]:
    """Every scheme of ``opts`` for one seed; per scheme (on every rank): ``losses`` (mean
    training loss over the ranks per step), ``val_loss``, ``step_s`` (mean over the timed
    steps of the slowest rank's time), ``bytes`` (per rank per step: ``link`` and ``lo``
    measured, or ``loco_counted``) and ``compressed_calls`` (this rank's)."""
    cfg = opts.model()
    dp_rank = rank // opts.tp
    models = {s: build(s, cfg, seed, opts.dp, opts.tp) for s in opts.schemes}
    optims = {s: optimizer(m.parameters(), cfg) for s, m in models.items()}
    train, val = split_corpus(cfg)
    order = torch.Generator().manual_seed(seed * 1000 + dp_rank)
    measured = netem.sent_bytes() is not None

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(len(train) - cfg.context - 1, (cfg.batch,), generator=order)
        return sample_batch(train, starts, cfg.context)

    def step(scheme: str, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict]:
        (opt, sched), model = optims[scheme], models[scheme]
        loss = lm_loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        return loss, {}

    trained = side_by_side.train(opts.schemes, cfg.steps, opts.warmup, batch, step,
                                 lambda: _meter(measured), metrics, desc=f"hybrid seed {seed}",
                                 barrier_after=True)
    timed = cfg.steps - opts.warmup
    # a namespace's counters hold its node's tp ranks: per rank, divide by tp
    per_rank = opts.tp if measured else 1
    out = {}
    for scheme, t in trained.items():
        names = [n for n in t.timed if n != "calls"]
        counted = torch.tensor([t.timed[n] for n in names], dtype=torch.float64)
        dist.all_reduce(counted, group=metrics)
        out[scheme] = {
            "losses": t.losses,
            "val_loss": _evaluate(models[scheme], val, cfg, dp_rank, opts.dp, metrics),
            "step_s": t.slowest_s / timed,
            "bytes": {n: float(v) / world / per_rank / timed
                      for n, v in zip(names, counted.tolist(), strict=True)},
            "compressed_calls": int(t.every["calls"]),
        }
    return out


def rank_main(rank: int, world: int, opts: HybridOptions) -> dict[int, dict[str, Any]] | None:
    """Run the study on the initialised default group of ``dp * tp`` ranks; rank 0 prints the
    tables (and writes ``opts.json_path``) and returns ``{seed: train_seed's result}``, the
    others None."""
    if world != opts.dp * opts.tp:
        raise ValueError(f"lowbitcc hybrid: a {opts.dp} x {opts.tp} mesh needs "
                         f"{opts.dp * opts.tp} ranks, got {world}")
    # the head returns a reshaped matmul, which FSDP2 warns about on every step
    warnings.filterwarnings("ignore", message=".*returned a view tensor", category=UserWarning)
    metrics = dist.new_group(backend="gloo")
    results = {}
    for seed in opts.seeds:
        start = time.monotonic()
        results[seed] = train_seed(rank, world, opts, seed, metrics)
        if rank == 0:
            log.info("seed %d: %d schemes trained in %.0f s", seed, len(opts.schemes),
                     time.monotonic() - start)
    if rank != 0:
        return None
    print(format_report(results, opts, world))
    if opts.json_path:
        with open(opts.json_path, "w") as f:
            json.dump({"options": dataclasses.asdict(opts), "world": world,
                       "results": {str(k): v for k, v in results.items()}}, f, indent=1)
    return results


def summarize(results: dict[int, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per scheme over seeds: ``val`` (mean validation loss), ``gap`` (mean, sd, min, max of
    the relative gap to ``exact``'s of the same seed; None without ``exact``), ``step_ms``
    (mean), ``bytes`` (mean per counter, MB per rank per step)."""
    seeds = sorted(results)
    schemes = list(results[seeds[0]])
    out = {}
    for scheme in schemes:
        runs = [results[s][scheme] for s in seeds]
        gaps = ([r["val_loss"] / results[s]["exact"]["val_loss"] - 1
                 for s, r in zip(seeds, runs, strict=True)]
                if "exact" in results[seeds[0]] else None)
        out[scheme] = {
            "val": statistics.mean(r["val_loss"] for r in runs),
            "gap": None if gaps is None else (
                statistics.mean(gaps), statistics.stdev(gaps) if len(gaps) > 1 else math.nan,
                min(gaps), max(gaps)),
            "step_ms": 1e3 * statistics.mean(r["step_s"] for r in runs),
            "bytes": {n: statistics.mean(r["bytes"][n] for r in runs) / 1e6
                      for n in runs[0]["bytes"]},
        }
    return out


def format_report(results: dict[int, dict[str, dict[str, Any]]], opts: HybridOptions,
                  world: int) -> str:
    cfg = opts.model()
    params = sum(p.numel() for p in TPGPT(cfg).parameters())
    summary = summarize(results)
    counters = list(next(iter(summary.values()))["bytes"])
    lines = [f"# lowbitcc hybrid: GPT d_model {cfg.d_model}, {cfg.layers} layers, "
             f"{params / 1e6:.2f} M parameters; {opts.dp} (dp) x {opts.tp} (tp) mesh on {world} "
             f"ranks; {cfg.batch} x {cfg.context} tokens per DP rank; {cfg.steps} steps "
             f"({opts.warmup} untimed); seeds {', '.join(map(str, sorted(results)))}",
             f"# {'scheme':<11} {'val loss':>9} {'gap':>8} {'sd':>7} {'min':>8} {'max':>8} "
             f"{'ms/step':>8} {'speed':>6} "
             + " ".join(f"{('MB ' + c):>10}" for c in counters)]
    base = summary.get("exact")
    for scheme, s in summary.items():
        gap = ("" if s["gap"] is None else
               f"{s['gap'][0]:>+8.2%} {s['gap'][1]:>7.2%} {s['gap'][2]:>+8.2%} "
               f"{s['gap'][3]:>+8.2%}")
        speed = f"{base['step_ms'] / s['step_ms']:.2f}x" if base else "-"
        lines.append(f"  {scheme:<11} {s['val']:>9.4f} {gap:>33} {s['step_ms']:>8.1f} "
                     f"{speed:>6} " + " ".join(f"{s['bytes'][c]:>10.3f}" for c in counters))
    lines.append("# val loss: final validation loss, mean over seeds; gap: its relative gap to "
                 "exact's of the same seed (mean, sd, min, max); speed: exact's step time over "
                 "the scheme's; MB: per rank per step, "
                 + ("measured: link = the DP dimension (across namespaces), lo = TP (within one)"
                    if counters == ["link", "lo"] else
                    "loco_counted = what the scheme's \"loco\" groups counted (codes of "
                    "compressed calls, input sizes of exact ones; its gloo dimensions are not "
                    "counted)"))
    per_seed = " ".join(f"{s:>8}" for s in sorted(results))
    lines.append(f"# final validation loss per seed:  {per_seed}")
    for scheme in summary:
        lines.append(f"  {scheme:<31} " + " ".join(
            f"{results[s][scheme]['val_loss']:>8.4f}" for s in sorted(results)))
    return "\n".join(lines)


def main(opts: HybridOptions, link: str | None, argv: Sequence[str],
         timeout_s: float = 3600.0) -> int:
    """Run under whatever started us (`lowbitcc.tools.spawn.launch`; under ``--link`` each TP
    group shares a namespace)."""
    opts.validate()
    return launch(rank_main, opts.dp * opts.tp, link, argv, opts, timeout_s=timeout_s,
                  ranks_per_node=opts.tp)
