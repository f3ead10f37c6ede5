import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session", autouse=True)
def _build_cpu_codec_once():
    """Build the C++ codec before any rank process needs it (the first build takes ~1 min)."""
    from lowbitcc.kernels import cpu

    cpu.load()
