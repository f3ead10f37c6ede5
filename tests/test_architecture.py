"""The shape of the package: no import cycles, no side effects of ``import lowbitcc`` beyond the
backend name, the layer contracts (import-linter) and style (ruff) that CI enforces."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp", reason="the test extra (pip install -e '.[test]') installs grimp")

ROOT = Path(__file__).parents[1]


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_import_graph_has_no_cycles():
    graph = grimp.build_graph("lowbitcc")
    assert "lowbitcc.backend.process_group" in graph.modules
    assert _cycles(graph) == []


IMPORT_PROBE = """
import torch, torch.distributed as dist
from torch.optim import optimizer
before = len(optimizer._global_optimizer_post_hooks)
import lowbitcc
after_import = len(optimizer._global_optimizer_post_hooks)
assert "loco" in dist.Backend.backend_list
dist.init_process_group("loco", init_method="file://" + __import__("tempfile").mktemp(),
                        rank=0, world_size=1)
after_group = len(optimizer._global_optimizer_post_hooks)
dist.destroy_process_group()
print(before, after_import, after_group)
"""


def test_import_registers_only_the_name_and_the_first_group_installs_the_step_hook():
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    done = subprocess.run([sys.executable, "-c", IMPORT_PROBE], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    before, after_import, after_group = map(int, done.stdout.split())
    assert after_import == before
    assert after_group == before + 1


def test_layer_contracts_hold():
    """The import-linter contracts of pyproject.toml (installed with the test extra)."""
    done = subprocess.run([shutil.which("lint-imports") or "lint-imports"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:]


def test_ruff_is_clean():
    """ruff with pyproject.toml's rules (installed with the test extra)."""
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "."], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:]


MODULE_LINES = 400
"""The most lines of a library module (C++ and CUDA sources aside)."""
PROCESS_GROUP_LINES = 350
BACKEND_FUNCTION_LINES = 60


def test_modules_and_backend_functions_stay_readable():
    import ast

    long_modules, long_functions = [], []
    for path in sorted((ROOT / "lowbitcc").rglob("*.py")):
        text = path.read_text()
        limit = PROCESS_GROUP_LINES if path.name == "process_group.py" else MODULE_LINES
        if text.count("\n") > limit:
            long_modules.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} > {limit}")
        if path.parent.name != "backend":
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > BACKEND_FUNCTION_LINES:
                    long_functions.append(f"{path.name}:{node.lineno} {node.name} {lines}")
    assert not long_modules and not long_functions, (long_modules, long_functions)
