"""The ``lowbitcc`` console command: ``lowbitcc <subcommand> [options]``."""

from __future__ import annotations

import argparse
import logging
import sys


def _demo(args: argparse.Namespace) -> int:
    from lowbitcc import demo

    demo.run(nprocs=args.np, steps=args.steps, width=args.width, depth=args.depth)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lowbitcc", description="LoCo-compressed collectives for PyTorch: tools.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small model with DDP over loco and gloo, side by side")
    demo.add_argument("--np", type=int, default=2, help="local ranks to start (default 2)")
    demo.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    demo.add_argument("--width", type=int, default=512, help="hidden width of the MLP")
    demo.add_argument("--depth", type=int, default=3, help="hidden layers of the MLP")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
