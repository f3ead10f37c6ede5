import pytest


@pytest.fixture(scope="session", autouse=True)
def _build_cpu_codec_once():
    """Build the C++ codec before any rank process needs it (the first build takes ~1 min)."""
    from lowbitcc.codec import cpu

    cpu.load()
