"""benchmarks/ holds tools only (benchmarks/README.md): every script answers ``--help`` (exit 0, a
usage on stdout) without importing torch, numpy or lowbitcc (each imports them after reading its
arguments, so a mistyped option fails in a fraction of a second), says in its module docstring
(``gpu_suite.sh``: its header comment) which doc it feeds, and is listed in the README, which
lists nothing else."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py"))
HEAVY = {"torch", "numpy", "lowbitcc"}
"""Modules a script's ``--help`` must not import (``-X importtime`` names each one imported)."""
DOC = re.compile(r"docs/[\w./-]+\.md")


def _imported(stderr: str) -> set[str]:
    """The modules ``python -X importtime`` reported importing."""
    return {line.rsplit("|", 1)[-1].strip() for line in stderr.splitlines()
            if line.startswith("import time:")}


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_script_prints_its_usage_for_help_without_importing_torch(name):
    done = subprocess.run([sys.executable, "-X", "importtime", str(BENCHMARKS / name), "--help"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage" in done.stdout.lower(), done.stdout
    assert not _imported(done.stderr) & HEAVY, sorted(_imported(done.stderr) & HEAVY)


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_script_says_what_it_measures_and_which_doc_it_feeds(name):
    doc = ast.get_docstring(ast.parse((BENCHMARKS / name).read_text()))
    assert doc, f"{name} has no module docstring"
    assert DOC.search(doc), f"{name}'s docstring names no docs/*.md it feeds"


def test_the_gpu_suite_prints_its_usage_and_names_its_doc():
    done = subprocess.run(["bash", str(BENCHMARKS / "gpu_suite.sh"), "--help"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "Usage: bash benchmarks/gpu_suite.sh" in done.stdout
    assert DOC.search(done.stdout), done.stdout


def test_the_readme_lists_every_file_of_benchmarks_and_nothing_else():
    readme = (BENCHMARKS / "README.md").read_text()
    files = {p.name for p in BENCHMARKS.iterdir() if p.is_file() and p.name != "README.md"}
    listed = set(re.findall(r"^\| `([^`]+)` \|", readme, re.M))
    assert listed == files, (sorted(files - listed), sorted(listed - files))
    assert not [name for name in files if re.search(r"issue\d", name)]  # named for what they do
