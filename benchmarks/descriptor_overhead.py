"""What the call-descriptor exchange costs calls that travel exact: all-reduces the policy leaves
exact, broadcasts and all-gathers.

Since issue 18, every all-reduce on CPU tensors exchanges a call descriptor frame
(``exchange_frame.EXCHANGE_BYTES``), also when this rank will not compress it (another rank might, or might
issue another call); one of at most ``exchange_frame.FRAME_PAYLOAD`` bytes travels in the frame, and needs
no gloo all-reduce after it. This times such calls (issued outside backward, so exact under the
default policy) on 2 local ranks with ``LOCO_CHECK=1`` (the default) and ``LOCO_CHECK=0`` (no
exchange), alternating the two twice, and prints the best time of each and their ratio.
Broadcasts and all-gathers are timed alike, with ``LOCO_CHECK_ALL=1`` in the checked runs (the
exact data movements then exchange a descriptor too; without it they exchange none, as with
``LOCO_CHECK=0``).

    python benchmarks/descriptor_overhead.py
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from lowbitcc.tools import spawn

SIZES = (1, 24, 1 << 10, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22)  # elements (fp32)
CALLS = 50


KINDS = {
    "all_reduce": lambda x, world: dist.all_reduce(x),
    "broadcast": lambda x, world: dist.broadcast(x, src=0),
    "all_gather": lambda x, world: dist.all_gather_single(torch.empty(world * x.numel()), x),
}


def _time_calls(rank: int, world: int) -> dict[tuple[str, int], float]:
    seconds = {}
    for kind, call in KINDS.items():
        for n in SIZES:  # warm every size up first (the first calls of a process are slower)
            for _ in range(5):
                call(torch.ones(n), world)
        for n in SIZES:
            x = torch.ones(n)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(CALLS):
                call(x, world)
            seconds[kind, n] = (time.perf_counter() - start) / CALLS
    return seconds


def main() -> None:
    best: dict[tuple[str, int, str], float] = {}
    for check in ("1", "0", "1", "0"):
        times = spawn.run_ranks(_time_calls, 2, backend="loco", timeout_s=600,
                                env={"LOCO_CHECK": check, "LOCO_CHECK_ALL": check})[0]
        for (kind, n), s in times.items():
            best[kind, n, check] = min(best.get((kind, n, check), s), s)
    print(f"{'kind':>10} {'bytes':>10} {'check=1 us':>11} {'check=0 us':>11} {'ratio':>6}")
    for kind in KINDS:
        for n in SIZES:
            with_check, without = best[kind, n, "1"], best[kind, n, "0"]
            print(f"{kind:>10} {4 * n:>10} {with_check * 1e6:>11.0f} {without * 1e6:>11.0f} "
                  f"{with_check / without:>6.2f}")


if __name__ == "__main__":
    main()
