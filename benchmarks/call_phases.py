"""Where a compressed all-reduce's time goes, and how fast this machine could run it at best.

Feeds docs/performance.md, "Collectives": the table of one 64 MiB compressed call per link
against gloo's, and "Where a compressed call's time goes" (the split, the frontier, the
chunk-size sweep).

Every rank times, in turn and with a barrier before each, ``--calls`` times:

- ``gloo``: an all-reduce of ``--mib`` MiB of fp32 on a gloo group;
- ``loco``: the same all-reduce on a "loco" group, forced compressed (`lowbitcc.compressed()`,
  one error-feedback key for every call, as a training step's gradient bucket has), split by
  `lowbitcc.stats()` into codec (encode and decode, wall time), waiting on the wire and the
  rest (descriptor exchange, queueing, Python);
- ``codes``: the bytes one loco call sends per rank at the throughput of gloo's all-reduce
  (which sends ``2 (n - 1) / n`` of its input per rank): the codes' time on the wire at the
  link's bulk rate;
- ``gather``: a gloo all-gather of as many bytes per rank: the codes' time in one transfer of
  their size (on a shaped link, short transfers reach less than the bulk rate);
- ``codec alone``: the codec work of the call without any transfer: encode the tensor as one
  row per rank, then decode-sum each row's messages of every rank (the two-rank all-reduce's
  work exactly; with more ranks the reduce-scatter's, a lower bound), on every rank at once.

It prints the medians (the slowest rank's) and the *frontier*: the larger of codec alone and
codes, the call's time if codec and wire overlapped perfectly, the link gave the codes its bulk
rate, and nothing else took time (the network stack's own CPU time included: on a machine
with one core per rank it competes with the codec).

    python benchmarks/call_phases.py                           # 2 local ranks, loopback
    lowbitcc netem --np 2 --link 1gbit -- python benchmarks/call_phases.py   # emulated links (root)

The "loco" group takes its settings from ``LOCO_*`` (`LocoConfig.from_env`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    import lowbitcc

ROWS = ("gloo", "loco", "codec", "wire", "other", "alone", "codes", "gather")


def _codec_alone(config: lowbitcc.LocoConfig, x: torch.Tensor, world: int) -> Callable[[], None]:
    """The call's codec work with the call's settings (int8 or other error state as
    configured), on fresh buffers kept across repetitions, as the process group keeps its own."""
    import torch

    from lowbitcc.codec import kernels
    from lowbitcc.codec.error_state import ErrorState
    from lowbitcc.codec.shard_codec import ShardCodec

    group = config.wire_group_size
    codec = ShardCodec(bits=config.bits, group_size=group, dtype_code=0, seq=1, world=world,
                       signature=0, kernels=kernels.select(config.codec, "cpu", group),
                       fmt=config.wire_format, checksum=config.checksum_for("cpu"))
    m = -(-x.numel() // world)
    error = config.error_dtype if config.wire_feedback else None
    held: dict[str, ErrorState | None] = {"state": None}
    sent = torch.empty(world, codec.message_bytes(m), dtype=torch.uint8)
    total = torch.empty(m)

    def run() -> None:
        result = codec.encode(x, world, m, 1.0, held["state"], config.beta, list(range(world)),
                              error, out=sent)
        held["state"] = result.error
        for row in range(world):
            # every rank's message of this row: here the same bytes, with the row's shard id
            messages = sent[row:row + 1].expand(world, -1).contiguous()
            codec.decode_sum(messages, m, row, total)

    return run


def _measure(rank: int, world: int, mib: int, calls: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    import lowbitcc

    config = lowbitcc.LocoConfig.from_env()
    loco = dist.new_group(backend="loco", pg_options=config)
    gloo = dist.new_group(backend="gloo")
    x = torch.empty(mib << 18).uniform_(-1, 1)
    y = torch.empty_like(x)
    alone = _codec_alone(config, x, world)
    samples: dict[str, list[float]] = {name: [] for name in ROWS}

    def timed(fn: Callable[[], None]) -> float:
        dist.barrier(group=gloo)
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def loco_call() -> None:
        # one key for every call, so each applies the error state the previous one left, as a
        # training step's gradient bucket does
        with lowbitcc.compressed(), lowbitcc.feedback_key("call_phases"):
            dist.all_reduce(y, group=loco)

    sent_per_call = 0
    for i in range(calls + 2):
        y.copy_(x)
        before = lowbitcc.stats()["compressed"]
        t_loco = timed(loco_call)
        after = lowbitcc.stats()["compressed"]
        sent_per_call = after["wire_bytes"] - before["wire_bytes"]
        y.copy_(x)
        t_gloo = timed(lambda: dist.all_reduce(y, group=gloo))
        t_alone = timed(alone)
        t_codes = sent_per_call / (2 * (world - 1) / world * x.numel() * 4 / t_gloo)
        share = torch.empty(-(-sent_per_call // (world - 1)), dtype=torch.uint8)
        gathered = torch.empty(world * share.numel(), dtype=torch.uint8)
        t_gather = timed(lambda g=gathered, s=share: dist.all_gather_into_tensor(g, s, group=gloo))
        if i < 2:  # warm-up: error states, buffers, connections
            continue
        codec_s = after["codec_s"] - before["codec_s"]
        wire_s = after["wire_s"] - before["wire_s"]
        for name, value in (("gloo", t_gloo), ("loco", t_loco), ("codec", codec_s),
                            ("wire", wire_s), ("other", t_loco - codec_s - wire_s),
                            ("alone", t_alone), ("codes", t_codes), ("gather", t_gather)):
            samples[name].append(value)
    medians = torch.tensor([statistics.median(samples[name]) for name in ROWS]
                           + [sent_per_call, torch.get_num_threads()], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=gloo)
    return dict(zip([*ROWS, "sent", "threads"], medians.tolist()))


def _report(result: dict[str, float], mib: int, world: int) -> None:
    import lowbitcc

    config = lowbitcc.LocoConfig.from_env()
    ms = {name: result[name] * 1e3 for name in ROWS}
    frontier = max(ms["alone"], ms["codes"])
    print(f"# {mib} MiB fp32 all-reduce, {world} ranks, {config.wire_format} {config.bits}-bit "
          f"codes / {config.wire_group_size}, {int(result['threads'])} codec thread(s) per rank; "
          f"medians, slowest rank")
    print(f"{'':<28}{'ms/call':>9}{'x gloo':>8}")
    print(f"{'gloo all-reduce':<28}{ms['gloo']:>9.1f}{1.0:>8.2f}")
    print(f"{'loco all-reduce':<28}{ms['loco']:>9.1f}{ms['gloo'] / ms['loco']:>8.2f}")
    print(f"{'  codec (wall)':<28}{ms['codec']:>9.1f}")
    print(f"{'  waiting on the wire':<28}{ms['wire']:>9.1f}")
    print(f"{'  other':<28}{ms['other']:>9.1f}")
    print(f"{'codec alone':<28}{ms['alone']:>9.1f}")
    print(f"{'codes at gloo throughput':<28}{ms['codes']:>9.1f}   ({result['sent'] / 1e6:.2f} MB sent "
          f"per rank)")
    print(f"{'codes in one all-gather':<28}{ms['gather']:>9.1f}")
    print(f"{'frontier max(alone, codes)':<28}{frontier:>9.1f}{ms['gloo'] / frontier:>8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=64, help="MiB of fp32 per all-reduce")
    parser.add_argument("--calls", type=int, default=6, help="timed calls of each kind")
    parser.add_argument("--np", type=int, default=2,
                        help="local ranks to spawn (ignored under a launcher that sets RANK)")
    args = parser.parse_args()
    import torch
    import torch.distributed as dist

    from lowbitcc.tools import spawn

    if "RANK" in os.environ:
        dist.init_process_group("gloo")
        world = dist.get_world_size()
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        result = _measure(dist.get_rank(), world, args.mib, args.calls)
        if dist.get_rank() == 0:
            _report(result, args.mib, world)
        dist.destroy_process_group()
        return
    result = spawn.run_ranks(_measure, args.np, args.mib, args.calls, backend="gloo",
                             timeout_s=3600)[0]
    _report(result, args.mib, args.np)


if __name__ == "__main__":
    main()
