"""Bytes by link class (`counters`: ``intra_node_bytes``, ``inter_node_bytes``): on 2 nodes of L
ranks, the hierarchical schedule sends 1/L of the direct schedule's bytes across nodes, and
every byte a schedule sends is counted in one class."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lowbitcc
from tests.support.ranks import run_ranks

SCHEDULES = ("direct", "hierarchical")


def _link_bytes(rank: int, world: int, gloo, node_size: int) -> dict[str, dict[str, int]]:
    """Per schedule, this rank's counted bytes of one compressed all-reduce (after one call that
    agrees on the call's place)."""
    groups = {s: dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(
        schedule=s, node_size=node_size, policy="always", cost_model=False, min_size=1))
        for s in SCHEDULES}
    x = torch.randn(world * 1024, generator=torch.Generator().manual_seed(rank))
    out = {}
    for schedule, group in groups.items():
        dist.all_reduce(x.clone(), group=group)
        dist.barrier(gloo)
        lowbitcc.reset_stats()
        dist.all_reduce(x.clone(), group=group)
        counted = lowbitcc.stats()["compressed"]
        out[schedule] = {k: int(counted[k])
                         for k in ("calls", "wire_bytes", "intra_node_bytes", "inter_node_bytes")}
        dist.barrier(gloo)
    return out


@pytest.mark.parametrize("node_size", [2, 4])
def test_hierarchical_sends_one_in_l_of_direct_bytes_across_nodes(node_size):
    for rank, counted in enumerate(run_ranks(_link_bytes, 2 * node_size, node_size,
                                             timeout=240)):
        direct, hier = counted["direct"], counted["hierarchical"]
        for c in (direct, hier):
            assert c["calls"] == 1, (rank, counted)
            assert c["intra_node_bytes"] + c["inter_node_bytes"] == c["wire_bytes"] > 0, (
                rank, counted)
        assert hier["inter_node_bytes"] * node_size == direct["inter_node_bytes"] > 0, (
            rank, counted)
        assert direct["intra_node_bytes"] > 0 and hier["intra_node_bytes"] > 0, (rank, counted)


def _unknown_layout(rank: int, world: int, gloo) -> dict:
    group = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(
        schedule="direct", policy="always", cost_model=False, min_size=1))
    lowbitcc.reset_stats()
    dist.all_reduce(torch.ones(4096), group=group)
    return lowbitcc.stats()["total"]


def test_without_a_node_layout_every_byte_stays_inside_the_node():
    for total in run_ranks(_unknown_layout, 2, env={"LOCAL_WORLD_SIZE": "0",
                                                    "LOCO_NODE_SIZE": "0"}):
        assert total["intra_node_bytes"] == total["wire_bytes"] > 0, total
        assert total["inter_node_bytes"] == 0, total
