"""The hierarchical schedule issued as CUDA issues it (``LOCO_ISSUER=inline``) over links that
offer only what NCCL's offer (collectives on the world, node and rail groups; every
point-to-point transfer raises): bit for bit the worker path's, at 4 ranks as 2 nodes of 2 and
6 ranks as 3 nodes of 2 (the same on a GPU: tests/gpu/test_multirank.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lowbitcc
from lowbitcc.transports.gloo import GlooTransport
from tests.support.ranks import run_ranks

CALLS = [  # (elements, dtype, op)
    (3 * 4096 + 5, torch.float32, dist.ReduceOp.SUM),
    (6 * 1024, torch.bfloat16, dist.ReduceOp.SUM),
    (6 * 2048, torch.float32, dist.ReduceOp.AVG),
]


def _no_point_to_point(*args, **kwargs):
    raise AssertionError("a point-to-point transfer: NCCL's links offer none")


def _hierarchical(rank, world, gloo, issuer, node_size, device="cpu"):
    """Three steps of `CALLS`, compressed on the hierarchical schedule: every result (CPU)."""
    if issuer == "inline":
        GlooTransport.send_async = GlooTransport.recv_async = _no_point_to_point
    if device == "cuda":
        from lowbitcc.tools import spawn

        device = spawn.gpu_device(rank)
    group = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(
        schedule="hierarchical", node_size=node_size, issuer=issuer, cost_model=False))
    gen = torch.Generator().manual_seed(rank)
    results = []
    for _ in range(3):
        for n, dtype, op in CALLS:
            x = torch.randn(n, generator=gen).to(dtype).to(device)
            with lowbitcc.compressed(), lowbitcc.feedback_key(f"{n}|{dtype}"):
                dist.all_reduce(x, op=op, group=group)
            results.append(x.to("cpu"))
        lowbitcc.end_step()
    return results


@pytest.mark.parametrize("world", [4, 6], ids=["2x2", "3x2"])
def test_hierarchical_inline_over_collectives_only_equals_the_worker(world):
    inline = run_ranks(_hierarchical, world, "inline", 2, timeout=240)
    worker = run_ranks(_hierarchical, world, "auto", 2, timeout=240)
    for got, want in zip(inline, worker, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    for got in inline[1:]:  # every rank the same bits
        assert all(torch.equal(a, b) for a, b in zip(got, inline[0]))
