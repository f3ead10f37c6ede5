"""The result line of each phase of `benchmarks/gpu_suite.sh`, read from the phase's log and JSON
files, and the stand-ins its dry mode writes in their place. The suite runs it; its lines feed
docs/gpu.md's records of runs on a GPU.

Usage:
    python benchmarks/gpu_suite_report.py verdict PHASE OUT RC LIMIT_S
    python benchmarks/gpu_suite_report.py stub PHASE OUT
    python benchmarks/gpu_suite_report.py --help

``verdict`` prints one line, ``PASS <phase> <number> ...`` or ``FAIL <phase> <reason>``, from
``OUT/<phase>.log`` and the JSON the phase writes into OUT; RC is the phase's exit status (124 or
137: cut at its LIMIT_S). It never prints a traceback: a missing or broken JSON is a FAIL with its
reason. ``stub`` prints the log lines and writes the JSON a phase would, for the dry mode.
``--help`` prints this text (exit 0); anything else, the usage on stderr (exit 2). Standard
library only: the dry mode runs it where there is no torch."""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

MARK = "--- "
"""The suite's own lines in a log (`gpu_suite.sh`'s ``x``): a step's start or its exit status."""


class PhaseFailedError(Exception):
    """The phase failed for the reason given; nothing else is read."""


class Run:
    """A finished phase: its log, its JSON files, how it ended."""

    def __init__(self, phase: str, out: Path, rc: int, limit_s: int) -> None:
        self.phase, self.out, self.rc, self.limit_s = phase, out, rc, limit_s
        path = out / f"{phase}.log"
        self.log = path.read_text(errors="replace") if path.exists() else ""

    @property
    def cut(self) -> bool:
        return self.rc in (124, 137)  # timeout's TERM, or its KILL after the grace

    def last_line(self) -> str:
        """The log's last line of the phase's own (not the suite's ``---`` lines)."""
        lines = [ln.strip() for ln in self.log.splitlines()
                 if ln.strip() and not ln.startswith(MARK)]
        return lines[-1][:160] if lines else "(nothing in the log)"

    def ended(self) -> str:
        """How the phase ended, in words."""
        if self.cut:
            return f"cut at its {self.limit_s}s limit"
        return f"exited {self.rc}" + (f": {self.last_line()}" if self.rc else "")

    def json(self, name: str) -> object:
        path = self.out / name
        if not path.exists():
            raise PhaseFailedError(f"no {name}: the phase wrote none ({self.ended()})")
        try:
            return json.loads(path.read_text())
        except ValueError as exc:
            raise PhaseFailedError(f"{name} is not JSON ({exc}; {self.ended()})") from None


# -- pytest ------------------------------------------------------------------------------------

COUNT = re.compile(r"\b(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)\b")
SUMMARY = re.compile(r"(\d+ (passed|failed|skipped|errors?|deselected)|no tests ran).* in [\d.]+s\b")
OUTCOME = re.compile(r"(?:^|\s)(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)(?:\s+\[\s*\d+%\])?\s*$")
VERBOSE = {"PASSED": "passed", "FAILED": "failed", "SKIPPED": "skipped", "ERROR": "error",
           "XFAIL": "xfailed", "XPASS": "xpassed"}


def pytest_counts(text: str) -> tuple[dict[str, int], bool]:
    """Outcome counts from pytest's last summary line, and True; where there is none (the run
    was cut), the outcomes ``-v`` named as they came, and False."""
    for line in reversed(text.splitlines()):
        if SUMMARY.search(line):
            return {kind.rstrip("s") if kind.startswith("error") else kind: int(n)
                    for n, kind in COUNT.findall(line)}, True
    counts: dict[str, int] = {}
    for line in text.splitlines():
        m = OUTCOME.search(line)
        if m:
            kind = VERBOSE[m[1]]
            counts[kind] = counts.get(kind, 0) + 1
    return counts, False


def pytest_result(run: Run, text: str | None = None) -> tuple[bool, str]:
    """PASS where something passed, nothing failed or erred, and pytest exited 0."""
    counts, complete = pytest_counts(run.log if text is None else text)
    passed, failed, errors, skipped = (counts.get(k, 0) for k in ("passed", "failed", "error",
                                                                     "skipped"))
    said = f"{passed} passed, {failed} failed, {skipped} skipped" + (f", {errors} errors" if errors
                                                                       else "")
    if run.cut:
        return False, f"cut at its {run.limit_s}s limit after {said}"
    if not complete:
        return False, f"no pytest summary ({run.ended()})"
    if passed + failed + errors == 0:
        return False, f"no tests ran ({run.ended()})"
    if failed or errors:
        return False, said
    if text is None and run.rc:
        return False, f"{said}, but {run.ended()}"
    return True, said


# -- the phases ----------------------------------------------------------------------------------

def env(run: Run) -> tuple[bool, str]:
    log = run.log
    gpus = re.search(r"^gpus (\d+)(.*)$", log, re.M)
    cxx = re.search(r"^C\+\+ codec: (\w+)(.*)$", log, re.M)
    works = re.search(r"^C\+\+ works: (\w+)(.*)$", log, re.M)
    nvrtc = re.search(r"^NVRTC: (.*)$", log, re.M)
    versions = re.search(r"^python (\S+) torch (\S+) .*?cupy (\S+)", log, re.M)
    if gpus is None:
        raise PhaseFailedError(f"no GPU count ({run.ended()})")
    count = int(gpus[1])
    parts = [f"{count} GPU(s){gpus[2].rstrip()}"]
    if versions:
        parts.append(f"torch {versions[2]}, cupy {versions[3]}")
    parts.append(f"C++ codec {cxx[1]}{cxx[2]}" if cxx else "C++ codec not reached")
    parts.append(f"C++ works {works[1]}{works[2]}" if works else "C++ works not reached")
    parts.append(f"NVRTC {nvrtc[1]}" if nvrtc else "NVRTC not reached")
    if "pip install failed" in log:
        parts.append("pip install failed (PYTHONPATH serves)")
    ok = (count > 0 and cxx is not None and cxx[1] == "True" and works is not None
          and works[1] == "True" and nvrtc is not None
          and nvrtc[1].startswith("compiled") and run.rc == 0)
    return ok, "; ".join(parts) + ("" if run.rc == 0 else f" ({run.ended()})")


def pytest_phase(run: Run) -> tuple[bool, str]:
    return pytest_result(run)


def graphs(run: Run) -> tuple[bool, str]:
    tests, marked, goals = run.log.rpartition(f"{MARK}planned_call_goals.py")
    if not marked:
        tests, goals = run.log, ""
    ok, said = pytest_result(run, tests)
    if not goals:
        return False, f"{said}; planned_call_goals.py did not run ({run.ended()})"
    try:
        run.json("graphs-goals.json")
    except PhaseFailedError as exc:
        return False, f"{said}; {exc}"
    host = re.search(r"^(PASS|FAIL|SKIP) graphs-host (\S+)", goals, re.M)
    if host is None:
        return False, f"{said}; no graphs-host line ({run.ended()})"
    return ok and host[1] == "PASS" and run.rc == 0, f"{said}; graphs-host {host[2]} {host[1]}"


def goals(run: Run) -> tuple[bool, str]:
    run.json("goals.json")
    lines = re.findall(r"^(PASS|FAIL|SKIP) (goal-\S+|records-host|cpp-replay-host|nccl-host) "
                       r"(\S+)", run.log, re.M)
    if not lines:
        raise PhaseFailedError(f"goals.json written, but no goal lines ({run.ended()})")
    met = sum(v == "PASS" for v, _, _ in lines)
    said = ", ".join(f"{name.removeprefix('goal-')} {value}" + ("" if v == "PASS" else " (missed)")
                     for v, name, value in lines)
    return met == len(lines) and run.rc == 0, f"{met} of {len(lines)} goals met: {said}"


def demo(run: Run) -> tuple[bool, str]:
    speeds = re.findall(r"\(([\d.]+)x (\w+)'s speed\)", run.log)
    if not speeds:
        raise PhaseFailedError(f"no mean-step line ({run.ended()})")
    speed, exact = speeds[-1]
    return run.rc == 0, f"{speed}x {exact}'s speed over the last steps (loco against {exact})"


def train(run: Run) -> tuple[bool, str]:
    names = ["fp32", "bf16"] + (["link"] if os.environ.get("TRAIN_LINK") else [])
    ok, parts = run.rc == 0, []
    for name in names:
        try:
            rows = {r["scheme"]: r for r in run.json(f"train-{name}.json")["rows"]}
        except PhaseFailedError as exc:
            ok = False
            parts.append(str(exc))
            continue
        loco, nccl = rows["loco"], rows["nccl"]
        finite = all(math.isfinite(r["final_loss"]) for r in (loco, nccl))
        ok = ok and finite
        parts.append(f"{nccl['step_ms'] / loco['step_ms']:.2f}x nccl's speed at {name} (bytes "
                     f"{loco['bytes_per_step'] / nccl['bytes_per_step']:.3f}, loss "
                     f"{loco['final_loss']:.4f} vs {nccl['final_loss']:.4f})")
    return ok, "; ".join(parts) + " (2 ranks sharing the GPU: timings of both)"


def exactperf(run: Run) -> tuple[bool, str]:
    rows = {r["backend"]: r for r in run.json("exactperf.json")["rows"]}
    loco, nccl = (rows[b]["in_place"]["time_us"] for b in ("loco-exact", "nccl"))
    return loco <= 1.2 * nccl and run.rc == 0, (
        f"{loco / nccl:.3f} loco-exact/nccl ({loco:.1f} vs {nccl:.1f} us, in place, 1 MiB, "
        "2 ranks; goal <= 1.2)")


def selftest(run: Run) -> tuple[bool, str]:
    found = re.findall(r"^(\d+) failed, (\d+) ok, (\d+) skipped", run.log, re.M)
    if not found:
        raise PhaseFailedError(f"no selftest summary ({run.ended()})")
    failed, ok, skipped = map(int, found[-1])
    # a GPU machine should skip nothing: a skip there is a missing GPU, CuPy or C++ codec
    return failed == 0 and skipped == 0 and ok > 0 and run.rc == 0, (
        f"{ok} ok, {failed} failed, {skipped} skipped")


def unfixed(run: Run) -> tuple[bool, str]:
    """A measurement, not a goal: PASS where the one test ran, and the line says whether it
    failed without ``ErrorState.record_stream`` (so catches the race the marking closes)."""
    counts, complete = pytest_counts(run.log)
    if run.cut or not complete:
        raise PhaseFailedError(f"the test did not finish ({run.ended()})")
    passed, failed = counts.get("passed", 0), counts.get("failed", 0)
    if passed + failed != 1 or counts.get("error") or counts.get("skipped"):
        said = ", ".join(f"{n} {kind}" for kind, n in counts.items())
        raise PhaseFailedError(f"not one test passed or failed: {said} ({run.ended()})")
    what = ("fails: it catches the missing marking" if failed
            else "still passes: the allocator did not reuse the memory, the race is not caught")
    return True, f"{failed} failed, {passed} passed: without record_stream the test {what}"


def launches(run: Run) -> tuple[bool, str]:
    rows = [ln.split() for ln in run.log.splitlines()
            if re.match(r"^\s*\d+\s+(compressed|exact)\s+[\d.]+\s", ln)]
    compressed = [r for r in rows if r[1] == "compressed"]
    if not compressed:
        raise PhaseFailedError(f"no table rows ({run.ended()})")
    largest = max(compressed, key=lambda r: int(r[0]))
    exact = [r for r in rows if r[1] == "exact" and r[0] == largest[0]]
    said = (f"{largest[-3]} kernels per compressed call at {largest[0]} elements (host "
            f"{largest[2]} us" + (f", exact {exact[0][2]} us" if exact else "") + "), world size 1")
    return run.rc == 0, said


def perf(run: Run) -> tuple[bool, str]:
    ratios, ok, missing = {}, run.rc == 0, []
    for np_ in (2, 1):
        try:
            rows = run.json(f"perf-np{np_}.json")["rows"]
        except PhaseFailedError as exc:
            ok = False
            missing.append(str(exc))
            continue
        times = {(r["backend"], r["size"]): r["in_place"]["time_us"] for r in rows}
        size = max(s for b, s in times if b == "nccl" and ("loco4", s) in times)
        ratios[np_] = (times["loco4", size] / times["nccl", size], size)
    said = ", ".join(f"{ratio:.2f} loco4/nccl time at {size >> 20} MiB on {n} rank(s)"
                     for n, (ratio, size) in ratios.items())
    return ok and len(ratios) == 2, "; ".join(filter(None, [said, *missing]))


def codec(run: Run) -> tuple[bool, str]:
    rows = [r for r in run.json("codec.json")["rows"]
            if r["impl"] == "cuda" and r["size_bytes"] >= 16 << 20]
    if not rows:
        raise PhaseFailedError("codec.json has no CUDA rows of 16 MiB or more")
    worst = {}
    for kind in ("encode", "decode"):  # the kernels' GPU time (the codec's goal), the whole call
        for on, copy in ((f"{kind}_device_GBps", "copy_device_GBps"), (f"{kind}_GBps", "copy_GBps")):
            worst[on.removesuffix("_GBps")] = min(r[on] / r[copy] for r in rows)
    low = min(worst.values())
    said = ", ".join(f"{name} {ratio:.2f}" for name, ratio in worst.items())
    return low >= 0.5 and run.rc == 0, (
        f"{low:.3f}x of a copy at worst ({said}; from 16 MiB, goal >= 0.5)")


VERDICTS: dict[str, Callable[[Run], tuple[bool, str]]] = {
    "env": env, "frame": pytest_phase, "plans": pytest_phase, "graphs": graphs,
    "goals": goals, "hier": pytest_phase, "demo": demo, "train": train,
    "places": pytest_phase, "exactperf": exactperf, "selftest": selftest,
    "pytest": pytest_phase, "unfixed": unfixed, "schedule": pytest_phase,
    "launches": launches, "perf": perf, "codec": codec,
}


def verdict(phase: str, out: Path, rc: int, limit_s: int) -> str:
    ended = f"exit {rc}"
    try:
        run = Run(phase, out, rc, limit_s)
        ended = run.ended()
        ok, said = VERDICTS[phase](run)
    except PhaseFailedError as exc:
        ok, said = False, str(exc)
    except Exception as exc:  # noqa: BLE001 (a JSON of another shape: a FAIL line, not a traceback)
        ok, said = False, f"unreadable results ({type(exc).__name__}: {exc}; {ended})"
    return f"{'PASS' if ok else 'FAIL'} {phase} {' '.join(said.split())}"


# -- the dry mode's stand-ins --------------------------------------------------------------------

def _pytest_stub(out: Path) -> None:
    print("tests/dry_stub.py::test_stand_in PASSED                                  [100%]")
    print("============================== 1 passed in 0.01s ==============================")


def _write(out: Path, name: str, data: object) -> None:
    (out / name).write_text(json.dumps(data, indent=1))


def _goals_lines(graphs_host: bool) -> None:
    for goal in ("host_us", "launches", "uploads", "allocations"):
        print(f"PASS goal-{goal} 0.00 (dry stand-in)")
    print("PASS records-host 0.500 (dry stand-in)")
    print("PASS cpp-replay-host 0.500 (dry stand-in)")
    print("PASS nccl-host 1.500 (dry stand-in)")
    if graphs_host:
        print("PASS graphs-host 0.500 (dry stand-in)")


def _stub(phase: str, out: Path) -> None:
    if phase == "env":
        print("python 3.12.3 torch dry cuda - nccl - cupy dry setuptools -")
        print("gpus 1 (dry stand-in)")
        print("C++ codec: True (0 s)")
        print("C++ works: True (0 s)")
        print("NVRTC: compiled 1 kernels in 0 s")
    elif phase in ("frame", "plans", "hier", "places", "pytest", "schedule"):
        _pytest_stub(out)
    elif phase == "graphs":
        _pytest_stub(out)
        print(f"{MARK}planned_call_goals.py --graphs")
        _write(out, "graphs-goals.json", [{"format": "dry", "rows": {}}])
        _goals_lines(graphs_host=True)
    elif phase == "goals":
        _write(out, "goals.json", [{"format": "dry", "rows": {}}])
        _goals_lines(graphs_host=False)
    elif phase == "demo":
        print("mean step over the last 20 steps (the cost model has settled): nccl 1.0 ms, "
              "loco 1.0 ms (1.00x nccl's speed)")
    elif phase == "train":
        row = {"step_ms": 1.0, "bytes_per_step": 1.0, "final_loss": 1.0}
        for name in ["fp32", "bf16"] + (["link"] if os.environ.get("TRAIN_LINK") else []):
            _write(out, f"train-{name}.json", {"rows": [{"scheme": "nccl", **row},
                                                       {"scheme": "loco", **row}]})
    elif phase == "exactperf":
        _write(out, "exactperf.json", {"rows": [{"backend": b, "size": 1 << 20,
                                                 "in_place": {"time_us": 1.0}}
                                                for b in ("loco-exact", "nccl")]})
    elif phase == "selftest":
        print("[  ok   ] dry stand-in\n\n0 failed, 1 ok, 0 skipped")
    elif phase == "unfixed":
        _pytest_stub(out)
        print("without record_stream the test exited 0")
    elif phase == "launches":
        print("  65536 compressed    1.0    1.0    0.00    3.0    0.0    0.0")
        print("  65536      exact    1.0    1.0    0.00    0.0    0.0    0.0")
    elif phase == "perf":
        for np_ in (1, 2):
            _write(out, f"perf-np{np_}.json", {"rows": [
                {"backend": b, "size": 64 << 20, "in_place": {"time_us": 1.0}}
                for b in ("loco4", "loco-model", "nccl")]})
    elif phase == "codec":
        speeds = {f"{k}_GBps": 1.0 for k in ("copy", "encode", "decode", "copy_device",
                                              "encode_device", "decode_device")}
        _write(out, "codec.json", {"rows": [{"impl": "cuda", "size_bytes": 16 << 20,
                                             "format": f, **speeds} for f in ("mxfp4", "nvfp4")]})
    else:
        raise SystemExit(f"no stand-in for phase {phase!r}")


def main(argv: list[str]) -> int:
    if argv in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if len(argv) == 5 and argv[0] == "verdict" and argv[1] in VERDICTS:
        try:
            rc, limit = int(argv[3]), int(argv[4])
        except ValueError:
            rc, limit = -1, 0
        print(verdict(argv[1], Path(argv[2]), rc, limit))
        return 0
    if len(argv) == 3 and argv[0] == "stub" and argv[1] in VERDICTS:
        _stub(argv[1], Path(argv[2]))
        return 0
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
