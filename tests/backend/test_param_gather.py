"""Compressed parameter all-gathers (`LocoConfig.param_bits`): codes identical on
every rank and within the quantizer's bound, the input untouched, exact where any rank says so,
and FSDP2 training with 8-bit parameter all-gathers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lowbitcc
from tests.backend.test_training import LOSS_TOLERANCE, STEPS, _model, _train, _wrap
from tests.support.ranks import run_ranks

N = 100_000  # elements per rank, above min_size
G = 128


def _gather(rank, world, gloo, bits, dtype, exact_on):
    group = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(param_bits=bits))
    torch.manual_seed(rank)
    x = (torch.randn(N) * (rank + 1)).to(dtype)
    before = x.clone()
    ours, reference = torch.empty(world * N, dtype=dtype), torch.empty(world * N, dtype=dtype)
    lowbitcc.reset_stats()
    if rank in exact_on:
        with lowbitcc.exact():
            dist.all_gather_into_tensor(ours, x, group=group)
    else:
        dist.all_gather_into_tensor(ours, x, group=group)
    counted = lowbitcc.stats()["compressed"]
    compressed = counted["calls"]
    dist.all_gather_into_tensor(reference, x, group=gloo)
    everyone = torch.empty(world * world * N, dtype=dtype)
    dist.all_gather_into_tensor(everyone, ours, group=gloo)
    everyone = everyone.view(world, world * N)
    groups = reference.float().view(-1, N)  # one rank's input per row
    padded = torch.nn.functional.pad(groups, (0, -N % G))  # the last group is zero-padded
    amax = padded.view(world, -1, G).abs().amax(dim=2, keepdim=True)
    bound = (amax / (2 * (2 ** (bits - 1) - 1))).expand(-1, -1, G).reshape(world, -1)[:, :N]
    error = (ours.float().view(world, N) - groups).abs()
    # fp16/bf16 outputs: the dequantized fp32 value is rounded once more to the output dtype
    slack = groups.abs() * (torch.finfo(dtype).eps if dtype != torch.float32 else 0.0)
    return {
        "compressed": compressed,
        # the statistics' error is the gradients': a gather adds no residual sums
        "sums": (counted["residual_sq"], counted["input_sq"]),
        "input_untouched": torch.equal(x, before),
        "same_on_every_rank": all(torch.equal(row, everyone[0]) for row in everyone),
        "within_bound": bool((error <= bound * 1.0001 + slack + 1e-12).all()),
        "exact": torch.equal(ours, reference),
    }


@pytest.mark.parametrize("bits, dtype", [(8, torch.float32), (4, torch.float32),
                                         (8, torch.bfloat16)])
def test_parameter_all_gather_codes_are_identical_on_every_rank_and_within_the_bound(bits, dtype):
    for r in run_ranks(_gather, 3, bits, dtype, (), timeout=120):
        assert r == {"compressed": 1, "sums": (0.0, 0.0), "input_untouched": True,
                     "same_on_every_rank": True, "within_bound": True, "exact": False}, r


def test_an_exact_block_on_one_rank_makes_the_gather_exact_on_every_rank():
    """The ranks exchange descriptors first: rank 1 inside `lowbitcc.exact()` would not
    compress, so nobody does."""
    for r in run_ranks(_gather, 2, 8, torch.float32, (1,), timeout=120):
        assert (r["compressed"], r["exact"], r["input_untouched"]) == (0, True, True), r


def _fsdp2_with_gathers(rank, world, gloo):
    ref = _train(_wrap("fsdp2", _model(), gloo), rank)
    calls = []
    for bits in (0, 8):
        lowbitcc.reset_stats()
        group = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(param_bits=bits))
        ours = _train(_wrap("fsdp2", _model(), group), rank)
        calls.append(lowbitcc.stats()["compressed"]["calls"])
    return ref, ours, calls


@pytest.mark.slow  # trains; `lowbitcc hybrid` trains with parameter all-gathers too
def test_fsdp2_trains_with_8_bit_parameter_all_gathers():
    for ref, ours, (without, with_gathers) in run_ranks(_fsdp2_with_gathers, 2, timeout=300):
        assert ours[-1] < 0.8 * ours[0], "did not train"
        tail_ref, tail = sum(ref[-5:]) / 5, sum(ours[-5:]) / 5
        assert abs(tail - tail_ref) <= LOSS_TOLERANCE * tail_ref, (tail, tail_ref)
        # the 3 Linear(512, 512) layers' parameters (a 131328-element shard per rank) are
        # all-gathered compressed at least once per step (forward; backward re-gathers some)
        assert with_gathers - without >= 3 * STEPS, (without, with_gathers)
