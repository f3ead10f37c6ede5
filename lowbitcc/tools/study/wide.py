"""`lowbitcc study --wide`: the three-configuration study that chooses the 4-bit default.

One 4-bit format must train like fp32 on every model a user tries, so the study trains the
candidates on three configurations of different kinds (`variants.CONFIGURATIONS`: the
documented GPT, a wider and deeper GPT on another text, a CNN classifier on scikit-learn's
digits) at 2 and 4 ranks with 3 seeds, each against the exact run of its seed, and tracks the
candidates on exact's gradient stream of the first seed (`tracking`: per-step error and cosine
of the all-reduce and of Adam's update, per tensor). ``--wide quick`` is the short form: 2 ranks,
2 seeds, the three strongest candidates of the screen in docs/convergence.md, no tracking.

The study is resumable: every finished run is appended to ``wide.json`` in the output folder
and a rerun skips the runs and trackings found there, so an interrupted study (or one run over
several parts) goes on where it stopped. `wide_report` turns the file into tables and the
choice of the default (the worst cell decides).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from tqdm import tqdm

from lowbitcc.tools.study import tracking
from lowbitcc.tools.study.training import run_variant
from lowbitcc.tools.study.variants import CONFIGURATIONS, VARIANTS, StudyConfig
from lowbitcc.tools.study.wide_plans import PLANS, Plan, narrowed, parse_cells

log = logging.getLogger("lowbitcc.tools.study.wide")

GAP_FORMS = {"long": 500, "feedback": 50, "second-phase": 500, "drift": 500}
"""The forms whose report adds the gap over the run (`long_report`), and its table's step."""

SECONDS_HERE = {("gpt", 2): 140.0, ("gpt-docs", 2): 180.0, ("digits-cnn", 2): 20.0}
"""Seconds one 300-step run of a configuration takes on 2 ranks on the 2-core development
machine, the format lab's slower runs included: the first estimate of the expected time, which
finished runs in ``wide.json`` replace. Four ranks on two cores take about `FOUR_RANKS` times
as long."""
FOUR_RANKS = 2.2


def config(configuration: str, world: int, steps: int,
           eval_every: int = StudyConfig.eval_every) -> StudyConfig:
    """The `StudyConfig` of one cell."""
    return StudyConfig(steps=steps, world=world, eval_every=eval_every,
                       **CONFIGURATIONS[configuration])


class Results:
    """``wide.json``: the plan's finished runs (without final weights) and trackings, written
    after each one. ``done`` answers whether a run or tracking is already there."""

    def __init__(self, out: Path) -> None:
        self.path = out / "wide.json"
        self.data: dict[str, Any] = {"runs": [], "tracking": []}
        if self.path.exists():
            self.data = json.loads(self.path.read_text())

    @staticmethod
    def key(record: dict[str, Any]) -> tuple[Any, ...]:
        return (record["configuration"], record["world"], record["seed"], record["variant"])

    def done(self, run: tuple[str, int, int, str]) -> bool:
        return any(self.key(r) == run for r in self.data["runs"])

    def tracked(self, cell: tuple[str, int]) -> bool:
        return any((t["configuration"], t["world"]) == cell for t in self.data["tracking"])

    def merge(self, other: Path, steps: int) -> int:
        """Add the runs and trackings of ``other`` (another study folder's ``wide.json``: a
        part of the same study run elsewhere) that this file lacks, by the keys a resume uses
        (`key`; a tracking by its cell), keeping this file's where both have one, and write it;
        returns how many were added. A file with a run or tracking of another length than
        ``steps`` (a run's last evaluation elsewhere), or none at ``other``, is refused with a
        `ValueError` before anything of it is added."""
        if not other.exists():
            raise ValueError(f"lowbitcc study --wide: --merge found no {other}")
        data = json.loads(other.read_text())
        lengths = [(r["val_loss"][-1][0], self.key(r)) for r in data["runs"]] + [
            (t["config"]["steps"], (t["configuration"], t["world"], "tracking"))
            for t in data.get("tracking", []) if "config" in t]
        for length, key in lengths:
            if length != steps:
                raise ValueError(f"lowbitcc study --wide: {other} holds a run of {length} "
                                 f"steps ({key}), not this plan's {steps}")
        runs = [r for r in data["runs"] if not self.done(self.key(r))]
        tracks = [t for t in data.get("tracking", [])
                  if not self.tracked((t["configuration"], t["world"]))]
        if runs or tracks:
            self.data["runs"].extend(runs)
            self.data["tracking"].extend(tracks)
            self.write()
        return len(runs) + len(tracks)

    def add_run(self, record: dict[str, Any]) -> None:
        self.data["runs"].append({k: v for k, v in record.items() if k != "final_params"})
        self.write()

    def add_tracking(self, record: dict[str, Any]) -> None:
        self.data["tracking"].append(record)
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.path)

    def seconds(self, configuration: str, world: int, steps: int = 300) -> float:
        """The expected seconds of one run of the cell: the mean of its finished runs, else
        `SECONDS_HERE` (times `FOUR_RANKS` beyond 2 ranks, scaled to ``steps``)."""
        times = [r["seconds"] for r in self.data["runs"]
                 if (r["configuration"], r["world"]) == (configuration, world)]
        if times:
            return sum(times) / len(times) * 1.15  # start-up and evaluation beside the loop
        base = SECONDS_HERE.get((configuration, 2), 120.0)
        return base * (FOUR_RANKS if world > 2 else 1.0) * steps / 300


def jobs_for(world: int) -> int:
    """Runs at once: one per ``world`` cores (each rank a process), at least one."""
    return max(1, (os.cpu_count() or 1) // world)


def run(plan: Plan, out: Path, jobs: int | None = None) -> Results:
    """Run what ``plan`` asks that ``out/wide.json`` lacks; returns the results."""
    unknown = [v for v in plan.variants + plan.tracked if v not in VARIANTS]
    if unknown:
        raise ValueError(f"lowbitcc study: unknown variants {unknown}")
    results = Results(out)
    todo = [r for r in plan.runs() if not results.done(r)]
    cells = [c for c in plan.cells() if plan.tracked and not results.tracked(c)]
    expected = sum(results.seconds(c, w, plan.steps) for c, w, _, _ in todo) + sum(
        results.seconds(c, w, plan.steps) * (1 + 0.3 * len(plan.tracked)) for c, w in cells)
    print(f"lowbitcc study --wide: {len(todo)} runs and {len(cells)} trackings to go "
          f"({len(plan.runs()) - len(todo)} runs done in {results.path}); expected "
          f"{expected / 60:.0f} min here", file=sys.stderr, flush=True)
    bar = tqdm(total=len(todo) + len(cells), desc="wide study", unit="run")
    for world, batch in itertools.groupby(todo, key=lambda r: r[1]):  # consecutive, same world
        batch = list(batch)
        at_once = jobs or jobs_for(world)
        threads = max(1, (os.cpu_count() or 1) // (world * at_once))
        with ThreadPoolExecutor(at_once) as pool:
            _run_batch(pool, at_once, batch, plan, threads, results, bar)
    for configuration, world in cells:
        cfg = config(configuration, world, plan.steps, plan.eval_every)
        start = time.perf_counter()
        measured = tracking.run(list(plan.tracked), cfg, plan.seeds[0])
        results.add_tracking({"configuration": configuration, "world": world,
                              "seconds": time.perf_counter() - start, **measured})
        tracking.plot(measured, out / f"tracking-{configuration}-{world}.png",
                      title=f"{configuration}, {world} ranks, seed {plan.seeds[0]}")
        bar.update(1)
    bar.close()
    return results


def _run_batch(pool: ThreadPoolExecutor, at_once: int, batch: list[tuple[str, int, int, str]],
               plan: Plan, threads: int, results: Results, bar: Any) -> None:
    """Run ``batch``, ``at_once`` runs at a time on ``pool``, recording each run as it
    finishes. A run that raises stops new runs from starting; it raises once the runs under way
    have finished and been recorded (nothing runs after a failure unrecorded)."""
    queue, running = list(batch), set()
    failure: BaseException | None = None
    while queue or running:
        while queue and failure is None and len(running) < at_once:
            running.add(pool.submit(_one, queue.pop(0), plan, threads))
        if not running:
            break
        done, running = wait(running, return_when=FIRST_COMPLETED)
        for future in done:
            try:
                record = future.result()
            except BaseException as exc:  # noqa: BLE001 (raised below, after the others)
                failure = failure or exc
                continue
            results.add_run(record)
            bar.update(1)
    if failure is not None:
        raise failure


def _one(run_key: tuple[str, int, int, str], plan: Plan, threads: int) -> dict[str, Any]:
    configuration, world, seed, variant = run_key
    cfg = config(configuration, world, plan.steps, plan.eval_every)
    record = run_variant(VARIANTS[variant], cfg, seed, threads)
    log.info("%s, %d ranks, seed %d, %s: final validation loss %.4f in %.0f s", configuration,
             world, seed, variant, record["val_loss"][-1][1], record["seconds"])
    return {"configuration": configuration, "world": world, **record}


def command(form: str, out_dir: str | Path, steps: int | None = None,
            cells: list[str] | None = None, variants: list[str] | None = None,
            seeds: list[int] | None = None, merge: list[str] | None = None) -> int:
    """``lowbitcc study --wide FORM``: run the plan (resuming from ``out``, after adding what
    the study folders ``merge`` finished that it lacks, `Results.merge`; with ``cells``,
    ``CONFIGURATION:WORLD`` names, only those cells' runs: `wide_plans.parse_cells`; with
    ``variants`` or ``seeds``, only those of the plan's: `wide_plans.narrowed`), then write
    ``wide.md`` (`wide_report.format_markdown`) and ``frontier.png`` in ``out_dir`` and print
    the tables; the long form adds the gap over the run (`long_report`: ``gaps.md`` and
    ``gaps.png``). Exit status 0."""
    from lowbitcc.tools.study import long_report, wide_report

    out = Path(out_dir)
    plan = PLANS[form] if steps is None else dataclasses.replace(PLANS[form], steps=steps)
    if cells:
        plan = dataclasses.replace(plan, only=parse_cells(plan, cells))
    plan = narrowed(plan, variants, seeds)
    if merge:
        merged = Results(out)  # (read once, written by each merge that adds)
        for folder in merge:
            added = merged.merge(Path(folder) / "wide.json", plan.steps)
            print(f"lowbitcc study --wide: {added} runs and trackings added from {folder}",
                  file=sys.stderr, flush=True)
    results = run(plan, out)
    runs = [r for r in results.data["runs"] if r["configuration"] in plan.configurations]
    text = wide_report.format_markdown(runs)
    (out / "wide.md").write_text(text + "\n")
    wide_report.plot_frontier(runs, out / "frontier.png")
    print(text)
    if form in GAP_FORMS:
        curves = long_report.format_markdown(runs, every=GAP_FORMS[form])
        (out / "gaps.md").write_text(curves + "\n")
        long_report.plot_gaps(runs, out / "gaps.png")
        print("\n" + curves)
    for t in results.data["tracking"]:
        print(f"\ntracking: {t['configuration']}, {t['world']} ranks, seed {t['seed']}")
        print(tracking.format_table(t["summary"]))
    return 0
