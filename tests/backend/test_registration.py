"""Installing the package makes "loco" a backend name, with or without `import lowbitcc`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
        timeout=120, env=full_env,
    )


SCRIPT = """
    import sys, tempfile, torch
    import torch.distributed as dist
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("loco", init_method=f"file://{tmp}/s", rank=0, world_size=1)
        t = torch.ones(4)
        dist.all_reduce(t)
        print(dist.get_backend(), "lowbitcc" in sys.modules, t.tolist())
        dist.destroy_process_group()
"""


def test_unmodified_script_finds_loco_through_entry_point_autoload():
    out = _run(SCRIPT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "loco"


def test_autoload_can_be_disabled_and_import_registers():
    off = _run(SCRIPT, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert off.returncode != 0 and "loco" in off.stderr
    on = _run("import lowbitcc\n" + textwrap.dedent(SCRIPT), TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert on.returncode == 0, on.stderr
