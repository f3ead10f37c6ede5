"""Fixtures of the codec's tests: the CUDA kernels built for the host (`tests.support.cuda_host`),
once per session (about 5 s of g++), and their launcher standing in for CuPy's."""

from __future__ import annotations

import pytest

from lowbitcc.codec import cpu, cuda, cuda_build
from tests.support import cuda_host


@pytest.fixture(scope="session")
def host(tmp_path_factory) -> cuda_host.HostKernels:
    if cuda_host.compiler() is None or cpu.load() is None:
        pytest.skip("g++ or the C++ codec is missing")
    return cuda_host.HostKernels(cuda_build.name_expressions(),
                                 tmp_path_factory.mktemp("cuda_host"))


@pytest.fixture
def on_host(host, monkeypatch) -> cuda_host.HostKernels:
    """`cuda.CudaKernels` launching on the host harness (CPU tensors)."""
    monkeypatch.setattr(cuda, "_launch", host.launch)
    host.launched.clear()
    return host
