"""Final loss and bytes per step of FSDP2 x tensor parallel on a 2 x 2 CPU mesh, by scheme
(`lowbitcc.tools.hybrid.train_2d`, 30 steps): all gloo; hybrid (DP over "loco" 4-bit LoCo, TP
exact on gloo); hybrid with 8-bit parameter all-gathers; naive (TP over "loco" at 4 bits too).
For each scheme: the mean over ``SEEDS`` of the last-5-step loss, its gap to gloo's per seed
(mean, min, max), and, for seed 0, rank 0's ``lowbitcc.stats()`` of its "loco" groups per step
(logical and code bytes of compressed calls, bytes of exact ones; "naive" adds its TP calls).

    python tools/hybrid_bytes.py
"""

from __future__ import annotations

import statistics

from lowbitcc.tools import spawn
from lowbitcc.tools.hybrid import SCHEMES, train_2d

STEPS = 30
SEEDS = (0, 1, 2)


def main() -> None:
    tails: dict[tuple[str, int], float] = {}
    stats = {}
    for seed in SEEDS:
        for scheme in SCHEMES:
            losses, st, _ = spawn.run_ranks(train_2d, 4, scheme, STEPS, seed, backend="gloo",
                                            timeout_s=600)[0]
            tails[scheme, seed] = sum(losses[-5:]) / 5
            if seed == 0:
                stats[scheme] = st
    print(f"{'scheme':>15} {'last-5 loss':>11} {'gap mean':>9} {'gap min':>8} {'gap max':>8} "
          f"{'logical MB':>10} {'codes MB':>8} {'exact MB':>8}")
    for scheme in SCHEMES:
        gaps = [tails[scheme, s] / tails["gloo", s] - 1 for s in SEEDS]
        comp, exact = stats[scheme]["compressed"], stats[scheme]["exact"]
        print(f"{scheme:>15} {statistics.mean(tails[scheme, s] for s in SEEDS):>11.5f} "
              f"{statistics.mean(gaps):>+9.3%} {min(gaps):>+8.3%} {max(gaps):>+8.3%} "
              f"{comp['logical_bytes'] / STEPS / 1e6:>10.3f} "
              f"{comp['wire_bytes'] / STEPS / 1e6:>8.3f} "
              f"{exact['tensor_bytes'] / STEPS / 1e6:>8.3f}")


if __name__ == "__main__":
    main()
