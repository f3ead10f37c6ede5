"""What the call-descriptor exchange costs calls that travel exact: all-reduces the policy leaves
exact, broadcasts and all-gathers, with ``LOCO_CHECK`` (and ``LOCO_CHECK_ALL``) on against off.

Feeds docs/reliability.md, "How mismatches are caught": the table of exact all-reduces (figures of
2026-11-23, when every such call exchanged a descriptor) and the table of data movements under
``LOCO_CHECK_ALL=1`` (what that switch costs, and why it is off by default).

Times such calls (issued outside backward, so exact under the default policy) on 2 local ranks
with ``LOCO_CHECK=1`` (the default) and ``LOCO_CHECK=0`` (no exchange), alternating the two
twice, and prints the best time of each and their ratio. An exact all-reduce exchanges its
descriptor (``exchange_frame.EXCHANGE_BYTES``; one of at most ``exchange_frame.FRAME_PAYLOAD``
bytes travels in the frame and needs no gloo all-reduce after it) only where its call place has
not settled or renews its agreement (the call schedule; docs/reliability.md): about one call in
50 here, so its rows now compare the call schedule's exact path with ``LOCO_CHECK=0``'s, not an
exchange on every call as the first table's figures did. Broadcasts and all-gathers are timed
alike, with ``LOCO_CHECK_ALL=1`` in the checked runs (the exact data movements then exchange a
descriptor on every call; without it they exchange none, as with ``LOCO_CHECK=0``).

    python benchmarks/descriptor_overhead.py [--calls 50]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

SIZES = (1, 24, 1 << 10, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22)  # elements (fp32)
KINDS = ("all_reduce", "broadcast", "all_gather")


def _calls() -> dict[str, Callable[[Any, int], Any]]:
    """Each of `KINDS` as a call ``(tensor, world)`` on the default group."""
    import torch
    import torch.distributed as dist

    return {
        "all_reduce": lambda x, world: dist.all_reduce(x),
        "broadcast": lambda x, world: dist.broadcast(x, src=0),
        "all_gather": lambda x, world: dist.all_gather_single(torch.empty(world * x.numel()), x),
    }


def _time_calls(rank: int, world: int, calls: int) -> dict[tuple[str, int], float]:
    """Seconds per call of each kind and size on this rank, after 5 untimed calls of each."""
    import torch
    import torch.distributed as dist

    seconds = {}
    for kind, call in _calls().items():
        for n in SIZES:  # warm every size up first (the first calls of a process are slower)
            for _ in range(5):
                call(torch.ones(n), world)
        for n in SIZES:
            x = torch.ones(n)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                call(x, world)
            seconds[kind, n] = (time.perf_counter() - start) / calls
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=50, help="timed calls per kind and size")
    args = parser.parse_args()
    from lowbitcc.tools import spawn

    best: dict[tuple[str, int, str], float] = {}
    for check in ("1", "0", "1", "0"):
        times = spawn.run_ranks(_time_calls, 2, args.calls, backend="loco", timeout_s=600,
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
