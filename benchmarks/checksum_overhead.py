"""What the shard messages' checksum (``LOCO_CHECKSUM``) costs a compressed all-reduce on CPU.

Feeds docs/reliability.md, "Payload checksum": its end-to-end table (the median with the checksum
over the median without, per message size).

2 local ranks create two "loco" groups that differ only in ``checksum`` and time compressed
all-reduces (direct schedule, 4 bits, C++ codec) on each, alternating the groups call by call
so that both see the same machine; it prints the median time of each, and the median and
quartiles of the ratio of the two calls of each pair (adjacent in time, so they share the
machine's state: steadier than the ratio of the medians on a noisy machine).

    python benchmarks/checksum_overhead.py [--calls 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

SIZES = (1 << 18, 1 << 20, 1 << 22, 1 << 24)  # elements (fp32)


def _time_calls(rank: int, world: int, calls: int) -> dict[int, dict[bool, list[float]]]:
    import torch
    import torch.distributed as dist

    import lowbitcc

    config = lowbitcc.LocoConfig.from_env()
    groups = {flag: dist.new_group(backend="loco", pg_options=config.replace(checksum=flag))
              for flag in (True, False)}
    result = {}
    for n in SIZES:
        x = torch.randn(n)
        samples: dict[bool, list[float]] = {True: [], False: []}
        for i in range(calls + 3):
            for flag in (True, False) if i % 2 else (False, True):
                y = x.clone()
                dist.barrier(group=groups[flag])
                start = time.perf_counter()
                with lowbitcc.compressed():
                    dist.all_reduce(y, group=groups[flag])
                if i >= 3:
                    samples[flag].append(time.perf_counter() - start)
        result[n] = samples
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=30, help="timed calls per size and group")
    args = parser.parse_args()
    from lowbitcc.tools import spawn

    times = spawn.run_ranks(_time_calls, 2, args.calls, backend="gloo", timeout_s=3600)[0]
    print(f"{'bytes':>10} {'checksum ms':>12} {'none ms':>8} {'ratio':>6} {'paired q1/med/q3':>17}")
    for n in SIZES:
        with_sum, without = times[n][True], times[n][False]
        q1, med, q3 = statistics.quantiles([a / b for a, b in zip(with_sum, without)], n=4)
        print(f"{4 * n:>10} {statistics.median(with_sum) * 1e3:>12.2f} "
              f"{statistics.median(without) * 1e3:>8.2f} "
              f"{statistics.median(with_sum) / statistics.median(without):>6.3f} "
              f"{q1:>5.3f}/{med:.3f}/{q3:.3f}")


if __name__ == "__main__":
    main()
