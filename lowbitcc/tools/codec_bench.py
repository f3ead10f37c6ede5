"""`lowbitcc codec-bench`: codec throughput next to the copy bandwidth of the same tensor.

For each size (bytes of fp32 input) and thread count it times, median of repeats:

- ``copy``: ``dst.copy_(src)`` into a preallocated tensor (the memory-bandwidth baseline);
- ``encode``: the fused LoCo encode of the tensor as one shard row (fp32 input, int8 error state
  read and written back, codes in each format asked for at its width, `formats.Format.width`:
  4-bit MXFP4 in groups of 32, int in groups of 128, NVFP4 in groups of 16, 3-bit nvint3 and
  nvfp3 in groups of 16) into a preallocated message buffer, per implementation;
- ``decode``: decode-and-sum of 4 messages of a quarter of the elements each (the reduce-scatter
  receive side) into a preallocated fp32 output, as the copy writes into one, per
  implementation;
- ``checksum``: the checksum of the encoded message alone (`wire`), which encode computes and
  decode verifies; reported as its share of the encode and of the decode time.

Throughput is input fp32 bytes per second (GB/s = 1e9 B/s) for all three, so ratios to ``copy``
compare like with like. Results go to a table on stdout and, with ``--json``, to a file.

``device="cuda"`` measures on the current GPU (the CUDA kernels and the reference; each sample
ends with a device synchronisation, and the thread count does not apply). Below 64 MiB such a
sample is bound by the host (the codec call's Python and launches), so on CUDA each row also
gives the *device* throughput (``*_device_GBps``): input bytes over the GPU time of the work the
call enqueued (its kernels, memsets and copies, summed from torch.profiler's CUPTI records),
the copy's measured the same way; the per-call goals' bandwidth goal reads these.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import torch

from lowbitcc.codec import cpu, kernels
from lowbitcc.codec.error_state import ErrorState
from lowbitcc.codec.formats import FORMATS
from lowbitcc.codec.shard_codec import ShardCodec


def _time(fn: Callable[[], object], min_time: float, max_repeats: int = 50,
          device: str = "cpu") -> float:
    if device != "cpu":
        call = fn

        def fn() -> None:
            call()
            torch.cuda.synchronize()

    fn()  # warm-up
    samples: list[float] = []
    total = 0.0
    while (total < min_time or len(samples) < 3) and len(samples) < max_repeats:
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        samples.append(elapsed)
        total += elapsed
    return statistics.median(samples)


def _device_time(fn: Callable[[], object], reps: int = 5) -> float:
    """Seconds of GPU time per call of ``fn``: the durations of the kernels, memsets and copies
    its ``reps`` calls ran (torch.profiler's CUDA activity), summed, over ``reps``."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    busy_us = sum(e.time_range.elapsed_us() for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA)
    if busy_us <= 0:
        raise RuntimeError("lowbitcc codec-bench: the profiler recorded no GPU work")
    return busy_us / 1e6 / reps


def _codec(impl: str, bits: int, group: int, device: str, fmt: str) -> ShardCodec:
    choice = "auto" if impl == "cuda" else impl
    return ShardCodec(bits=bits, group_size=group, dtype_code=0, seq=1, world=4, signature=0,
                      kernels=kernels.select(choice, device, group), fmt=fmt)


def measure(size_bytes: int, impl: str, threads: int, bits: int | None = None,
            group: int | None = None, min_time: float = 0.3, device: str = "cpu",
            fmt: str = "mxfp4") -> dict[str, float]:
    """One row of `run`: ``bits``-bit codes (None: the format's `formats.Format.width`) in
    groups of ``group`` (None: the format's default)."""
    torch.set_num_threads(threads)
    bits = bits or FORMATS[fmt].width
    group = group or FORMATS[fmt].default_group
    n = size_bytes // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    codec = _codec(impl, bits, group, device, fmt)
    state = ErrorState.encode(torch.randn(codec.padded(n), device=device) * 0.01, "int8", group)
    holder = {"state": state}
    sent = torch.empty(1, codec.message_bytes(n), dtype=torch.uint8, device=device)

    def encode() -> None:
        res = codec.encode(src, 1, n, 1.0, holder["state"], 0.8, [0], "int8", out=sent)
        holder["state"] = res.error

    quarter = -(-n // 4)
    messages = codec.encode(src, 4, quarter, 1.0, None, 0.8, [0, 0, 0, 0], None).messages
    t_copy = _time(lambda: dst.copy_(src), min_time, device=device)
    t_enc = _time(encode, min_time, device=device)
    total = torch.empty(quarter, device=device)

    def decode() -> None:
        codec.decode_sum(messages, quarter, 0, total)

    t_dec = _time(decode, min_time, device=device)
    t_sum = _time(lambda: codec.kernels.checksum(sent), min_time, device=device)
    on_device = {}
    if device == "cuda" and impl == "cuda":
        on_device = {
            "copy_device_GBps": size_bytes / _device_time(lambda: dst.copy_(src)) / 1e9,
            "encode_device_GBps": size_bytes / _device_time(encode) / 1e9,
            "decode_device_GBps": size_bytes / _device_time(decode) / 1e9}
    return {**on_device,
        "size_bytes": size_bytes, "impl": impl, "threads": threads, "device": device,
        "format": fmt, "group": group, "bits": bits,
        "copy_GBps": size_bytes / t_copy / 1e9,
        "encode_GBps": size_bytes / t_enc / 1e9,
        "decode_GBps": size_bytes / t_dec / 1e9,
        "checksum_share_encode": t_sum / t_enc,
        "checksum_share_decode": t_sum / t_dec,
    }


def run(min_size: int = 64 << 10, max_size: int = 256 << 20, factor: int = 4,
        threads: list[int] | None = None, reference_max: int = 64 << 20,
        json_path: str | None = None, min_time: float = 0.3,
        device: str = "cpu", formats: tuple[str, ...] = ("mxfp4", "int")) -> list[dict[str, float]]:
    if device == "cuda":
        from lowbitcc.codec import cuda

        if not cuda.available():
            raise RuntimeError("lowbitcc codec-bench --device cuda: CuPy sees no GPU")
        threads, impls = [1], ["reference", "cuda"]
    else:
        threads = threads or [1, 2]
        impls = ["reference"] + (["cpu"] if cpu.load() is not None else [])
    rows: list[dict[str, float]] = []
    print(f"{'size':>10} {'format':>9} {'impl':>9} {'thr':>3} {'copy GB/s':>9} {'enc GB/s':>9} "
          f"{'enc/copy':>8} {'dec GB/s':>9} {'dec/copy':>8} {'csum/enc':>8} {'csum/dec':>8}")
    size = min_size
    while size <= max_size:
        for t in threads:
            for fmt in formats:
                for impl in impls:
                    if impl == "reference" and size > reference_max:
                        continue
                    r = measure(size, impl, t, min_time=min_time, device=device, fmt=fmt)
                    rows.append(r)
                    print(f"{_human(size):>10} {fmt + '/' + str(r['group']):>9} {impl:>9} {t:>3} "
                          f"{r['copy_GBps']:>9.2f} {r['encode_GBps']:>9.3f} "
                          f"{r['encode_GBps'] / r['copy_GBps']:>8.3f} {r['decode_GBps']:>9.3f} "
                          f"{r['decode_GBps'] / r['copy_GBps']:>8.3f} "
                          f"{r['checksum_share_encode']:>8.3f} {r['checksum_share_decode']:>8.3f}",
                          flush=True)
                    if "copy_device_GBps" in r:
                        copy = r["copy_device_GBps"]
                        print(f"{'':>10} {'':>9} {'device':>9} {'':>3} {copy:>9.2f} "
                              f"{r['encode_device_GBps']:>9.3f} {r['encode_device_GBps'] / copy:>8.3f} "
                              f"{r['decode_device_GBps']:>9.3f} {r['decode_device_GBps'] / copy:>8.3f}",
                              flush=True)
        size *= factor
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"rows": rows, "torch": torch.__version__}, f, indent=1)
    return rows


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n}{unit}"
        n //= 1024
    return f"{n}TiB"
