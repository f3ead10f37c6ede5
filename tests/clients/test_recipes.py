"""The recipes of docs/integrations.md, each trained under torchrun over "loco" and over gloo:
compressed gradients, lowbitcc's metrics logged, the loss within 2% of gloo's. Marked
``clients``: ``pip install -e '.[clients]' && pytest -m clients``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.clients

ENV = {"LOCO_COST_MODEL": "0", "LOCO_MIN_SIZE": "4096", "OMP_NUM_THREADS": "1"}
CASES = {
    "lightning-ddp": ("lightning", ["tests/clients/recipes/lightning_recipe.py", "{b}", "ddp"]),
    "lightning-fsdp2": ("lightning", ["tests/clients/recipes/lightning_recipe.py", "{b}", "fsdp2"]),
    "hf-trainer": ("transformers", ["tests/clients/recipes/hf_recipe.py", "{b}", "{tmp}"]),
    "accelerate": ("accelerate", ["tests/clients/recipes/accelerate_recipe.py", "{b}"]),
}


def _run(argv: list[str], backend: str, tmp: str) -> dict:
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", *[a.format(b=backend, tmp=tmp) for a in argv]]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **ENV, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, done.stdout[-2000:]
    return json.loads(lines[0][len("RESULT "):])


@pytest.mark.parametrize("case", list(CASES))
def test_recipe_trains_over_loco_as_over_gloo(case, tmp_path):
    package, argv = CASES[case]
    pytest.importorskip(package)
    loco = _run(argv, "loco", str(tmp_path / "loco"))
    gloo = _run(argv, "gloo", str(tmp_path / "gloo"))
    assert loco["backend"] == "loco" and gloo["backend"] == "gloo"
    assert loco["compressed_calls"] > 0 and gloo["compressed_calls"] == 0
    assert "loco/compression" in loco["logged"]
    assert abs(loco["loss"] - gloo["loss"]) / gloo["loss"] < 0.02, (loco, gloo)
