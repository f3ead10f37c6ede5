"""How each format of the study's format lab quantizes one real gradient.

Feeds docs/convergence.md's "Why FP4" table (in "Every format and feedback setting measured").

Takes the study model's gradient of one training batch (at its initial weights; one rank, no
communication) and prints per format: bits per element, relative L2 error, the share of nonzero
entries that decode to zero and their share of ``sum |g|``, and the median per-element relative
error ``|deQ(Q(g)) - g| / |g|`` (what Adam, which divides each coordinate by its own RMS, sees).

    python benchmarks/format_errors.py [--batch 100]
"""

from __future__ import annotations

import argparse
from typing import Any

FORMATS: dict[str, dict[str, Any]] = {
    "int4 g128 fp32 (loco4)": {},
    "int4 g64 fp32": {"group": 64},
    "int4 g64 bf16": {"group": 64, "scale": "bf16"},
    "int4 g32 e8m0": {"group": 32, "scale": "e8m0"},
    "fp4 g64 bf16": {"codes": "fp4", "group": 64, "scale": "bf16"},
    "mxfp4 (fp4 g32 e8m0)": {"codes": "fp4", "group": 32, "scale": "e8m0"},
    "asym4 g64 bf16": {"codes": "asym", "group": 64, "scale": "bf16"},
    "int8 g128 fp32 (loco8)": {"bits": 8},
}
"""The formats compared, by name: `lowbitcc.tools.study.formats.Format`'s arguments."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=100, help="which batch of seed 0's stream")
    args = ap.parse_args()
    import torch

    from lowbitcc.tools.study.formats import Format
    from lowbitcc.tools.study.model import TinyGPT, lm_loss, split_corpus, train_batches
    from lowbitcc.tools.study.variants import StudyConfig

    cfg = StudyConfig()
    train, _ = split_corpus(cfg)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    for step, (x, y) in enumerate(train_batches(train, cfg, 0, 0)):
        if step == args.batch:
            lm_loss(model, x, y).backward()
            break
    g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    n = g.numel()
    print(f"{'format':24s} {'bits':>5} {'rel err':>8} {'zeroed':>7} {'zeroed |g|':>10} "
          f"{'median |d-g|/|g|':>16}")
    for name, spec in FORMATS.items():
        fmt = Format(**spec)
        y = torch.nn.functional.pad(g, (0, -n % fmt.group)).view(-1, fmt.group)
        d = fmt.roundtrip(y).reshape(-1)[:n]
        zeroed = (d == 0) & (g != 0)
        nonzero = g != 0
        print(f"{name:24s} {fmt.bits_per_element:5.2f} {float((d - g).norm() / g.norm()):8.4f} "
              f"{float(zeroed.float().mean()):7.3f} {float(g[zeroed].abs().sum() / g.abs().sum()):10.3f} "
              f"{float(((d - g).abs() / g.abs())[nonzero].median()):16.3f}")


if __name__ == "__main__":
    main()
