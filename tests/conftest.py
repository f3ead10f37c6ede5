import os

import pytest

# The cost model (LocoConfig.cost_model) may send a compressible call exact once it has timed
# both paths; tests that count compressed calls of a training run want every one compressed.
# Its own tests turn it on (tests/backend/test_cost_model.py).
os.environ.setdefault("LOCO_COST_MODEL", "0")

# LOWBITCC_REQUIRE_GPU=1: a GPU test that skips fails instead (tests/support/require_gpu.py).
pytest_plugins = ["tests.support.require_gpu"]


@pytest.fixture(scope="session", autouse=True)
def _build_cpu_codec_once():
    """Build the C++ codec before any rank process needs it (the first build takes ~1 min)."""
    from lowbitcc.codec import cpu

    cpu.load()
