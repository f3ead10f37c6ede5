"""`lowbitcc project`: the gradient all-reduce of one training step on a GPU cluster, on paper.

For nodes of ``gpus_per_node`` GPUs (NVLink inside, one NIC of ``nic`` bits/s per node), a
model of ``params`` parameters whose gradients are all-reduced in buckets of ``bucket_mib`` MiB
of ``grad_dtype`` (as DDP does), it gives each step's communication time under three schemes:

- **nccl**: NCCL's ring all-reduce of the gradient in its own dtype: each node's NIC carries
  ``2 (W-1)/W`` of the gradient's bytes (``W`` GPUs in all); given a tree's latency, ``2 log2 W``
  messages of ``alpha``, not the ring's ``2 (W-1)`` (favourably to NCCL);
- **direct**: lowbitcc's direct schedule over every GPU (the only one on CUDA today): an
  all-to-all and an all-gather of codes, so each node's NIC carries ``2 L (N-1)/N`` of the
  codes of one GPU's gradient (``L`` GPUs per node, ``N`` nodes): ``L`` times hierarchical's;
- **hierarchical**: NCCL's fp32 reduce-scatter and all-gather inside the node over NVLink
  (gradients widened to fp32), the direct schedule across nodes on each GPU's ``1/L`` of the
  bucket (the rail of equal local ranks), so the NIC carries ``2 (N-1)/N`` of one GPU's codes.

A compressed call costs the larger of its host time (``host_us``: issuing it, Python and
launches, measured per call on a GPU) and its GPU time: the encode and decode kernels at
their measured rates (GB/s of fp32 input), the codes on the NIC, the messages' latencies (and,
hierarchically, the NVLink steps). Calls of one step run one after the other (one stream).

Every input is named, with its source, in `Inputs`; the defaults are what docs/gpu.md measured
on one H200 (host 2.4 ms per compressed call with the call schedule; MXFP4 encode 549 GB/s,
decode 510 GB/s) and assumptions it could not measure (NVLink, the per-message latency, one
NIC per node), so that a user redoes it for their cluster with their own numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
from typing import Any

from lowbitcc.codec import wire
from lowbitcc.config import LocoConfig
from lowbitcc.tools import link_spec, plotting

SCHEMES = ("nccl", "direct", "hierarchical")
GRAD_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What the projection assumes; rates in bytes/s, times in seconds."""

    gpus_per_node: int = 8
    params: float = 7e9
    bucket_mib: float = 25.0
    grad_dtype: str = "bf16"
    bits: int = 4
    format: str = "mxfp4"
    host_s: float = 2.4e-3
    """Host time per compressed call: 2.2-2.6 ms on the H200 with the call schedule (docs/gpu.md,
    the per-call goals' table); the call plans and fused kernels aim at <= 100 us."""
    encode_rate: float = 549e9
    """MXFP4 encode kernel on the H200, fp32 input bytes/s (docs/gpu.md, `lowbitcc selftest`)."""
    decode_rate: float = 510e9
    """Decode kernel on the H200 (docs/gpu.md)."""
    nvlink_rate: float = 300e9
    """Assumed (not measured: one GPU was lent): bytes/s one GPU moves inside its node."""
    nvlink_alpha_s: float = 2e-6
    """Assumed: latency of a message inside a node."""
    alpha_s: float = 10e-6
    """Assumed: latency of a message between nodes."""

    @property
    def wire_bits(self) -> float:
        """Bits per element of a compressed message (the format's codes and scales)."""
        group = LocoConfig(bits=self.bits, format=self.format).wire_group_size
        n = 1 << 20
        return wire.payload_bytes(n, self.bits, group, self.format) * 8 / n


def bucket_calls(inputs: Inputs) -> tuple[int, float]:
    """The step's buckets: how many, and the elements of each (the last one rounded up)."""
    total = inputs.params * GRAD_BYTES[inputs.grad_dtype]
    calls = max(1, math.ceil(total / (inputs.bucket_mib * 2 ** 20)))
    return calls, inputs.params / calls


def call_time(scheme: str, elements: float, nodes: int, nic_rate: float,
              inputs: Inputs) -> tuple[float, float]:
    """One bucket's all-reduce under ``scheme`` on ``nodes`` nodes whose NICs move
    ``nic_rate`` bytes/s: (seconds, bytes each node's NIC sends)."""
    lpn = inputs.gpus_per_node
    world = lpn * nodes
    codes = elements * inputs.wire_bits / 8  # one GPU's gradient as codes
    fp32 = elements * 4
    if scheme == "nccl":
        nbytes = 2 * (world - 1) / world * elements * GRAD_BYTES[inputs.grad_dtype]
        if nodes == 1:
            return nbytes / inputs.nvlink_rate + 2 * (world - 1) * inputs.nvlink_alpha_s, 0.0
        return nbytes / nic_rate + 2 * math.log2(world) * inputs.alpha_s, nbytes
    if scheme == "direct":
        nic = 2 * lpn * (nodes - 1) / nodes * codes
        inside = 2 * (lpn - 1) / world * codes  # to the GPUs of its own node, per GPU
        codec = (fp32 + fp32 / world) / inputs.encode_rate + 2 * fp32 / inputs.decode_rate
        gpu = (codec + nic / nic_rate + inside / inputs.nvlink_rate
               + 2 * (world - 1) * inputs.alpha_s)
        return max(inputs.host_s, gpu), nic
    if scheme == "hierarchical":
        node_step = (2 * (lpn - 1) / lpn * fp32 / inputs.nvlink_rate
                     + 2 * (lpn - 1) * inputs.nvlink_alpha_s)
        if nodes == 1:
            return node_step, 0.0
        rail = fp32 / lpn
        nic = 2 * (nodes - 1) / nodes * codes
        codec = (rail + rail / nodes) / inputs.encode_rate + 2 * rail / inputs.decode_rate
        gpu = node_step + codec + nic / nic_rate + 2 * (nodes - 1) * inputs.alpha_s
        return max(inputs.host_s, gpu), nic
    raise ValueError(f"lowbitcc project: unknown scheme {scheme!r}; one of {', '.join(SCHEMES)}")


def project(inputs: Inputs, nodes: list[int], nics: dict[str, float]) -> list[dict[str, Any]]:
    """One row per (nodes, NIC rate): each scheme's seconds per step and NIC bytes per step,
    and each compressed scheme's speed over nccl."""
    calls, elements = bucket_calls(inputs)
    rows = []
    for name, rate in nics.items():
        for n in nodes:
            row: dict[str, Any] = {"nodes": n, "gpus": n * inputs.gpus_per_node, "nic": name,
                                   "buckets": calls}
            for scheme in SCHEMES:
                seconds, nic_bytes = call_time(scheme, elements, n, rate, inputs)
                row[scheme] = {"step_s": calls * seconds, "nic_bytes": calls * nic_bytes}
            for scheme in SCHEMES[1:]:
                row[scheme]["speed"] = row["nccl"]["step_s"] / row[scheme]["step_s"]
            rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]], inputs: Inputs) -> str:
    """The rows as a table: ms per step and speed over nccl."""
    lines = [f"# {inputs.params:.3g} parameters, {inputs.grad_dtype} gradients in "
             f"{inputs.bucket_mib:g} MiB buckets ({rows[0]['buckets']} calls a step), "
             f"{inputs.gpus_per_node} GPUs per node, {inputs.format} at "
             f"{inputs.wire_bits:.2f} bits, host {inputs.host_s * 1e6:.0f} us per compressed call",
             f"{'nic':>9} {'nodes':>5} {'gpus':>5} {'nccl ms':>9} {'direct ms':>10} "
             f"{'speed':>6} {'hier ms':>9} {'speed':>6} {'NIC GB nccl/direct/hier':>25}"]
    for r in rows:
        gb = "/".join(f"{r[s]['nic_bytes'] / 1e9:.2f}" for s in SCHEMES)
        lines.append(f"{r['nic']:>9} {r['nodes']:>5} {r['gpus']:>5} "
                     f"{r['nccl']['step_s'] * 1e3:>9.1f} {r['direct']['step_s'] * 1e3:>10.1f} "
                     f"{r['direct']['speed']:>5.2f}x {r['hierarchical']['step_s'] * 1e3:>9.1f} "
                     f"{r['hierarchical']['speed']:>5.2f}x {gb:>25}")
    return "\n".join(lines)


def plot(results: dict[str, list[dict[str, Any]]], path: str) -> None:
    """Speed over nccl against nodes, one panel per model, a line per NIC rate and scheme."""
    plt = plotting.pyplot("lowbitcc project --plot", required=True)
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), sharey=True,
                             squeeze=False)
    for ax, (model, rows) in zip(axes[0], results.items()):
        for nic in dict.fromkeys(r["nic"] for r in rows):
            mine = [r for r in rows if r["nic"] == nic]
            x = [r["gpus"] for r in mine]
            line, = ax.plot(x, [r["hierarchical"]["speed"] for r in mine], "-o", ms=3,
                            label=f"hierarchical, {nic}")
            ax.plot(x, [r["direct"]["speed"] for r in mine], "--", color=line.get_color(),
                    label=f"direct, {nic}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(model)
        ax.set_xlabel("GPUs")
    axes[0][0].set_ylabel("speed of the gradient all-reduce over NCCL")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(inputs: Inputs, params: list[float], nodes: list[int], nics: dict[str, float],
         json_path: str | None = None, plot_path: str | None = None) -> int:
    """Print a table per model size (``params``); write JSON and a plot where asked."""
    results = {}
    for p in params:
        model = dataclasses.replace(inputs, params=p)
        rows = project(model, nodes, nics)
        results[f"{p:.3g} parameters"] = rows
        print(format_table(rows, model))
        print()
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"inputs": {**dataclasses.asdict(inputs), "params": params,
                                  "wire_bits": inputs.wire_bits},
                       "results": results}, f, indent=1)
    if plot_path:
        plot(results, plot_path)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`lowbitcc project`'s options: every `Inputs` field, the model sizes, nodes, NIC rates."""
    d = Inputs()
    parser.add_argument("--params", type=float, nargs="+", default=[1e9, 7e9],
                        help="model sizes in parameters (default 1e9 7e9)")
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 16, 64],
                        help="node counts (default 2 4 16 64)")
    parser.add_argument("--gpus-per-node", type=int, default=d.gpus_per_node)
    parser.add_argument("--nic", nargs="+", default=["25gbit", "100gbit", "400gbit"],
                        help="NIC rate per node, tc units (default 25gbit 100gbit 400gbit)")
    parser.add_argument("--bucket-mib", type=float, default=d.bucket_mib,
                        help="gradient bucket size, MiB of the gradient dtype (DDP: 25)")
    parser.add_argument("--grad-dtype", choices=sorted(GRAD_BYTES), default=d.grad_dtype)
    parser.add_argument("--bits", type=int, default=d.bits)
    parser.add_argument("--format", default=d.format, help="loco's code format (default mxfp4)")
    parser.add_argument("--host-us", type=float, default=d.host_s * 1e6,
                        help="host time per compressed call (default: measured on the H200)")
    parser.add_argument("--encode-gbs", type=float, default=d.encode_rate / 1e9,
                        help="encode kernel, GB/s of fp32 input (default: measured on the H200)")
    parser.add_argument("--decode-gbs", type=float, default=d.decode_rate / 1e9,
                        help="decode kernel, GB/s (default: measured on the H200)")
    parser.add_argument("--nvlink-gbs", type=float, default=d.nvlink_rate / 1e9,
                        help="GB/s a GPU moves inside its node (default: assumed)")
    parser.add_argument("--alpha-us", type=float, default=d.alpha_s * 1e6,
                        help="latency of a message between nodes (default: assumed)")
    parser.add_argument("--json", help="write inputs and results to this JSON file")
    parser.add_argument("--plot", help="write speed over NCCL against GPUs to this PNG")


def command(args: argparse.Namespace) -> int:
    """`lowbitcc project`: 0, or 2 with the error logged (an unreadable input, --plot
    without matplotlib)."""
    try:
        inputs = Inputs(
            gpus_per_node=args.gpus_per_node, bucket_mib=args.bucket_mib,
            grad_dtype=args.grad_dtype, bits=args.bits, format=args.format,
            host_s=args.host_us * 1e-6, encode_rate=args.encode_gbs * 1e9,
            decode_rate=args.decode_gbs * 1e9, nvlink_rate=args.nvlink_gbs * 1e9,
            alpha_s=args.alpha_us * 1e-6)
        nics = {rate: link_spec.parse_rate(rate) / 8 for rate in args.nic}
        inputs.wire_bits  # noqa: B018 (checks bits and format now)
        return main(inputs, args.params, args.nodes, nics, args.json, args.plot)
    except (ValueError, RuntimeError) as exc:
        logging.getLogger("lowbitcc").error("lowbitcc project: %s", exc)
        return 2
