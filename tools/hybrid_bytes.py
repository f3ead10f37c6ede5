"""Bytes per step on the data-parallel dimension, and the final loss, of FSDP2 x tensor
parallel on a 2 x 2 CPU mesh, three ways: all gloo, hybrid (DP over "loco" 4-bit LoCo, TP
exact on gloo), hybrid with 8-bit parameter all-gathers (`lowbitcc.tools.hybrid.train_2d`, 30
steps, seed 0). Prints rank 0's ``lowbitcc.stats()`` of the "loco" groups per step.

    python tools/hybrid_bytes.py
"""

from __future__ import annotations

from lowbitcc.tools import spawn
from lowbitcc.tools.hybrid import SCHEMES, train_2d

STEPS = 30


def main() -> None:
    print(f"{'scheme':>15} {'last-5 loss':>11} {'RS+AG logical MB':>16} {'codes MB':>8} "
          f"{'exact MB':>8}")
    for scheme in SCHEMES:
        losses, stats, _ = spawn.run_ranks(train_2d, 4, scheme, STEPS, backend="gloo",
                                           timeout_s=600)[0]
        comp, exact = stats["compressed"], stats["exact"]
        print(f"{scheme:>15} {sum(losses[-5:]) / 5:>11.5f} "
              f"{comp['logical_bytes'] / STEPS / 1e6:>16.3f} "
              f"{comp['wire_bytes'] / STEPS / 1e6:>8.3f} "
              f"{exact['tensor_bytes'] / STEPS / 1e6:>8.3f}")


if __name__ == "__main__":
    main()
