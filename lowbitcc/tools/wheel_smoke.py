"""Does lowbitcc install from a wheel? ``python -m lowbitcc.tools.wheel_smoke [--python
python3.11 ...] [--demo]`` builds the wheel (``python -m build``), then for each interpreter
makes a fresh venv, installs torch and the wheel (not editable), and, from a folder outside the
checkout, checks:

1. ``import lowbitcc`` with torch's backend autoload off (``TORCH_DEVICE_BACKEND_AUTOLOAD=0``)
   registers "loco", and without ``import lowbitcc`` the autoload entry point does;
2. a 2-rank compressed all-reduce (every call compressed) equals the reference codec's sum on
   both ranks, and the C++ codec was built once, into torch's extension cache (a fresh
   ``TORCH_EXTENSIONS_DIR`` outside site-packages), with one warning line naming the folder;
3. with ``--demo``, ``lowbitcc demo --steps 6 --link none`` runs.

An interpreter with no torch (``TORCH_SPEC``) among pip's local wheels is skipped, saying so:
PyPI's torch for Linux is a CUDA build of several GB (``--download`` takes it anyway). Prints
one line per check and exits non-zero if any failed.
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger("lowbitcc.tools.wheel_smoke")

TORCH_SPEC = "torch==2.13.0"
ROOT = Path(__file__).resolve().parents[2]

ALL_REDUCE = r"""
import os, sys, tempfile, warnings
import torch, torch.distributed as dist, torch.multiprocessing as mp

def rank(r, path, out):
    import lowbitcc
    from lowbitcc.codec import reference
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.init_process_group("loco", init_method=f"file://{path}", rank=r, world_size=2)
    y = torch.randn(1 << 17, generator=torch.Generator().manual_seed(r))
    with lowbitcc.compressed():
        dist.all_reduce(y)
    exact = sum(torch.randn(1 << 17, generator=torch.Generator().manual_seed(k)) for k in range(2))
    err = float((y - exact).norm() / exact.norm())
    calls = lowbitcc.stats()["compressed"]["calls"]
    built = [str(w.message) for w in caught if "building the C++" in str(w.message)]
    torch.save({"err": err, "calls": calls, "built": built, "sum": y}, f"{out}.{r}")
    dist.destroy_process_group()

if __name__ == "__main__":
    d = tempfile.mkdtemp()
    mp.spawn(rank, args=(os.path.join(d, "store"), os.path.join(d, "out")), nprocs=2)
    a, b = (torch.load(os.path.join(d, f"out.{r}")) for r in range(2))
    assert torch.equal(a["sum"], b["sum"]), "ranks differ"
    assert a["calls"] == 1 and a["err"] < 0.2, (a["calls"], a["err"])
    print("ALLREDUCE ok err=%.4f built=%r" % (a["err"], a["built"] + b["built"]))
"""


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None,
         timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)


def build_wheel(out: Path) -> Path:
    done = _run([sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(ROOT)], ROOT)
    if done.returncode:
        raise RuntimeError(f"python -m build failed: {done.stderr[-2000:]}")
    return Path(glob.glob(str(out / "lowbitcc-*.whl"))[0])


def smoke(python: str, wheel: Path, work: Path, demo: bool,
          download: bool = False) -> dict[str, str]:
    """The checks of the module docstring for ``python``: ``{check: "ok" | "FAILED ..." |
    "skipped ..."}``."""
    venv = work / f"venv-{Path(python).name}"
    done = _run([python, "-m", "venv", str(venv)], work)
    if done.returncode:
        return {"venv": f"skipped: {done.stderr.strip()[-300:]}"}
    py = str(venv / "bin" / "python")
    local = _run([py, "-m", "pip", "download", "-q", "--no-index", "--no-deps", "-d",
                  str(work / "probe"), TORCH_SPEC], work)
    if local.returncode and not download:
        return {"torch": f"skipped: no local wheel of {TORCH_SPEC} for {Path(python).name} "
                "(PyPI's is a CUDA build of several GB; --download takes it)"}
    done = _run([py, "-m", "pip", "install", "-q", TORCH_SPEC], work, timeout=3600)
    if done.returncode:
        return {"torch": f"skipped: pip finds no {TORCH_SPEC}: {done.stderr.strip()[-300:]}"}
    done = _run([py, "-m", "pip", "install", "-q", str(wheel)], work)
    if done.returncode:
        return {"install": f"FAILED {done.stderr[-1000:]}"}
    results = {"install": "ok"}
    env = {"TORCH_EXTENSIONS_DIR": str(work / f"ext-{Path(python).name}"), "PYTHONPATH": ""}
    check = ("import torch.distributed as dist; assert 'loco' not in dist.Backend.backend_list; "
             "import lowbitcc; assert 'loco' in dist.Backend.backend_list; "
             "assert 'site-packages' in lowbitcc.__file__, lowbitcc.__file__")
    done = _run([py, "-c", check], work, {**env, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    results["import without autoload"] = "ok" if not done.returncode else f"FAILED {done.stderr}"
    done = _run([py, "-c", "import torch.distributed as dist; "
                 "assert 'loco' in dist.Backend.backend_list"], work, env)
    results["autoload"] = "ok" if not done.returncode else f"FAILED {done.stderr[-1000:]}"
    script = work / "all_reduce.py"
    script.write_text(ALL_REDUCE)
    done = _run([py, str(script)], work, env)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("ALLREDUCE ok")), None)
    cache = env["TORCH_EXTENSIONS_DIR"]
    built_once = line is not None and "building the C++" in line and cache in line
    results["2-rank compressed all-reduce"] = (
        f"ok, the C++ codec built into {cache} ({line.split()[2]})" if built_once
        else f"FAILED {done.stdout[-500:]} {done.stderr[-1500:]}")
    if demo:
        done = _run([str(venv / "bin" / "lowbitcc"), "demo", "--steps", "6", "--link", "none"],
                    work, env)
        results["demo"] = "ok" if not done.returncode else f"FAILED {done.stderr[-1500:]}"
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lowbitcc.tools.wheel_smoke",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", nargs="+", default=[sys.executable],
                        help="interpreters to try (default: this one)")
    parser.add_argument("--demo", action="store_true", help="also run the demo")
    parser.add_argument("--download", action="store_true",
                        help="install torch from PyPI where no local wheel fits")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    failed = False
    with tempfile.TemporaryDirectory(prefix="lowbitcc-wheel-") as tmp:
        work = Path(tmp)
        wheel = build_wheel(work / "dist")
        print(f"built {wheel.name}", flush=True)
        for python in args.python:
            for check, result in smoke(python, wheel, work, args.demo, args.download).items():
                print(f"{python}: {check}: {result}", flush=True)
                failed |= result.startswith("FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
