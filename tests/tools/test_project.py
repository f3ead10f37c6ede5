"""`lowbitcc project`: the projection's arithmetic on small inputs, and its command."""

from __future__ import annotations

import json

import pytest

from lowbitcc.tools import cli, project


@pytest.mark.parametrize("gpus_per_node", [2, 4, 8])
def test_hierarchical_sends_one_lth_of_directs_bytes_across_nodes(gpus_per_node):
    inputs = project.Inputs(gpus_per_node=gpus_per_node)
    for nodes in (2, 3, 16):
        _, direct = project.call_time("direct", 1e6, nodes, 1e9, inputs)
        _, hier = project.call_time("hierarchical", 1e6, nodes, 1e9, inputs)
        assert direct == pytest.approx(gpus_per_node * hier)
        # the codes of one GPU's gradient, twice, less the node's own share
        assert hier == pytest.approx(2 * (nodes - 1) / nodes * 1e6 * inputs.wire_bits / 8)


def test_ncclss_ring_sends_its_gradient_bytes_and_mxfp4_is_4_25_bits():
    inputs = project.Inputs(gpus_per_node=4, grad_dtype="bf16")
    _, nccl = project.call_time("nccl", 1e6, 2, 1e9, inputs)
    assert nccl == pytest.approx(2 * 7 / 8 * 1e6 * 2)
    assert inputs.wire_bits == pytest.approx(4.25, abs=0.01)


def test_compression_pays_on_slow_links_and_the_host_cost_decides_on_fast_ones():
    slow = project.project(project.Inputs(params=1e8, host_s=1e-4), [4], {"1gbit": 1e9 / 8})
    assert slow[0]["hierarchical"]["speed"] > 3 and slow[0]["buckets"] == 8
    fast = project.project(project.Inputs(params=1e8, host_s=5e-3), [4], {"400gbit": 50e9})
    assert fast[0]["hierarchical"]["speed"] < 1 and fast[0]["direct"]["speed"] < 1


def test_the_command_prints_a_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert cli.main(["project", "--params", "1e6", "--nodes", "1", "2", "--nic", "1gbit",
                     "--gpus-per-node", "2", "--json", str(out)]) == 0
    assert "hier ms" in capsys.readouterr().out
    rows = json.loads(out.read_text())["results"]["1e+06 parameters"]
    assert [r["gpus"] for r in rows] == [2, 4]
    assert rows[0]["direct"]["nic_bytes"] == rows[0]["hierarchical"]["nic_bytes"] == 0
    assert cli.main(["project", "--nic", "fast"]) == 2  # an unreadable rate: a clear error
