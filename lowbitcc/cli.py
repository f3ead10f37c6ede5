"""The ``lowbitcc`` console command: ``lowbitcc <subcommand> [options]``."""

from __future__ import annotations

import argparse
import logging
import sys


def _demo(args: argparse.Namespace) -> int:
    from lowbitcc import demo

    demo.run(nprocs=args.np, steps=args.steps, width=args.width, depth=args.depth)
    return 0


def _codec_bench(args: argparse.Namespace) -> int:
    from lowbitcc import codec_bench

    codec_bench.run(min_size=args.b, max_size=args.e, factor=args.f, threads=args.threads,
                    reference_max=args.reference_max, json_path=args.json, min_time=args.min_time)
    return 0


def _study(args: argparse.Namespace) -> int:
    from lowbitcc import study

    cfg = study.StudyConfig(steps=args.steps, world=args.np, **(study.QUICK if args.quick else {}))
    try:
        result = study.run(args.variants or study.DEFAULT_VARIANTS, args.seeds, cfg,
                           out_dir=args.out,
                           extra_seed_variants=args.extra_seed_variants or study.EXTRA_SEED_VARIANTS)
    except ValueError as exc:
        logging.getLogger("lowbitcc").error("%s", exc)
        return 2
    print(study.format_table(result["summary"]))
    return 0


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


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
    bench = sub.add_parser("codec-bench", help="codec encode/decode throughput vs copy bandwidth")
    bench.add_argument("-b", type=_size, default=64 << 10, help="smallest size (default 64K)")
    bench.add_argument("-e", type=_size, default=256 << 20, help="largest size (default 256M)")
    bench.add_argument("-f", type=int, default=4, help="size multiplier per step (default 4)")
    bench.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts")
    bench.add_argument("--reference-max", type=_size, default=64 << 20,
                       help="largest size for the slow reference codec (default 64M)")
    bench.add_argument("--min-time", type=float, default=0.3, help="seconds per measurement")
    bench.add_argument("--json", help="write results to this JSON file")
    bench.set_defaults(func=_codec_bench)
    st = sub.add_parser("study", help="convergence study: a small GPT trained per variant")
    st.add_argument("--np", type=int, default=2, help="local ranks (default 2)")
    st.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    st.add_argument("--variants", nargs="+",
                    help="variants to run (default: all; an unknown name lists the known ones)")
    st.add_argument("--seeds", type=int, nargs="+", default=[0, 1],
                    help="seeds; all variants run the first (default 0 1)")
    st.add_argument("--extra-seed-variants", nargs="+",
                    help="variants run for the other seeds too (default: exact loco4 loco4-nofb)")
    st.add_argument("--quick", action="store_true", help="tiny model (the test suite's smoke run)")
    st.add_argument("--out", default="study-out", help="folder for study.json and study.png")
    st.set_defaults(func=_study)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
