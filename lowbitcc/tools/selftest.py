"""``lowbitcc selftest``: what a user runs first on a new machine.

Prints the environment (torch and its CUDA, NCCL, CuPy and NVRTC, mpi4py, compilers, which
codecs build), then checks what the machine can check:

- the C++ CPU codec against the reference, bit for bit, on random and adversarial cases (NaN,
  Inf, every bit width, group size, error storage, rounding);
- on a GPU: the CUDA kernels against the reference on the same cases; encode and decode
  throughput against a device-to-device copy; a world-size-1 "loco" group whose compressed
  all-reduce of a CUDA tensor must equal, bit for bit, the same call on a CPU tensor, enqueue
  without a host synchronisation, and order correctly with ``async_op=True``.

Returns non-zero on any mismatch. A check the machine cannot run is reported as skipped, with
the reason.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import itertools
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator

import torch

from lowbitcc.codec import formats

log = logging.getLogger("lowbitcc")

ERROR_DTYPES = (None, "int8", "fp32", "bf16")


@dataclasses.dataclass
class Outcome:
    name: str
    status: str  # "ok", "FAIL", "skipped"
    detail: str = ""


def environment() -> list[tuple[str, str]]:
    """``(name, value)`` rows describing this machine."""
    rows = [("python", platform.python_version()), ("torch", torch.__version__),
            ("torch CUDA", str(torch.version.cuda)),
            ("GPUs", str(torch.cuda.device_count()) if torch.cuda.is_available() else "0")]
    if torch.cuda.is_available():
        rows.append(("GPU 0", f"{torch.cuda.get_device_name(0)} "
                              f"(sm_{''.join(map(str, torch.cuda.get_device_capability(0)))})"))
    try:
        rows.append(("NCCL (torch)", ".".join(map(str, torch.cuda.nccl.version()))))
    except Exception as exc:  # noqa: BLE001 (CPU builds have none)
        rows.append(("NCCL (torch)", f"none ({type(exc).__name__})"))
    rows.append(("CuPy", _version("cupy")))
    try:
        from cupy_backends.cuda.libs import nvrtc

        rows.append(("NVRTC", ".".join(map(str, nvrtc.getVersion()))))
    except Exception as exc:  # noqa: BLE001 (no CuPy or no libnvrtc)
        rows.append(("NVRTC", f"none ({type(exc).__name__})"))
    rows.append(("mpi4py", _version("mpi4py")))
    for tool in ("g++", "nvcc"):
        path = shutil.which(tool)
        rows.append((tool, _first_line([path, "--version"]) if path else "not found"))
    from lowbitcc.codec import cpu, cuda

    rows.append(("C++ CPU codec", "builds" if cpu.load() is not None else "does not build"))
    rows.append(("CUDA codec", _cuda_codec_status(cuda)))
    return rows


def _version(name: str) -> str:
    try:
        return str(importlib.import_module(name).__version__)
    except Exception as exc:  # noqa: BLE001 (absent or broken)
        return f"not importable ({type(exc).__name__})"


def _first_line(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"failed ({exc})"
    lines = [line for line in out.splitlines() if line.strip()]
    return lines[-1] if cmd[0].endswith("nvcc") and lines else (lines[0] if lines else "")


def _cuda_codec_status(cuda) -> str:
    if not cuda.available():
        return "no GPU seen by CuPy"
    try:
        cuda.module().get_function(cuda.name_expressions()[0])
    except Exception as exc:  # noqa: BLE001 (reported, and the GPU checks then fail)
        return f"does not build: {exc}"
    return "builds"


# -- codec cases ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    rows: int
    m: int
    bits: int
    group: int
    dtype: torch.dtype
    error_dtype: str | None
    with_state: bool
    beta: float
    factor: float
    poison: str | None
    rounding: str
    seed: int
    fmt: str = "int"


WIRES = formats.WIRES
"""(bits, code format) pairs the kernels implement (`lowbitcc.codec.formats`)."""


def fit_to_format(fmt: str, group: int, rounding: str) -> tuple[int, str]:
    """``(group, rounding)`` as format ``fmt`` takes them: its own group where it has only one,
    nearest rounding where it has no other."""
    spec = formats.FORMATS[fmt]
    return (spec.default_group if spec.fixed_group else group,
            rounding if rounding in spec.roundings else "nearest")


def cases(count: int, seed: int = 0) -> Iterator[Case]:
    """``count`` cases: first every (bits, format) x group x error storage x poison corner at
    small sizes, then random ones (sizes up to 2500 elements per row)."""
    corners = itertools.product(WIRES, (8, 32, 128, 256), ERROR_DTYPES, (None, "nan", "inf"))
    gen = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    for i in range(count):
        corner = next(corners, None)
        wire, group, error_dtype, poison = corner or (
            pick(WIRES), pick((8, 32, 128, 256)), pick(ERROR_DTYPES), pick((None, "nan", "inf")))
        bits, fmt = wire
        group, rounding = fit_to_format(fmt, group, pick(("nearest", "stochastic")))
        yield Case(
            rows=int(torch.randint(1, 5, (1,), generator=gen)),
            m=int(torch.randint(1, 2500, (1,), generator=gen)) if corner is None else 1 + 37 * i % 700,
            bits=bits, group=group, dtype=pick((torch.float32, torch.bfloat16, torch.float16)),
            error_dtype=error_dtype, with_state=bool(torch.randint(2, (1,), generator=gen)),
            beta=pick((0.0, 0.5, 0.8)), factor=pick((1.0, 0.25, 1 / 3)), poison=poison,
            rounding=rounding, seed=i, fmt=fmt)


def compare_kernels(kernels, device: str, case: Case) -> str | None:
    """Encode and decode ``case`` with the reference and with ``kernels`` on ``device``; None if
    every byte agrees, else what differs (decoded NaNs compare by position)."""
    from lowbitcc.codec.error_state import ErrorState
    from lowbitcc.codec.kernels import REFERENCE
    from lowbitcc.codec.shard_codec import ShardCodec

    gen = torch.Generator().manual_seed(case.seed)
    header = dict(bits=case.bits, group_size=case.group, dtype_code=0, seq=5, world=4,
                  signature=3, rounding=case.rounding, seed=case.seed, fmt=case.fmt)
    ref = ShardCodec(kernels=REFERENCE, **header)
    ker = ShardCodec(kernels=kernels, **header)
    numel = max(case.rows * case.m - case.m // 3, 1)
    x = (torch.randn(numel, generator=gen) * 3).to(case.dtype)
    if case.poison:
        x[int(torch.randint(numel, (1,), generator=gen))] = float(case.poison)
    state = None
    if case.error_dtype and case.with_state:
        e = torch.randn(case.rows * ref.padded(case.m), generator=gen) * 0.1
        state = ErrorState.encode(e, case.error_dtype, case.group)
    shards = list(range(case.rows))
    a = ref.encode(x, case.rows, case.m, case.factor, None if state is None else state.clone(),
                   case.beta, shards, case.error_dtype, 77)
    b = ker.encode(x.to(device), case.rows, case.m, case.factor,
                   None if state is None else state.to(device, copy=True), case.beta, shards,
                   case.error_dtype, 77)
    if not torch.equal(a.messages, b.messages.cpu()):
        return "encoded messages differ"
    if a.nonfinite != b.nonfinite:
        return "non-finite flags differ"
    if not any(a.nonfinite) and a.error is not None:
        if not torch.equal(a.error.data.view(torch.uint8).view(-1),
                           b.error.data.cpu().view(torch.uint8).view(-1)):
            return "new error state differs"
        if a.error.scales is not None and not torch.equal(
                a.error.scales.view(torch.int32), b.error.scales.cpu().view(torch.int32)):
            return "new error state's scales differ"
    total_a, _ = ref.decode_sum(a.messages[:1].repeat(3, 1), case.m, 0)
    total_b, _ = ker.decode_sum(b.messages[:1].repeat(3, 1).contiguous(), case.m, 0)
    if not same_bits(total_a, total_b.cpu()):
        return "decode_sum differs"
    out_a = torch.empty(numel, dtype=case.dtype)
    out_b = torch.empty(numel, dtype=case.dtype, device=device)
    ref.decode_into(a.messages, case.m, shards, out_a)
    ker.decode_into(b.messages, case.m, shards, out_b)
    if not same_bits(out_a, out_b.cpu()):
        return "decode_into differs"
    return None


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaNs compared by position (their payload is not specified)."""
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a[~nan].view(bits), b[~nan].view(bits))


def check_kernels(kernels, device: str, count: int) -> Outcome:
    name = f"{kernels.name} kernels vs reference ({count} cases, {device})"
    for case in cases(count):
        problem = compare_kernels(kernels, device, case)
        if problem:
            return Outcome(name, "FAIL", f"{problem}: {case}")
    return Outcome(name, "ok")


# -- GPU checks -----------------------------------------------------------------------------------
def throughput(numel: int = 1 << 26) -> Outcome:
    """Encode/decode GB/s of fp32 input on GPU 0, and a device-to-device copy's for scale."""
    from lowbitcc.codec.kernels import select
    from lowbitcc.codec.shard_codec import ShardCodec

    x = torch.randn(numel, device="cuda")
    out = torch.empty(numel, device="cuda")
    copy_s = _cuda_time(lambda: out.copy_(x))
    gb = numel * 4 / 1e9
    parts = [f"fp32 input {gb:.2f} GB: copy {2 * gb / copy_s:.0f} GB/s (read+write)"]
    for fmt, group in ((f.name, f.default_group) for f in formats.TABLE):
        codec = ShardCodec(4, group, 0, 1, 1, 1, kernels=select("auto", "cuda", group), fmt=fmt)
        messages = codec.encode(x, 1, numel, 1.0, None, 0.8, [0], "int8").messages
        encode_s = _cuda_time(functools.partial(codec.encode, x, 1, numel, 1.0, None, 0.8, [0],
                                                "int8"))
        decode_s = _cuda_time(functools.partial(codec.decode_sum, messages, numel, 0, out))
        parts.append(f"{fmt}/{group}: encode {gb / encode_s:.0f} GB/s ({copy_s / encode_s:.2f}x "
                     f"copy time), decode {gb / decode_s:.0f} GB/s of output "
                     f"({copy_s / decode_s:.2f}x)")
    return Outcome("CUDA codec throughput", "ok", "; ".join(parts))


def _cuda_time(fn: Callable[[], object], reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def world_one_all_reduce() -> list[Outcome]:
    """A world-size-1 "loco" group on GPU 0: compressed all-reduce of a CUDA tensor against the
    same call on a CPU tensor (the C++ codec); no host synchronisation; ``async_op=True``."""
    import torch.distributed as dist

    import lowbitcc

    outcomes = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.cuda.set_device(0)
        config = lowbitcc.LocoConfig(policy="always", cost_model=False, schedule="direct", min_size=1)
        dist.init_process_group("loco", init_method=f"file://{tmp}/store", rank=0, world_size=1,
                                pg_options=config)
        try:
            gen = torch.Generator().manual_seed(1)
            x = torch.randn(300_007, generator=gen)
            on_cpu, on_gpu = x.clone(), x.cuda()
            with lowbitcc.feedback_key("selftest-cpu"):
                dist.all_reduce(on_cpu)
            with lowbitcc.feedback_key("selftest-gpu"):
                dist.all_reduce(on_gpu)
            same = torch.equal(on_cpu.view(torch.int32), on_gpu.cpu().view(torch.int32))
            changed = not torch.equal(on_cpu, x)
            outcomes.append(Outcome("world-1 compressed all-reduce, CUDA == CPU bit for bit",
                                    "ok" if same and changed else "FAIL",
                                    "" if same else "results differ"))
            y = x.cuda()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                with lowbitcc.feedback_key("selftest-gpu"):
                    dist.all_reduce(y)
                status, detail = "ok", ""
            except RuntimeError as exc:
                status, detail = "FAIL", str(exc).splitlines()[0]
            finally:
                torch.cuda.set_sync_debug_mode(0)
            outcomes.append(Outcome("compressed all-reduce enqueues without a host sync",
                                    status, detail))
            outcomes.append(async_ordering(x))
        finally:
            dist.destroy_process_group()
    return outcomes


def async_ordering(x: torch.Tensor, busy_products: int = 20) -> Outcome:
    """On the default "loco" group: a compressed ``async_op=True`` all-reduce of a tensor still
    being written behind ``busy_products`` matrix products on the current stream must equal the
    synchronous call's result (the side stream waits for the writer, and ``wait()`` orders the
    caller after the call)."""
    import torch.distributed as dist

    import lowbitcc

    big = torch.randn(4096, 4096, device="cuda")
    expected = x.cuda()
    with lowbitcc.compressed(), lowbitcc.feedback_key("selftest-order-sync"):
        dist.all_reduce(expected)
    torch.cuda.synchronize()
    y = torch.zeros_like(expected)
    for _ in range(busy_products):
        big = big @ big / 64  # keep the current stream busy
    y.copy_(x, non_blocking=True)
    with lowbitcc.compressed(), lowbitcc.feedback_key("selftest-order-async"):
        work = dist.all_reduce(y, async_op=True)
    work.wait()
    z = y.clone()
    same = torch.equal(z.cpu(), expected.cpu())
    return Outcome("async_op=True orders with the caller's stream", "ok" if same else "FAIL",
                   "" if same else "the result differs from the synchronous call's")


def run(count: int = 400, gpu: bool = True, ranks: int = 0) -> int:
    """Print the environment and every check (``ranks`` > 0: also the multi-rank checks on
    that many ranks, `selftest_ranks`); 0 when nothing failed."""
    for name, value in environment():
        print(f"{name:>16}: {value}")
    print()
    from lowbitcc.codec import cpu, cuda

    outcomes: list[Outcome] = []
    if cpu.load() is not None:
        outcomes.append(check_kernels(cpu.KERNELS, "cpu", count))
    else:
        outcomes.append(Outcome("cpu kernels vs reference", "skipped", "the C++ codec does not build"))
    if not gpu:
        outcomes.append(Outcome("GPU checks", "skipped", "--no-gpu"))
    elif not cuda.available():
        outcomes.append(Outcome("GPU checks", "skipped", "no GPU seen by torch and CuPy"))
    else:
        outcomes.append(check_kernels(cuda.KERNELS, "cuda", count))
        outcomes.append(throughput())
        from lowbitcc.backend.cuda_issue import cuda_usable

        if cuda_usable():
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
            outcomes.extend(world_one_all_reduce())
            if ranks:
                from lowbitcc.tools import selftest_ranks

                outcomes.extend(Outcome(*row) for row in selftest_ranks.check(ranks))
        else:
            outcomes.append(Outcome("world-1 group", "skipped", "torch has no NCCL"))
    for o in outcomes:
        print(f"[{o.status:^7}] {o.name}" + (f": {o.detail}" if o.detail else ""))
    failed = [o for o in outcomes if o.status == "FAIL"]
    print(f"\n{len(failed)} failed, {sum(o.status == 'ok' for o in outcomes)} ok, "
          f"{sum(o.status == 'skipped' for o in outcomes)} skipped")
    return 1 if failed else 0


__all__ = ["Outcome", "async_ordering", "cases", "check_kernels", "compare_kernels",
           "environment", "run"]
