"""What the shard messages' checksum (issue 18, item 12) costs a compressed all-reduce.

2 local ranks create two "loco" groups that differ only in ``checksum`` and time compressed
all-reduces (direct schedule, 4 bits, C++ codec) on each, alternating the groups call by call
so that both see the same machine; it prints the median time of each and their ratio.

    python tools/checksum_overhead.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

import lowbitcc
from lowbitcc.tools import spawn

SIZES = (1 << 18, 1 << 20, 1 << 22, 1 << 24)  # elements (fp32)
CALLS = 30


def _time_calls(rank: int, world: int) -> dict[int, tuple[float, float]]:
    config = lowbitcc.LocoConfig.from_env()
    groups = {flag: dist.new_group(backend="loco", pg_options=config.replace(checksum=flag))
              for flag in (True, False)}
    result = {}
    for n in SIZES:
        x = torch.randn(n)
        samples: dict[bool, list[float]] = {True: [], False: []}
        for i in range(CALLS + 3):
            for flag in (True, False) if i % 2 else (False, True):
                dist.barrier(group=groups[flag])
                start = time.perf_counter()
                with lowbitcc.compressed():
                    dist.all_reduce(x.clone(), group=groups[flag])
                if i >= 3:
                    samples[flag].append(time.perf_counter() - start)
        result[n] = (statistics.median(samples[True]), statistics.median(samples[False]))
    return result


def main() -> None:
    times = spawn.run_ranks(_time_calls, 2, backend="gloo", timeout_s=600)[0]
    print(f"{'bytes':>10} {'checksum ms':>12} {'none ms':>8} {'ratio':>6}")
    for n in SIZES:
        with_sum, without = times[n]
        print(f"{4 * n:>10} {with_sum * 1e3:>12.2f} {without * 1e3:>8.2f} "
              f"{with_sum / without:>6.3f}")


if __name__ == "__main__":
    main()
