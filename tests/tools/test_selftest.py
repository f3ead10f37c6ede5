"""`lowbitcc selftest` on a machine without a GPU: environment, the C++ codec against the
reference, GPU checks skipped with the reason; a kernel that differs is reported and fails."""

from __future__ import annotations

import subprocess
import sys

import torch

from lowbitcc.codec import cpu
from lowbitcc.tools import selftest


def test_selftest_without_gpu_passes_and_names_what_it_skipped():
    done = subprocess.run([sys.executable, "-m", "lowbitcc.tools.cli", "selftest", "--no-gpu",
                           "--cases", "40"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "torch:" in done.stdout and "C++ CPU codec:" in done.stdout
    assert "[  ok   ] cpu kernels vs reference (40 cases, cpu)" in done.stdout
    assert "[skipped] GPU checks: --no-gpu" in done.stdout


class _OffByOneScale:
    """The C++ kernels with one scale bit flipped after every encode."""

    name = "broken"
    writes_every_byte = True

    def encode(self, args):
        cpu.KERNELS.encode(args)
        args.messages[:, 32] ^= 1

    def decode_sum(self, *a):
        cpu.KERNELS.decode_sum(*a)

    def decode_into(self, *a):
        cpu.KERNELS.decode_into(*a)

    def checksum(self, messages):
        return cpu.KERNELS.checksum(messages)

    def frame(self, *a):
        return cpu.KERNELS.frame(*a)

    def verify(self, *a):
        return cpu.KERNELS.verify(*a)


def test_a_kernel_that_differs_fails_the_check():
    outcome = selftest.check_kernels(_OffByOneScale(), "cpu", 5)
    assert outcome.status == "FAIL" and "encoded messages differ" in outcome.detail


def test_cases_cover_every_corner_first():
    first = list(selftest.cases(3 * 4 * 4 * 3))
    corners = {(c.bits, c.group, c.error_dtype, c.poison) for c in first}
    assert len(corners) == 3 * 4 * 4 * 3
    assert {c.dtype for c in first} == {torch.float32, torch.bfloat16, torch.float16}
