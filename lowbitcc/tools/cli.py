"""The ``lowbitcc`` console command: ``lowbitcc <subcommand> [options]``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import Any

from lowbitcc.codec.formats import FORMATS
from lowbitcc.tools import link_spec
from lowbitcc.tools.study import command as study_command


def _exit_code(run: Callable[[], int], errors: tuple = (ValueError, RuntimeError)) -> int:
    """``run()``'s exit code; 2 where it raised one of ``errors`` (logged: a user's mistake or
    what the ranks met, not a traceback)."""
    try:
        return run()
    except errors as exc:
        logging.getLogger("lowbitcc").error("%s", exc)
        return 2


def _codec_bench(args: argparse.Namespace) -> int:
    from lowbitcc.tools import codec_bench

    codec_bench.run(min_size=args.b, max_size=args.e, factor=args.f, threads=args.threads,
                    reference_max=args.reference_max, json_path=args.json, min_time=args.min_time,
                    device=args.device, formats=tuple(args.formats))
    return 0


def _selftest(args: argparse.Namespace) -> int:
    from lowbitcc.tools import selftest

    return selftest.run(count=args.cases, gpu=not args.no_gpu, ranks=args.ranks)


def _perf(args: argparse.Namespace) -> int:
    from lowbitcc.tools import perf

    opts = perf.PerfOptions(
        collective=args.collective, min_bytes=args.b, max_bytes=args.e, factor=args.f,
        step_bytes=args.i, iters=args.n, warmup=args.w, rounds=args.rounds, check=args.c,
        dtype=args.d, op=args.o,
        average=args.a, backends=tuple(args.backend), bits=tuple(args.bits),
        schedules=tuple(args.schedule), json_path=args.json, plot_path=args.plot,
        device=args.device,
    )
    return _exit_code(lambda: perf.main(opts, args.np, link_spec.from_arguments(args), args.argv))


def _bench_train(args: argparse.Namespace) -> int:
    from lowbitcc.tools import bench_train

    schemes = tuple(args.schemes or bench_train.default_schemes(args.device))
    opts = bench_train.BenchOptions(config=args.config, schemes=schemes, steps=args.steps,
                                    warmup=args.warmup, json_path=args.json, device=args.device,
                                    dtype=args.dtype)
    return _exit_code(
        lambda: bench_train.main(opts, args.np, link_spec.from_arguments(args), args.argv))


def _add_project(sub: Any) -> None:
    from lowbitcc.tools import project

    pr = sub.add_parser(
        "project", help="a training step's gradient all-reduce on a GPU cluster, on paper: "
                        "NCCL vs loco direct vs hierarchical",
        description="Projects the gradient all-reduce of one data-parallel step from measured "
        "parts (host and kernel times per compressed call on a GPU, docs/gpu.md) and a link "
        "model; every input is an option (docs/scaling.md).")
    project.add_arguments(pr)
    pr.set_defaults(func=project.command)


def _hybrid(args: argparse.Namespace) -> int:
    from lowbitcc.tools import hybrid

    opts = hybrid.HybridOptions(config=args.config, schemes=tuple(args.schemes),
                                seeds=tuple(args.seeds), steps=args.steps, warmup=args.warmup,
                                dp=args.dp, tp=args.tp, json_path=args.json)
    return _exit_code(lambda: hybrid.main(opts, args.link, args.argv))


def _netem(args: argparse.Namespace) -> int:
    from lowbitcc.tools import netem

    if args.cleanup:
        removed = netem.cleanup()
        print("removed: " + (" ".join(removed) if removed else "nothing"))
        return 0
    command = args.command_args[1:] if args.command_args[:1] == ["--"] else args.command_args
    if not command:
        logging.getLogger("lowbitcc").error("lowbitcc netem: give a command after --")
        return 2
    try:
        link = link_spec.from_arguments(args, default_rate="1gbit")
    except ValueError as exc:
        logging.getLogger("lowbitcc").error("%s", exc)
        return 2
    return netem.main_run(link, args.np, command)


def _torch_suite(args: argparse.Namespace) -> int:
    from pathlib import Path

    from lowbitcc.tools.torch_suite import runner

    return _exit_code(lambda: runner.main(args.config, args.tests, args.world_size, args.jobs,
                                          Path(args.out), args.start), (ValueError,))


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
    from lowbitcc.tools import demo

    demo.add_arguments(sub.add_parser(
        "demo", help="train a small model with DDP over loco and gloo (nccl on GPUs), side by side"))
    from lowbitcc.tools import call_count

    call_count.add_arguments(sub.add_parser(
        "calls", help="Python calls per DDP bucket call, beyond gloo's (steady state, 2 ranks or --np)"))
    bench = sub.add_parser("codec-bench", help="codec encode/decode throughput vs copy bandwidth")
    bench.add_argument("-b", type=_size, default=64 << 10, help="smallest size (default 64K)")
    bench.add_argument("-e", type=_size, default=256 << 20, help="largest size (default 256M)")
    bench.add_argument("-f", type=int, default=4, help="size multiplier per step (default 4)")
    bench.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts")
    bench.add_argument("--reference-max", type=_size, default=64 << 20,
                       help="largest size for the slow reference codec (default 64M)")
    bench.add_argument("--min-time", type=float, default=0.3, help="seconds per measurement")
    bench.add_argument("--json", help="write results to this JSON file")
    bench.add_argument("--formats", nargs="+", choices=list(FORMATS), default=["mxfp4", "int"],
                       help="code formats at their width (default mxfp4 / 32, int / 128)")
    bench.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                       help="where the tensors live (cuda: the CUDA kernels on the current GPU)")
    bench.set_defaults(func=_codec_bench)
    study_command.add_arguments(sub)
    _add_perf(sub)
    _add_project(sub)
    _add_bench_train(sub)
    _add_hybrid(sub)
    ne = sub.add_parser(
        "netem", help="run a command on N ranks, each in a network namespace behind an "
        "emulated link: rate, and delay, jitter, loss (root)",
        description="Runs COMMAND once per rank, each in its own network namespace joined to a "
        "switch by a link rate-limited with tc tbf (198.18.0.0/15 addresses), with torchrun's "
        "variables set (RANK, WORLD_SIZE, MASTER_ADDR, ...); with --delay, --jitter, --loss or "
        "--wan the switch is a user-space one that delays and drops packets (docs/wan.md). "
        "Needs root, ip and tc. Examples: lowbitcc netem --np 2 --link 1gbit -- python "
        "train.py; lowbitcc netem --np 2 --link 100mbit --delay 40ms --jitter 2ms --loss 0.01% "
        "-- python train.py")
    ne.add_argument("--np", type=int, default=2, help="ranks (default 2)")
    link_spec.add_arguments(ne, default_rate="1gbit")
    ne.add_argument("--cleanup", action="store_true",
                    help="delete namespaces left by killed runs (names starting with lbcc)")
    ne.add_argument("command_args", nargs=argparse.REMAINDER, help="-- command ...")
    ne.set_defaults(func=_netem)
    return parser


def _add_bench_train(sub: Any) -> None:
    from lowbitcc.tools.bench_train import BASELINES, CONFIGS, SCHEMES

    bt = sub.add_parser(
        "bench-train", help="training steps/s of a GPT over loco, gloo or nccl, fp16, PowerSGD, "
        "FSDP2",
        description="Trains one GPT per scheme side by side in the same ranks (interleaved "
        "steps, same batches) and prints steps/s, tokens/s, speed against DDP's exact baseline "
        "(gloo; nccl with --device cuda) and against no "
        "communication, bytes per step and the final loss. Start with --np N, --np N --link "
        "RATE (emulated network, root), or under torchrun / mpiexec -n N.")
    bt.add_argument("--config", default="comm", choices=list(CONFIGS),
                    help="comm: 3.3 M parameters, 4 x 64 tokens per rank (default); compute: "
                    "1.8 M parameters, 32 x 128 tokens; quick: a tiny smoke run")
    bt.add_argument("--schemes", nargs="+", metavar="NAME",
                    help=f"schemes side by side (default all of the device's): "
                    f"{', '.join(SCHEMES)}")
    bt.add_argument("--device", default="cpu", choices=list(BASELINES),
                    help="where the models train (default cpu; cuda: a GPU per rank, or ranks "
                    "sharing GPUs, DDP over nccl as the baseline)")
    bt.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                    help="the models' parameters and gradients (bf16: as GPU training runs)")
    bt.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    bt.add_argument("--warmup", type=int, default=5, help="untimed first steps (default 5)")
    bt.add_argument("--np", type=int, help="local ranks to start when not under a launcher "
                    "(default 2)")
    link_spec.add_arguments(bt)
    bt.add_argument("--json", help="write the rows to this JSON file")
    bt.set_defaults(func=_bench_train)


def _add_hybrid(sub: Any) -> None:
    from lowbitcc.tools.hybrid import CONFIGS, DEFAULT_SCHEMES, SCHEMES

    hy = sub.add_parser(
        "hybrid", help="naive vs hybrid compression of a DP x TP GPT (docs/hybrid.md)",
        description="Trains a GPT with tensor-parallel attention and MLP x FSDP2 data "
        "parallelism once per scheme, side by side in the same ranks (interleaved steps, same "
        "batches), per seed, and prints the final validation loss and its gap to exact, the "
        "step time and the bytes per step (per dimension under --link, where each TP group "
        "shares a network namespace and DP crosses the emulated link; root).")
    hy.add_argument("--config", default="study", choices=list(CONFIGS),
                    help="study: 0.87 M parameters, 150 steps (default); quick: a smoke run")
    hy.add_argument("--schemes", nargs="+", default=list(DEFAULT_SCHEMES), metavar="NAME",
                    help=f"schemes side by side: {', '.join(SCHEMES)} (default all but the "
                    "last)")
    hy.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2],
                    help="seeds (default 0 1 2)")
    hy.add_argument("--steps", type=int, help="training steps (default: the config's)")
    hy.add_argument("--warmup", type=int, default=5, help="untimed first steps (default 5)")
    hy.add_argument("--dp", type=int, default=2, help="data-parallel size (default 2)")
    hy.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    hy.add_argument("--link", help="emulate the DP links at this rate (tc units, e.g. 1gbit, "
                    "or none; root); TP stays inside a namespace")
    hy.add_argument("--json", help="write the results to this JSON file")
    hy.set_defaults(func=_hybrid)


def _add_perf(sub: Any) -> None:
    from lowbitcc.config import SCHEDULES
    from lowbitcc.tools.perf.collectives import COLLECTIVES
    from lowbitcc.tools.perf.targets import KNOWN

    pe = sub.add_parser(
        "perf", help="nccl-tests-style bandwidth sweep of a collective, backends side by side",
        description="nccl-tests' all_reduce_perf / reduce_scatter_perf / all_gather_perf for "
        "loco and exact backends. Start with --np N (local ranks), --np N --link RATE "
        "(emulated network, root), or under torchrun / mpiexec -n N.")
    pe.add_argument("collective", choices=sorted(COLLECTIVES), help="the collective to sweep")
    pe.add_argument("-b", "--minbytes", dest="b", type=_size, default=64 << 10,
                    help="smallest size in bytes (default 64K)")
    pe.add_argument("-e", "--maxbytes", dest="e", type=_size, default=64 << 20,
                    help="largest size in bytes (default 64M)")
    pe.add_argument("-f", "--stepfactor", dest="f", type=int, default=2,
                    help="size multiplier per step (default 2)")
    pe.add_argument("-i", "--stepbytes", dest="i", type=_size, default=0,
                    help="size increment per step, instead of -f")
    pe.add_argument("-n", "--iters", dest="n", type=int, default=20, help="timed calls (default 20)")
    pe.add_argument("-w", "--warmup_iters", dest="w", type=int, default=5,
                    help="untimed calls first (default 5)")
    pe.add_argument("--rounds", type=int, default=4,
                    help="blocks each backend's and placement's -n calls are split into, timed "
                         "in turn with the others' (default 4; 1: one after another)")
    pe.add_argument("-c", "--check", dest="c", type=int, default=1, choices=(0, 1),
                    help="compare with the exact result (default 1)")
    pe.add_argument("-d", "--datatype", dest="d", default="float",
                    help="float, half or bfloat16 (default float)")
    pe.add_argument("-o", "--op", dest="o", default="sum", help="sum, avg, max or min (default sum)")
    pe.add_argument("-a", "--average", dest="a", type=int, default=1,
                    help="time across ranks: 0 rank 0, 1 mean, 2 min, 3 max (default 1)")
    pe.add_argument("--backend", nargs="+", default=["loco", "gloo"], metavar="NAME",
                    help=f"backends side by side: {', '.join(KNOWN)} (default loco gloo)")
    pe.add_argument("--bits", type=int, nargs="+", default=[4], help="bits of loco (default 4)")
    pe.add_argument("--schedule", nargs="+", default=["direct"], metavar="NAME",
                    help="loco schedules, side by side when several: "
                         f"{', '.join(SCHEDULES)} (default direct)")
    pe.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the buffers live (cuda: one GPU per rank, compare loco and nccl)")
    pe.add_argument("--json", help="write results to this JSON file")
    pe.add_argument("--plot", help="write busbw vs size to this PNG (needs matplotlib)")
    pe.add_argument("--np", type=int, help="local ranks to start when not under a launcher (default 2)")
    link_spec.add_arguments(pe)
    pe.set_defaults(func=_perf)
    se = sub.add_parser("selftest", help="environment, and the codecs (CPU, and CUDA on a GPU) "
                                         "against the reference; run it first")
    se.add_argument("--cases", type=int, default=400, help="codec cases per implementation")
    se.add_argument("--no-gpu", action="store_true", help="skip the GPU checks")
    se.add_argument("--ranks", type=int, default=0,
                    help="also run the multi-rank GPU checks on this many local ranks (ranks "
                         "sharing a GPU get their own NCCL_HOSTID)")
    se.set_defaults(func=_selftest)
    _add_torch_suite(sub)


def _add_torch_suite(sub: Any) -> None:
    from lowbitcc.tools.torch_suite.runner import CONFIGS

    ts = sub.add_parser(
        "torch-suite", help="PyTorch's own distributed test suite over loco, beside gloo",
        description="Runs torch/testing/_internal/distributed/distributed_test.py from the "
        "installed torch per configuration (gloo always first, as the bar) and compares the "
        "outcomes test by test. Exit status 0 iff loco differs from gloo only "
        "where listed (docs/compatibility.md).")
    ts.add_argument("--config", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                    help="configurations (default: all)")
    ts.add_argument("--tests", default="all",
                    help="all, curated (CI's subset) or comma-separated test names (default all)")
    ts.add_argument("--world-size", type=int, default=2, help="ranks per test (default 2)")
    ts.add_argument("--jobs", type=int, default=2, help="tests run side by side (default 2)")
    ts.add_argument("--start", choices=["forkserver", "spawn"], default="forkserver",
                    help="how each test's ranks start: forked from a server that imported torch "
                    "once (default, about 3 minutes for all configurations on 2 cores), or "
                    "spawned as torch's own driver does (several times slower)")
    ts.add_argument("--out", default="torch-suite-out", help="folder for logs and the report")
    ts.set_defaults(func=_torch_suite)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv
    from lowbitcc.tools.spawn import LOG_FORMAT

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format=LOG_FORMAT)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
