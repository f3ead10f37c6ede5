"""`lowbitcc bench-train`: training steps of one GPT over several communication schemes, side by
side in the same processes.

Each rank builds one copy of the study's byte-level GPT (`lowbitcc.tools.study.model`) per
scheme, from the same seed, and every step trains each copy on the same batch, one scheme after
the other (the order rotates per step, and the ranks meet at a barrier before each, outside the
timing), so the network and the machine's load treat every scheme alike:

- ``local``: no communication at all (each rank trains its own copy): the ceiling;
- ``gloo``, ``fp16``, ``powersgd``: DDP over a gloo group, with no hook, torch's fp16
  compression hook, or PowerSGD (rank 2, from the third step); with ``--device cuda`` the
  baseline is ``nccl`` (DDP over an NCCL group) and the hooks run on that group;
- ``loco``: DDP over a "loco" group configured from ``LOCO_*`` (the cost model on by default);
- ``fsdp2-exact``, ``fsdp2-loco``: FSDP2 (``fully_shard`` per block) over a "loco" group with
  policy "never" (every call exact, over gloo) and over one configured from ``LOCO_*``.

With ``--device cuda`` each rank trains on GPU ``LOCAL_RANK`` (else its rank) modulo the
GPUs there are; local ranks started with ``--np`` share GPUs where there are fewer
(`spawn.gpu_rank_env`), and the table then says its timings mean nothing. Each phase ends
with a ``torch.cuda.synchronize()``, so that its time is the GPU's too.

Rank 0 prints per scheme the mean step time after the warm-up steps, steps/s and tokens/s (of
all ranks), the speed relative to the baseline (and to ``fsdp2-exact`` for FSDP2) and the step time
relative to ``local``, the bytes each rank sent per step, and the loss of the last steps.
Under ``--link`` (emulated links, `lowbitcc.tools.netem`), or wherever ``GLOO_SOCKET_IFNAME``
names the interface, the bytes are counted on the rank's network interface; otherwise they are
estimates (marked ``~``): for loco schemes the compressed calls' bytes as counted plus the
exact calls' as ring all-reduces, for the others the ring all-reduce's analytic count.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import lowbitcc
from lowbitcc.tools import netem, side_by_side
from lowbitcc.tools.link_spec import Link
from lowbitcc.tools.spawn import launch, local_gpu
from lowbitcc.tools.study.model import TinyGPT, lm_loss, sample_batch, split_corpus
from lowbitcc.tools.study.training import ring_bytes_per_step
from lowbitcc.tools.study.variants import StudyConfig, Variant

SCHEMES = ("local", "gloo", "nccl", "fp16", "powersgd", "loco", "fsdp2-exact", "fsdp2-loco")
"""Every scheme, in the order of the table."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""The models' dtypes (``--dtype``)."""
BASELINES = {"cpu": "gloo", "cuda": "nccl"}
"""Each device's exact DDP scheme, the speed column's reference (the other is refused)."""


def default_schemes(device: str) -> tuple[str, ...]:
    """Every scheme that runs on ``device``'s tensors."""
    return tuple(s for s in SCHEMES if s not in BASELINES.values() or s == BASELINES[device])

PHASES = ("forward", "backward", "optimizer", "codec", "wire")
"""The step's phases, timed per scheme (ms per step, mean of the ranks): forward (with
``zero_grad``), backward (DDP waits for its last bucket's all-reduce there), the optimizer step,
and of that time the loco groups' codec and wire seconds (`lowbitcc.stats`; the wire includes
waiting for the peers; calls run on the group's worker thread, beside the backward pass)."""

CONFIGS = {
    # the communication-heavy GPT: 3.3 M parameters, 4 sequences of 64 bytes per rank
    "comm": StudyConfig(d_model=256, layers=4, heads=4, batch=4, context=64),
    # fewer parameters, 16x the tokens per step
    "compute": StudyConfig(d_model=192, layers=4, heads=4, batch=32, context=128),
    # the test suite's smoke run
    "quick": StudyConfig(d_model=64, layers=2, heads=2, batch=2, context=32,
                         corpus_bytes=1 << 20),
}


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    """What `run` measures: ``schemes`` (from `SCHEMES`, for ``device``'s tensors) on model
    configuration ``config`` (from `CONFIGS`), ``steps`` steps of which the first ``warmup``
    are not timed."""

    config: str = "comm"
    schemes: tuple[str, ...] = default_schemes("cpu")
    steps: int = 30
    warmup: int = 5
    lr: float = 1e-3
    json_path: str | None = None
    device: str = "cpu"
    dtype: str = "fp32"
    """The models' parameters and gradients: "fp32", or "bf16" (as GPU training runs: DDP's
    buckets, and what it all-reduces, in bf16; AdamW on bf16 parameters)."""

    def validate(self) -> None:
        if self.device not in BASELINES:
            raise ValueError(f"lowbitcc bench-train: --device must be cpu or cuda, got "
                             f"{self.device!r}")
        foreign = [s for s in self.schemes if s in SCHEMES and s not in default_schemes(self.device)]
        if foreign:
            raise ValueError(f"lowbitcc bench-train: {', '.join(foreign)} does not run on "
                             f"{self.device} tensors; the exact baseline there is "
                             f"{BASELINES[self.device]}")
        if self.device == "cuda" and not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise ValueError("lowbitcc bench-train --device cuda: needs a GPU and torch with NCCL")
        if self.config not in CONFIGS:
            raise ValueError(f"lowbitcc bench-train: unknown config {self.config!r}; known: "
                             f"{', '.join(CONFIGS)}")
        unknown = [s for s in self.schemes if s not in SCHEMES]
        if unknown or not self.schemes:
            raise ValueError(f"lowbitcc bench-train: unknown schemes {unknown}; known: "
                             f"{', '.join(SCHEMES)}")
        if not 0 <= self.warmup < self.steps:
            raise ValueError("lowbitcc bench-train: needs 0 <= warmup < steps")
        if self.dtype not in DTYPES:
            raise ValueError(f"lowbitcc bench-train: --dtype must be one of {', '.join(DTYPES)}, "
                             f"got {self.dtype!r}")


def _tx_bytes() -> int | None:
    """Bytes sent so far on gloo's interface (`netem.sent_bytes`); None where not known."""
    sent = netem.sent_bytes()
    return None if sent is None else sent["link"]


def _loco_bytes(s: dict[str, Any], world: int) -> float:
    """Bytes this rank's loco groups sent so far, from ``s`` (`lowbitcc.stats`): the
    compressed calls' (counted), and the exact calls' input bytes times the ring all-reduce's
    2 (n - 1) / n (an estimate)."""
    return s["compressed"]["wire_bytes"] + 2 * (world - 1) / world * s["exact"]["tensor_bytes"]


def _build(scheme: str, cfg: StudyConfig, groups: dict[str, Any],
           device: torch.device, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model of ``scheme`` on ``device`` in ``dtype``, wrapped for it (same initial
    parameters for every scheme)."""
    torch.manual_seed(0)
    model = TinyGPT(cfg).to(device=device, dtype=dtype)
    if scheme == "local":
        return model
    if scheme.startswith("fsdp2"):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        group = groups["loco"] if scheme == "fsdp2-loco" else groups["exact"]
        mesh = DeviceMesh.from_group(group, device.type)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    from torch.nn.parallel import DistributedDataParallel as DDP

    group = groups["loco"] if scheme == "loco" else groups["baseline"]
    # PowerSGD issues a bucket's later all-reduces from its first one's callbacks: one bucket
    # keeps one order on every rank (see lowbitcc.tools.study.training.wrap)
    ddp = DDP(model, process_group=group, bucket_cap_mb=64 if scheme == "powersgd" else None,
              device_ids=None if device.type == "cpu" else [device.index])
    if scheme == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif scheme == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=2,
                                            start_powerSGD_iter=2, random_seed=0)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp


def _estimated_bytes(scheme: str, model: nn.Module, world: int) -> float:
    """Analytic bytes one rank sends per step (ring all-reduce; FSDP2: reduce-scatter plus
    all-gathers of forward and backward)."""
    if scheme == "local":
        return 0.0
    inner = model.module if hasattr(model, "module") else model
    scale = next(inner.parameters()).element_size() / 4  # the estimates are fp32's
    if scheme.startswith("fsdp2"):
        params = sum(p.numel() for p in inner.parameters())
        return 3 * (world - 1) / world * 4 * params * scale
    hook = {"fp16": "fp16", "powersgd": "powersgd"}.get(scheme)
    return ring_bytes_per_step(inner, Variant(scheme, hook=hook), world) * (
        1.0 if hook == "fp16" else scale)


def rank_main(rank: int, world: int, opts: BenchOptions) -> list[dict[str, Any]] | None:
    """Run the benchmark on the initialised default group; rank 0 prints the table and returns
    its rows, the others None."""
    cfg = CONFIGS[opts.config]
    device = local_gpu(rank) if opts.device == "cuda" else torch.device("cpu")
    # TinyGPT's head returns a reshaped matmul, which FSDP2 warns about on every step
    warnings.filterwarnings("ignore", message=".*returned a view tensor", category=UserWarning)
    metrics = dist.new_group(backend="gloo")
    groups = {"baseline": dist.new_group(backend=BASELINES[opts.device])}
    if any(s in ("loco", "fsdp2-loco") for s in opts.schemes):
        groups["loco"] = dist.new_group(backend="loco")
    if "fsdp2-exact" in opts.schemes:
        groups["exact"] = dist.new_group(backend="loco",
                                         pg_options=lowbitcc.LocoConfig(policy="never"))
    models = {s: _build(s, cfg, groups, device, DTYPES[opts.dtype]) for s in opts.schemes}
    optims = {s: torch.optim.AdamW(m.parameters(), lr=opts.lr, weight_decay=0.0)
              for s, m in models.items()}
    train, _ = split_corpus(cfg)
    order = torch.Generator().manual_seed(1000 + rank)
    measured = _tx_bytes() is not None

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(len(train) - cfg.context - 1, (cfg.batch,), generator=order)
        x, y = sample_batch(train, starts, cfg.context)
        return x.to(device), y.to(device)

    def sync() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def step(scheme: str, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict]:
        start = sync()
        loss = lm_loss(models[scheme], x, y)
        optims[scheme].zero_grad(set_to_none=True)
        forward = sync()
        loss.backward()
        backward = sync()
        optims[scheme].step()
        return loss, {"forward": forward - start, "backward": backward - forward,
                      "optimizer": sync() - backward}

    def meter() -> dict[str, float]:
        stats = lowbitcc.stats()
        sent = _tx_bytes() if measured else _loco_bytes(stats, world)
        return {"bytes": float(sent or 0), "codec": stats["compressed"]["codec_s"],
                "wire": stats["compressed"]["wire_s"]}

    lowbitcc.reset_stats()
    trained = side_by_side.train(opts.schemes, opts.steps, opts.warmup, batch, step, meter,
                                 metrics, desc=f"bench-train {opts.config}")
    timed = opts.steps - opts.warmup
    phase_sums = torch.tensor([[{**t.phases, **t.timed}.get(name, 0.0) for name in PHASES]
                               for t in trained.values()], dtype=torch.float64)
    dist.all_reduce(phase_sums, group=metrics)
    if rank != 0:
        return None
    rows = []
    for i, scheme in enumerate(opts.schemes):
        t = trained[scheme]
        step_s = t.slowest_s / timed
        if measured:
            per_step, how = t.timed["bytes"] / timed, "measured"
        elif scheme in ("loco", "fsdp2-loco"):
            per_step, how = t.timed["bytes"] / timed, "estimate"
        else:
            per_step, how = _estimated_bytes(scheme, models[scheme], world), "estimate"
        rows.append({"scheme": scheme, "step_ms": step_s * 1e3, "steps_per_s": 1 / step_s,
                     "tokens_per_s": world * cfg.batch * cfg.context / step_s,
                     "bytes_per_step": per_step, "bytes": how,
                     "final_loss": sum(t.losses[-5:]) / len(t.losses[-5:]),
                     "phases_ms": {name: float(v) / (world * timed) * 1e3
                                   for name, v in zip(PHASES, phase_sums[i], strict=True)}})
    _print(rows, opts, cfg, world, sum(p.numel() for p in models[opts.schemes[0]].parameters()))
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if local > torch.cuda.device_count():
            print(f"# {local} ranks share {torch.cuda.device_count()} GPU(s) (NCCL over "
                  "sockets): these timings mean nothing, the losses and bytes do")
    if opts.json_path:
        with open(opts.json_path, "w") as f:
            json.dump({"options": dataclasses.asdict(opts), "world": world, "rows": rows}, f,
                      indent=1)
    return rows


def _print(rows: list[dict[str, Any]], opts: BenchOptions, cfg: StudyConfig, world: int,
           params: int) -> None:
    by = {r["scheme"]: r for r in rows}
    print(f"# lowbitcc bench-train: config {opts.config} (GPT d_model {cfg.d_model}, "
          f"{cfg.layers} layers, {params / 1e6:.2f} M parameters in {opts.dtype}; {cfg.batch} x "
          f"{cfg.context} tokens per rank), {world} ranks on {opts.device}, {opts.steps} steps "
          f"({opts.warmup} untimed), loco at {lowbitcc.LocoConfig.from_env().bits} bits")
    print(f"# {'scheme':<12} {'ms/step':>9} {'steps/s':>8} {'tokens/s':>9} {'speed':>7} "
          f"{'x local':>8} {'MB/step':>9} {'loss':>7}")
    for r in rows:
        base = by.get("fsdp2-exact" if r["scheme"].startswith("fsdp2")
                      else BASELINES[opts.device])
        speed = f"{base['step_ms'] / r['step_ms']:.2f}x" if base else "-"
        local = f"{r['step_ms'] / by['local']['step_ms']:.2f}" if "local" in by else "-"
        mark = "~" if r["bytes"] == "estimate" else " "
        print(f"  {r['scheme']:<12} {r['step_ms']:>9.1f} {r['steps_per_s']:>8.2f} "
              f"{r['tokens_per_s']:>9.0f} {speed:>7} {local:>8} "
              f"{mark}{r['bytes_per_step'] / 1e6:>8.3f} {r['final_loss']:>7.3f}")
    print(f"# speed: the baseline's step time over the scheme's ({BASELINES[opts.device]}; "
          "fsdp2-exact for FSDP2); "
          "x local: the step time over local's (no communication); MB/step: bytes one rank sent "
          + ("on its interface" if rows[0]["bytes"] == "measured"
             else "(~: estimates; loco: its compressed calls' bytes counted, its exact "
             "calls' as ring all-reduces; others: the ring's analytic count)")
          + "; loss: mean training loss of the last 5 steps")
    print(f"# phases, ms per step (mean of the ranks): {'scheme':<12} "
          + " ".join(f"{name:>9}" for name in PHASES))
    for r in rows:
        print(f"  {'':<41}{r['scheme']:<12} "
              + " ".join(f"{r['phases_ms'][name]:>9.1f}" for name in PHASES))
    print("# backward includes waiting for DDP's last bucket; codec and wire: the loco groups' "
          "compressed calls (lowbitcc.stats), run beside the backward pass")


def main(opts: BenchOptions, nprocs: int | None, link: Link | None, argv: Sequence[str],
         timeout_s: float = 3600.0) -> int:
    """Run under whatever started us; ``argv`` is the command line, for ``--link``."""
    opts.validate()
    return launch(rank_main, nprocs, link, argv, opts, timeout_s=timeout_s,
                  gpu=opts.device == "cuda")
