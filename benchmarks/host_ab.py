"""A/B of the host time of a compressed all-reduce: another git revision's package against
this checkout's, in alternating runs, so that a change of a few percent shows through this
machine's drift (one run's host time moves by 15% and more from one minute to the next).

Feeds CHANGELOG.md: a change's host time per call against the revision before it (the ratios
quoted with the ``host_ab.py`` command that gave them); docs/host-time.md, says what the host time counts.

Each run starts ``--ranks`` ranks (``LOCO_ISSUER=inline``, the CUDA path's issuing logic on
CPU tensors) from a scratch directory with one of the two trees first on ``PYTHONPATH``, and
times ``--calls`` forced all-reduces of ``--elements`` fp32 elements (after 100 untimed) the
way `lowbitcc perf` does (``lowbitcc.compressed()``, ``feedback_key``, ``end_step``). Per call
it subtracts that call's codec and wire time (`lowbitcc.stats()`, read between calls) from
its wall time, and reports the median and the mean over calls and ranks (`lowbitcc perf`'s
``host_us`` is the mean, which the machine's hiccups move, and before 2026-11-28 the place's
re-agreement, one call in 64). The two trees run in turn, their order alternating between
rounds (the first run of a pair tends to be the faster one here). Prints each run and the
ratios of the means of the medians and of the means (< 1: this checkout is faster).

    python benchmarks/host_ab.py --rev HEAD~1 --rounds 6
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def probe(rank: int, world: int, elements: int, calls: int) -> list[float]:
    """Per timed call of this rank: wall time minus the call's codec and wire time (s)."""
    import torch
    import torch.distributed as dist

    import lowbitcc

    def busy() -> float:
        s = lowbitcc.stats()["compressed"]
        return s["codec_s"] + s["wire_s"]

    x = torch.randn(elements, generator=torch.Generator().manual_seed(rank))
    start = x.clone()
    hosts = []
    for i in range(calls + 100):
        if i % 50 == 0:  # AVG keeps values finite; a fresh start keeps them varied
            x.copy_(start)
        before = busy()
        t0 = time.perf_counter()
        with lowbitcc.compressed(), lowbitcc.feedback_key("host_ab"):
            dist.all_reduce(x, op=dist.ReduceOp.AVG)
        lowbitcc.end_step()
        wall = time.perf_counter() - t0
        if i >= 100:
            hosts.append(wall - (busy() - before))
    return hosts


def run_once(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    """One run with ``tree`` first on ``PYTHONPATH``: the median and mean host time per call
    (us)."""
    env = dict(os.environ, PYTHONPATH=str(tree), LOCO_ISSUER="inline")
    with tempfile.TemporaryDirectory() as cwd:  # not the checkout: its root would win
        out = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--child", str(tree),
             "--ranks", str(args.ranks), "--elements", str(args.elements),
             "--calls", str(args.calls)],
            cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def child(tree: str, args: argparse.Namespace) -> None:
    import lowbitcc
    from lowbitcc.tools import spawn

    if not Path(lowbitcc.__file__).resolve().is_relative_to(Path(tree).resolve()):
        raise SystemExit(f"host_ab: imported {lowbitcc.__file__}, not the tree {tree}")
    per_rank = spawn.run_ranks(probe, args.ranks, args.elements, args.calls, backend="loco")
    hosts = [h for rank in per_rank for h in rank]
    print(json.dumps({"median_us": statistics.median(hosts) * 1e6,
                      "mean_us": statistics.mean(hosts) * 1e6}))


def checkout(rev: str) -> Path:
    """A worktree of ``rev`` in a scratch directory (`main` removes both when done)."""
    where = Path(tempfile.mkdtemp(prefix="lowbitcc-host-ab-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(where), rev], cwd=REPO,
                   check=True)
    return where


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", default="HEAD", help="the revision to compare against")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--elements", type=int, default=1 << 18, help="fp32 elements (1 MiB)")
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args)
        return
    base = checkout(args.rev)
    runs: dict[str, list[dict[str, float]]] = {"this checkout": [], args.rev: []}
    pair = [("this checkout", REPO), (args.rev, base)]
    try:
        for round_ in range(1, args.rounds + 1):
            # the first run of a pair was the faster in most pairs here, whichever tree it
            # was: the order alternates (ABBA)
            for name, tree in pair if round_ % 2 else pair[::-1]:
                runs[name].append(run_once(tree, args))
                print(f"round {round_}: {name:>14} median host {runs[name][-1]['median_us']:7.1f}"
                      f" us, mean {runs[name][-1]['mean_us']:7.1f} us", flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO, check=False)
        shutil.rmtree(base.parent, ignore_errors=True)
    for stat in ("median_us", "mean_us"):
        ours, theirs = (statistics.mean(r[stat] for r in runs[k]) for k in runs)
        print(f"mean of {stat[:-3]}s: this checkout {ours:.1f} us, {args.rev} {theirs:.1f} us, "
              f"ratio {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()
