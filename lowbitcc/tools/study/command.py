"""``lowbitcc study``: its arguments and what each form runs (the convergence study, ``--wide``
and its forms, ``--diloco``; docs/convergence.md, docs/wan.md)."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from lowbitcc.tools import link_spec
from lowbitcc.tools.study import variants as study_variants
from lowbitcc.tools.study.wide_plans import PLANS as WIDE_PLANS


def add_arguments(sub: Any) -> None:
    """Add the ``study`` subcommand to ``sub`` (the command's subparsers)."""
    st = sub.add_parser("study", help="convergence study: a small GPT trained per variant")
    st.add_argument("--np", type=int, default=2, help="local ranks (default 2)")
    st.add_argument("--steps", type=int,
                    help="training steps (default 300; --wide long: 3000)")
    st.add_argument("--variants", nargs="+",
                    help="variants to run (default: " + " ".join(study_variants.DEFAULT_VARIANTS)
                    + "; an unknown name lists the known ones; with --wide: only these of "
                    "its plan's)")
    st.add_argument("--seeds", type=int, nargs="+",
                    help="seeds; all variants run the first (default "
                    + " ".join(map(str, study_variants.DEFAULT_SEEDS))
                    + "; with --wide: only these of its plan's)")
    st.add_argument("--extra-seed-variants", nargs="+",
                    help="variants run for the other seeds too (default: "
                    + " ".join(study_variants.EXTRA_SEED_VARIANTS) + ")")
    st.add_argument("--track", nargs="*",
                    help="variants measured on exact's gradient stream of the first seed (default: "
                    + " ".join(study_variants.DEFAULT_TRACKED) + "; none given: skip)")
    st.add_argument("--quick", action="store_true", help="tiny model (the test suite's smoke run)")
    st.add_argument("--out", default="study-out",
                    help="folder for study.json, study.png and each run's parameters; a study "
                    "started again there with the same settings resumes")
    st.add_argument("--diloco", action="store_true",
                    help="the DiLoCo study instead (docs/wan.md): each rank a site, DDP against "
                    "DiLoCo with fp32, int8, 4-bit and 4-bit LoCo outer sync at H 10 and 50, "
                    "3 seeds each; then each variant timed behind an emulated link (default "
                    "--wan cross-continent; root)")
    st.add_argument("--wide", nargs="?", const="full",
                    choices=list(WIDE_PLANS),
                    help="the three-configuration study that chooses the 4-bit default "
                    "(docs/convergence.md; resumable from --out): full (hours here), quick, "
                    "long (the two GPTs at 3000 steps: days here), feedback (LoCo's settings "
                    "and a warm-up on the GPT at 2 ranks), three-bit (the 3-bit formats in "
                    "every cell), second-phase (the default's second quantization on 4 "
                    "ranks, left out or with feedback, at 3000 steps) or drift (the 4-rank "
                    "GPT at 3000 steps with more bits or stochastic rounding)")
    st.add_argument("--cells", nargs="+", metavar="CONFIG:WORLD",
                    help="with --wide: only these cells of the plan (e.g. gpt:4), every seed "
                    "and variant; the report still shows every cell in --out")
    st.add_argument("--merge", nargs="+", metavar="DIR",
                    help="with --wide: first add to --out's the finished runs of these study "
                    "folders (parts of the study run elsewhere) that it lacks; runs of another "
                    "length are refused")
    link_spec.add_arguments(st)
    st.set_defaults(func=_study)


def _study(args: argparse.Namespace) -> int:
    from lowbitcc.tools import study

    if (args.cells or args.merge) and not args.wide:
        raise ValueError("lowbitcc study: --cells and --merge are a --wide plan's; give --wide "
                         "too")
    if args.wide:
        from lowbitcc.tools.study import wide

        return wide.command(args.wide, args.out, args.steps, args.cells, args.variants,
                            args.seeds, args.merge)
    cfg = study.StudyConfig(steps=args.steps or 300, world=args.np,
                            **(study.QUICK if args.quick else {}))
    if args.diloco:
        return _study_diloco(args, cfg)
    if any((args.link, args.delay, args.jitter, args.loss, args.wan)):
        logging.getLogger("lowbitcc").error("lowbitcc study: --link, --delay, --jitter, --loss "
                                            "and --wan apply to --diloco only")
        return 2
    try:
        result = study.run(args.variants or study.DEFAULT_VARIANTS,
                           args.seeds or study.DEFAULT_SEEDS, cfg, out_dir=args.out,
                           extra_seed_variants=args.extra_seed_variants or study.EXTRA_SEED_VARIANTS,
                           tracked=study.DEFAULT_TRACKED if args.track is None else args.track)
    except ValueError as exc:
        logging.getLogger("lowbitcc").error("%s", exc)
        return 2
    print(study.format_table(result["summary"]))
    if result["across_seeds"]:
        print()
        print(study.format_across_seeds(result["across_seeds"]))
    if "tracking" in result:
        from lowbitcc.tools.study import tracking

        print()
        print(tracking.format_table(result["tracking"]["summary"]))
    return 0


def _study_diloco(args: argparse.Namespace, cfg: Any) -> int:
    from lowbitcc.tools.study import diloco

    try:
        link = link_spec.from_arguments(args) or diloco.DEFAULT_LINK
        result = diloco.run(args.seeds or [0, 1, 2], cfg, link, out_dir=args.out,
                            variants=args.variants)
    except (ValueError, RuntimeError) as exc:
        logging.getLogger("lowbitcc").error("%s", exc)
        return 2
    print(diloco.format_report(result["diloco"], result["link"],
                               result["link_seconds_per_step"] is not None))
    return 0
