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
- ``fsdp2-loco4``: FSDP2 (``fully_shard`` per block) over "loco" at 4 bits;
- ``loco2-nofb``, ``loco4-g64-nofb``, ``loco4-g1024`` and ``loco4-g1024-nofb``: where feedback
  matters (not in the default set);
- ``lab-*``: wire formats and feedback loco does not implement (yet), tried through the format
  lab's DDP hook (`lowbitcc.tools.study.formats`; not in the default set).

Per variant it records train loss (mean over ranks) every step, validation loss every
``eval_every`` steps on ``eval_batches`` fixed batches and after the last step on
``final_eval_batches`` (the number the gaps to exact are computed from), wall time, and bytes
each rank put on the wire for gradients: measured by lowbitcc for "loco", and for gloo the bytes
a ring all-reduce sends (``2 (n-1)/n`` times the payload; PowerSGD's payload computed from its P
and Q shapes). Results go to JSON, and to a PNG with matplotlib installed.

The package: `variants` (what runs, and the configurations), `formats` (the format lab),
`model` (the GPT and its texts), `tasks` (what each configuration trains: GPT or the digits
CNN), `training` (one run on its ranks), `tracking` (the compressors on one gradient stream),
`report` (summaries, tables, plot); `run` here runs a whole study. `wide` (with
`wide_report`) is ``lowbitcc study --wide``: the three-configuration study that chooses the
4-bit default (docs/convergence.md). `diloco` (with `wan_timing`) is ``lowbitcc study
--diloco``: DiLoCo across emulated sites (docs/wan.md).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch

from lowbitcc.tools.study import tracking
from lowbitcc.tools.study.report import (
    across_seeds,
    format_across_seeds,
    format_table,
    plot,
    summarize,
)
from lowbitcc.tools.study.training import run_variant
from lowbitcc.tools.study.variants import (
    DEFAULT_SEEDS,
    DEFAULT_TRACKED,
    DEFAULT_VARIANTS,
    EXTRA_SEED_VARIANTS,
    QUICK,
    VARIANTS,
    StudyConfig,
    Variant,
    check_trackable,
)

log = logging.getLogger("lowbitcc.tools.study")

PARAMS = "params"
"""The folder of ``out_dir`` that holds each finished run's final parameters (`run`)."""

__all__ = ["DEFAULT_SEEDS", "DEFAULT_TRACKED", "DEFAULT_VARIANTS", "EXTRA_SEED_VARIANTS", "QUICK",
           "VARIANTS", "StudyConfig", "Variant", "across_seeds", "format_across_seeds",
           "format_table", "run", "summarize"]


def run(variants: list[str], seeds: list[int], cfg: StudyConfig, out_dir: str | None = None,
        extra_seed_variants: list[str] | None = None,
        tracked: list[str] | None = None) -> dict[str, Any]:
    """Run every variant for ``seeds[0]`` and the ``extra_seed_variants`` for every seed; then,
    with ``tracked``, measure those variants on the exact run's gradient stream of ``seeds[0]``
    (`lowbitcc.tools.study.tracking`).

    Returns ``{"config", "runs": [records], "summary", "across_seeds"}`` (and ``"tracking"``);
    with ``out_dir``, writes ``study.json`` and each run's final parameters
    (``params/{variant}-{seed}.pt``) after every run, and (matplotlib permitting) ``study.png``
    and ``tracking.png`` there. A study started again with the same ``out_dir`` and ``cfg``
    resumes: the runs ``study.json`` holds with their parameters are not run again (`_resumed`)."""
    unknown = [v for v in [*variants, *(extra_seed_variants or [])] if v not in VARIANTS]
    if unknown:
        raise ValueError(f"lowbitcc study: unknown variants {unknown}; known: {list(VARIANTS)}")
    check_trackable(tracked or [])
    plan = [(v, seeds[0]) for v in variants]
    for seed in seeds[1:]:
        plan += [(v, seed) for v in (extra_seed_variants or variants)]
    out = Path(out_dir) if out_dir else None
    kept = _resumed(out, cfg) if out else {}
    runs: list[dict[str, Any]] = []
    for i, (name, seed) in enumerate(plan):
        record = kept.get((name, seed))
        if record is None:
            log.info("[%d/%d] %s, seed %d", i + 1, len(plan), name, seed)
            record = run_variant(VARIANTS[name], cfg, seed)
        runs.append(record)
        if out and (name, seed) not in kept:  # after every run: an interrupted study resumes
            _write(out, _result(cfg, runs), runs)
            torch.save(record["final_params"], out / PARAMS / f"{name}-{seed}.pt")
    result = _result(cfg, runs)
    if tracked:
        log.info("tracking %s on the gradients of exact, seed %d", ", ".join(tracked), seeds[0])
        result["tracking"] = tracking.run(tracked, cfg, seeds[0])
    if out:
        _write(out, result, runs)
        plot(runs, result["summary"], out / "study.png")
        if "tracking" in result:
            tracking.plot(result["tracking"], out / "tracking.png")
    return result


def _result(cfg: StudyConfig, runs: list[dict[str, Any]]) -> dict[str, Any]:
    summary = summarize(runs)
    return {"config": dataclasses.asdict(cfg), "runs": runs, "summary": summary,
            "across_seeds": across_seeds(summary)}


def _resumed(out: Path, cfg: StudyConfig) -> dict[tuple[str, int], dict[str, Any]]:
    """The finished runs of a study in ``out`` (its ``study.json`` and parameter files), by
    variant and seed; none where there is no study there. A study of another configuration
    there raises a ValueError (its runs would not compare)."""
    path = out / "study.json"
    if not path.exists():
        return {}
    saved = json.loads(path.read_text())
    if saved.get("config") != json.loads(json.dumps(dataclasses.asdict(cfg))):
        raise ValueError(f"lowbitcc study: {path} holds a study of another configuration; "
                         "remove it or choose another --out")
    kept = {}
    for record in saved["runs"]:
        params = out / PARAMS / f"{record['variant']}-{record['seed']}.pt"
        if params.exists():  # a run written before its parameters runs again
            kept[(record["variant"], record["seed"])] = {
                **record, "final_params": torch.load(params, weights_only=True)}
    if kept:
        log.info("resuming the study in %s: %d runs done", out, len(kept))
    return kept


def _write(out: Path, result: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    """``study.json`` in ``out``: ``result`` without the runs' final parameters."""
    (out / PARAMS).mkdir(parents=True, exist_ok=True)
    serializable = {**result, "runs": [{k: v for k, v in r.items() if k != "final_params"}
                                       for r in runs]}
    (out / "study.json").write_text(json.dumps(serializable, indent=1))
