"""One rank of the DiLoCo study's timing under an emulated link: ``python -m
lowbitcc.tools.study.wan_timing CONFIG.json`` in each node's namespace (`lowbitcc.tools.netem`,
which sets torchrun's variables and ``GLOO_SOCKET_IFNAME``).

``CONFIG.json`` holds ``{"variants": [names], "config": StudyConfig fields, "out": path}``. For
each variant in turn the rank joins a fresh default group of the variant's backend (its
``LOCO_*`` settings in the environment, a port of its own) and trains `steps_for` steps with
the study's training loop (evaluations cut to one batch per rank); rank 0 writes
``{name: seconds per step}`` to ``out`` after each variant.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lowbitcc.tools.study.training import train_rank
from lowbitcc.tools.study.variants import VARIANTS, StudyConfig, Variant


def steps_for(variant: Variant) -> int:
    """Steps timed: two outer rounds of a DiLoCo variant, 10 steps of DDP."""
    return 2 * variant.outer_every if variant.outer_every else 10


def timing_config(cfg: StudyConfig, variant: Variant) -> StudyConfig:
    """``cfg`` for a timing run: `steps_for` steps, evaluations of one batch per rank."""
    return dataclasses.replace(cfg, steps=steps_for(variant), eval_every=10**9,
                               eval_batches=cfg.world, final_eval_batches=cfg.world)


def main(config_path: str) -> int:
    spec = json.loads(Path(config_path).read_text())
    cfg = StudyConfig(**spec["config"])
    torch.set_num_threads(1)
    rank, base_port = int(os.environ["RANK"]), int(os.environ["MASTER_PORT"])
    seconds: dict[str, float] = {}
    for i, name in enumerate(spec["variants"]):
        variant = VARIANTS[name]
        for key in [k for k in os.environ if k.startswith("LOCO_")]:
            del os.environ[key]
        os.environ.update(dict(variant.env))
        os.environ["MASTER_PORT"] = str(base_port + 1 + i)
        dist.init_process_group(variant.backend, timeout=datetime.timedelta(seconds=600))
        try:
            timed = timing_config(cfg, variant)
            record = train_rank(rank, cfg.world, variant, timed, seed=0)
        finally:
            dist.destroy_process_group()
        if record is not None:
            seconds[name] = record["seconds"] / timed.steps
            Path(spec["out"]).write_text(json.dumps(seconds, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
