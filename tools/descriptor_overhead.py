"""What the call-descriptor exchange costs an all-reduce that the policy leaves exact.

Since issue 18, every all-reduce on CPU tensors exchanges a call descriptor frame
(``wire.FRAME_BYTES``), also when this rank will not compress it (another rank might, or might
issue another call); one of at most ``wire.FRAME_PAYLOAD`` bytes travels in the frame, and needs
no gloo all-reduce after it. This times such calls (issued outside backward, so exact under the
default policy) on 2 local ranks with ``LOCO_CHECK=1`` (the default) and ``LOCO_CHECK=0`` (no
exchange), alternating the two twice, and prints the best time of each and their ratio.

    python tools/descriptor_overhead.py
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from lowbitcc.tools import spawn

SIZES = (1, 24, 1 << 10, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22)  # elements (fp32)
CALLS = 50


def _time_calls(rank: int, world: int) -> dict[int, float]:
    seconds = {}
    for n in SIZES:  # warm every size up first (the first calls of a process are slower)
        for _ in range(5):
            dist.all_reduce(torch.ones(n))
    for n in SIZES:
        x = torch.ones(n)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(CALLS):
            dist.all_reduce(x)
        seconds[n] = (time.perf_counter() - start) / CALLS
    return seconds


def main() -> None:
    best: dict[tuple[int, str], float] = {}
    for check in ("1", "0", "1", "0"):
        times = spawn.run_ranks(_time_calls, 2, backend="loco", timeout_s=300,
                                env={"LOCO_CHECK": check})[0]
        for n, s in times.items():
            best[n, check] = min(best.get((n, check), s), s)
    print(f"{'bytes':>10} {'check=1 us':>11} {'check=0 us':>11} {'ratio':>6}")
    for n in SIZES:
        with_check, without = best[n, "1"], best[n, "0"]
        print(f"{4 * n:>10} {with_check * 1e6:>11.0f} {without * 1e6:>11.0f} "
              f"{with_check / without:>6.2f}")


if __name__ == "__main__":
    main()
