"""The 3-bit formats end to end: ``LOCO_FORMAT=nvint3`` or ``nvfp3`` with ``LOCO_BITS=3`` on a
"loco" group of 2 real ranks (``dist.init_process_group("loco")``): compressed all-reduces and a
reduce-scatter whose results are the same bytes on every rank, within the codec's bound of the
exact sum, and the same bytes from the C++ codec as from the reference, with error feedback
off (the formats' default) and on."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lowbitcc
from tests.support.numerics import codec_step, group_amax, identical_everywhere, rank_input
from tests.support.ranks import run_ranks


def _calls(rank, world, gloo):
    """Two all-reduces of each size on one feedback key (the second applies the first's error
    state where feedback is on) and a reduce-scatter: each result, whether it is the same
    everywhere and within the bound, the compressed calls counted, and the group's wire format
    (format, bits, group size)."""
    config = lowbitcc.LocoConfig.from_env()
    group, q = codec_step()
    results = []
    for size in (65536, 100_003):
        for repeat in range(2):
            x = rank_input(rank, size, size + repeat)
            out = x.clone()
            with lowbitcc.compressed(), lowbitcc.feedback_key(f"three-{size}"):
                dist.all_reduce(out)
            ref = x.double()
            dist.all_reduce(ref, group=gloo)
            amax = group_amax(x.double(), world, group)
            dist.all_reduce(amax, group=gloo)
            bound = amax / q * 1.01 + ref.abs() * 2.0**-22 + 1e-6
            # with feedback the second call's input carries the first's error: twice the bound
            within = (out.double() - ref).abs() <= bound * (1 + repeat * config.wire_feedback)
            results.append({"values": out, "identical": identical_everywhere(out, gloo),
                            "within": bool(within.all())})
    x = rank_input(rank, 40_000 * world, 3)
    out = torch.empty(40_000)
    with lowbitcc.compressed():
        dist.reduce_scatter_single(out, x)
    full = x.double()
    dist.all_reduce(full, group=gloo)
    rel = float((out.double() - full.view(world, -1)[rank]).norm() / full.norm() * world**0.5)
    results.append({"values": out, "identical": True, "within": rel < 0.35})
    wire = (config.wire_format, config.bits, config.wire_group_size)
    return results, lowbitcc.stats()["compressed"]["calls"], wire


@pytest.mark.parametrize("fmt,feedback", [("nvint3", "auto"), ("nvfp3", "1")])
def test_3_bit_calls_agree_across_ranks_and_codecs(fmt, feedback):
    runs = {codec: run_ranks(_calls, 2, timeout=240, env={
        "LOCO_FORMAT": fmt, "LOCO_BITS": "3", "LOCO_FEEDBACK": feedback, "LOCO_CODEC": codec})
        for codec in ("cpu", "reference")}
    for (cpu_results, cpu_calls, wire), (ref_results, ref_calls, _) in zip(runs["cpu"],
                                                                          runs["reference"]):
        assert wire == (fmt, 3, 16) and cpu_calls == ref_calls == 5
        for got, want in zip(cpu_results, ref_results):
            assert got["identical"] and got["within"], got
            assert torch.equal(got["values"].view(torch.int32), want["values"].view(torch.int32))
