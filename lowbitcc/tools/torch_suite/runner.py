"""Run torch's distributed suite per configuration and compare the outcomes test by test.

Each configuration (`CONFIGS`) runs in ``jobs`` child processes (`child`), each on its share of
the tests (torch's harness gives every test its own ``TEMP_DIR``); the ranks' logs go to one
file per configuration. The
comparison (`compare`) holds "loco" to gloo: every test gloo passes must pass over "loco" at the
default settings (except `REFUSED_BY_TORCH`), and with compression forced at every size it may
fail only the tests in `LOSSY_BY_DESIGN`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

CONFIGS: dict[str, dict[str, str]] = {
    "gloo": {"LOWBITCC_SUITE_BACKEND": "gloo"},
    "loco": {"LOWBITCC_SUITE_BACKEND": "loco"},
    "loco-forced": {"LOWBITCC_SUITE_BACKEND": "loco", "LOCO_MIN_SIZE": "1",
                    "LOCO_POLICY": "always", "LOCO_COST_MODEL": "0"},
}
"""Configuration name -> the environment its children get (on top of a ``LOCO_*``-free one)."""

REFUSED_BY_TORCH: dict[str, str] = {
    name: "torch's dist.monitored_barrier refuses every group whose backend is not named "
          "'gloo' before the group is reached; lowbitcc.monitored_barrier() and "
          "group.monitored_barrier() offer the same barrier"
    for name in ("test_monitored_barrier_gloo", "test_monitored_barrier_gloo_subgroup")
}
"""Tests gloo passes that cannot pass over "loco" for a reason outside lowbitcc, with it."""

_PARAMETERS_VS_LOCAL = (
    "trains a DDP model for a few steps and compares its parameters with a local model's to "
    "1e-5; the 4-bit codes of the gradients put them about 0.002 apart (measured: greatest "
    "absolute difference 0.0019-0.0026)")

LOSSY_BY_DESIGN: dict[str, str] = {
    "test_DistributedDataParallelCPU": _PARAMETERS_VS_LOCAL,
    "test_DistributedDataParallelCPU_grad_is_view": _PARAMETERS_VS_LOCAL,
    "test_accumulate_gradients_no_sync": _PARAMETERS_VS_LOCAL,
    "test_accumulate_gradients_no_sync_grad_is_view": _PARAMETERS_VS_LOCAL,
    "test_accumulate_gradients_no_sync_allreduce_hook": _PARAMETERS_VS_LOCAL
    + " (the hook's own all_reduce is compressed)",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook": _PARAMETERS_VS_LOCAL
    + " (the hook's own all_reduce is compressed)",
    "test_get_future": "all-reduces a tensor of 2s and compares the result exactly; NVFP4, the "
    "default format, decodes a group of 2s as 2.0625 (its E4M3 scale is the group's amax / 6 "
    "rounded up, 0.34375), where MXFP4's power-of-two scale carries them exactly (it passed "
    "with MXFP4, the default before 2026-11-27)",
}
"""Tests that fail with compression forced at every size because 4-bit codes are lossy, with
why; each was read in the forced run's log (docs/compatibility.md)."""

CURATED: tuple[str, ...] = (
    "test_get_backend", "test_Backend_enum_class",
    "test_all_reduce_sum", "test_all_reduce_sum_async", "test_all_reduce_max",
    "test_all_reduce_coalesced_sum", "test_all_reduce_sum_complex",
    "test_broadcast", "test_all_gather", "test_all_gather_coalesced_simple", "test_gather",
    "test_scatter", "test_reduce_sum",
    "test_send_recv", "test_send_recv_any_source", "test_isend", "test_irecv",
    "test_batch_isend_irecv_gloo",
    "test_barrier", "test_barrier_timeout_full_group", "test_get_future", "test_destroy_group",
    "test_monitored_barrier_gloo_rank_0_timeout",
    "test_DistributedDataParallelCPU", "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_grads_same_across_ranks_with_no_sync", "test_static_graph_api_cpu",
    "test_ddp_logging_data_cpu",
)
"""The subset CI runs (tests/tools/test_torch_suite.py), each passed by gloo at world size 2:
every kind of call, DDP, a communication hook, and the tests that once failed over "loco"."""


@dataclasses.dataclass
class SuiteRun:
    """One configuration's outcomes: test name -> {"outcome", "detail", "seconds"}."""

    config: str
    outcomes: dict[str, dict[str, Any]]
    seconds: float
    log: Path

    def count(self, outcome: str) -> int:
        return sum(1 for o in self.outcomes.values() if o["outcome"] == outcome)

    def passed(self) -> set[str]:
        return {n for n, o in self.outcomes.items() if o["outcome"] == "passed"}


def _env(config: str, world_size: int, start: str = "forkserver") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCO_")}
    env.update(CONFIGS[config])
    env.update(LOWBITCC_SUITE_START=start, WORLD_SIZE=str(world_size),
               PYTORCH_PRINT_REPRO_ON_FAILURE="0")
    return env


def list_tests(world_size: int = 2) -> list[str]:
    """The names of all tests of torch's ``_DistTestBase`` (in a child: the import needs env)."""
    with tempfile.TemporaryDirectory(prefix="lowbitcc-suite-") as tmp:
        out = Path(tmp) / "names.json"
        subprocess.run([sys.executable, "-m", "lowbitcc.tools.torch_suite.child", str(out),
                        "--list"], env=_env("gloo", world_size), check=True,
                       stdout=subprocess.DEVNULL)
        return sorted(json.loads(out.read_text()))


def run_config(config: str, names: list[str], *, world_size: int = 2, jobs: int = 2,
               log_dir: Path, progress: Any = None, start: str = "forkserver") -> SuiteRun:
    """Run ``names`` under ``config`` in ``jobs`` children; ``progress.update(1)`` per test.
    ``start``: how ranks start (`cases.START_METHOD`)."""
    if config not in CONFIGS:
        raise ValueError(f"unknown configuration {config!r}; known: {', '.join(CONFIGS)}")
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{config}.log"
    shards = [names[i::jobs] for i in range(jobs) if names[i::jobs]]
    outcomes: dict[str, dict[str, Any]] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lowbitcc-suite-") as tmp, open(log, "w") as log_file:
        children = []
        for i, shard in enumerate(shards):
            out = Path(tmp) / f"shard{i}.json"
            child = subprocess.Popen(
                [sys.executable, "-m", "lowbitcc.tools.torch_suite.child", str(out), *shard],
                env=_env(config, world_size, start), stdout=subprocess.PIPE,
                stderr=log_file, text=True)
            reader = threading.Thread(target=_follow, args=(child, progress), daemon=True)
            reader.start()
            children.append((child, reader, out, shard))
        for child, reader, out, shard in children:
            child.wait()
            reader.join()
            found = json.loads(out.read_text()) if out.exists() else {}
            for name in shard:
                outcomes[name] = found.get(name, {
                    "outcome": "failed", "seconds": 0.0,
                    "detail": f"no result: the suite's process exited with {child.returncode}"})
    return SuiteRun(config, outcomes, time.perf_counter() - started, log)


def _follow(child: subprocess.Popen, progress: Any) -> None:
    assert child.stdout is not None
    for _line in child.stdout:
        if progress is not None:
            progress.update(1)


@dataclasses.dataclass
class Comparison:
    """What `compare` found; ``problems`` empty means "loco" meets the bar."""

    problems: list[str]
    refused: list[str]
    lossy: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def compare(runs: dict[str, SuiteRun], bar: set[str] | None = None) -> Comparison:
    """Hold every "loco" run to ``bar``: the tests the gloo run of ``runs`` passed, unless
    given (the curated tests, which gloo passes, where no gloo run is in ``runs``)."""
    bar = runs["gloo"].passed() if bar is None else bar
    problems: list[str] = []
    refused: list[str] = []
    lossy: list[str] = []
    for config, run in runs.items():
        if config == "gloo":
            continue
        for name in sorted(bar):
            got = run.outcomes.get(name, {"outcome": "not run", "detail": ""})
            if got["outcome"] == "passed":
                continue
            if name in REFUSED_BY_TORCH:
                refused.append(f"{config}: {name}")
            elif config == "loco-forced" and name in LOSSY_BY_DESIGN:
                lossy.append(name)
            else:
                problems.append(f"{config}: {name} {got['outcome']} ({got['detail']})")
    return Comparison(problems, refused, lossy)


def format_report(runs: dict[str, SuiteRun], comparison: Comparison, world_size: int,
                  start: str = "forkserver") -> str:
    """Markdown: one row per configuration, then what differs from gloo and why."""
    import torch

    lines = [f"torch {torch.__version__}, world size {world_size}, ranks started by {start}, "
             f"{len(next(iter(runs.values())).outcomes)} tests\n",
             "| configuration | passed | failed | skipped | minutes |",
             "|---|---|---|---|---|"]
    for config, run in runs.items():
        lines.append(f"| {config} | {run.count('passed')} | {run.count('failed')} | "
                     f"{run.count('skipped')} | {run.seconds / 60:.1f} |")
    if comparison.refused:
        configs_of: dict[str, list[str]] = {}
        for item in comparison.refused:
            config, name = item.split(": ")
            configs_of.setdefault(name, []).append(config)
        lines += ["", "Refused by torch, not lowbitcc:"]
        lines += [f"- {name} ({', '.join(configs)}): {REFUSED_BY_TORCH[name]}"
                  for name, configs in configs_of.items()]
    if comparison.lossy:
        lines += ["", "Lossy by design (compression forced at every size):"]
        lines += [f"- {name}: {LOSSY_BY_DESIGN[name]}" for name in comparison.lossy]
    lines += ["", "Unexpected differences from gloo:"]
    lines += [f"- {p}" for p in comparison.problems] or ["- none"]
    return "\n".join(lines)


def main(configs: list[str], select: str, world_size: int, jobs: int, out_dir: Path,
         start: str = "forkserver") -> int:
    """``lowbitcc torch-suite``: run, compare, print the report; 0 iff no unexpected difference.

    ``select``: "all", "curated" (`CURATED`) or a comma-separated list of test names.
    """
    from tqdm import tqdm

    if "gloo" not in configs:
        configs = ["gloo", *configs]
    if select == "all":
        names = list_tests(world_size)
    elif select == "curated":
        names = list(CURATED)
    else:
        names = [n.strip() for n in select.split(",") if n.strip()]
    runs: dict[str, SuiteRun] = {}
    with tqdm(total=len(names) * len(configs), unit="test") as progress:
        for config in configs:
            progress.set_description(config)
            runs[config] = run_config(config, names, world_size=world_size, jobs=jobs,
                                      log_dir=out_dir, progress=progress, start=start)
    comparison = compare(runs)
    report = format_report(runs, comparison, world_size, start)
    (out_dir / "report.md").write_text(report + "\n")
    (out_dir / "outcomes.json").write_text(json.dumps(
        {c: r.outcomes for c, r in runs.items()}, indent=1, sort_keys=True))
    print(report)
    print(f"\nlogs, outcomes.json and report.md: {out_dir}")
    return 0 if comparison.ok else 1
