"""Error-feedback state in torch.distributed.checkpoint (`lowbitcc.FeedbackState`) and across
a change of world size (`lowbitcc.checkpoint.reshard`)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lowbitcc
from lowbitcc.checkpoint import reshard
from lowbitcc.codec.error_state import ErrorState
from tests.support.ranks import run_ranks
from tests.support.training import assert_replicas_equal, flat_parameters, mlp, regression_steps

GROUP = 32


def _entry(residual: torch.Tensor, rows: int, m: int, storage: str = "fp32") -> dict:
    """A saved entry holding ``residual`` in ``rows`` rows of ``m`` elements padded to whole
    groups (the direct schedule's layout)."""
    padded = -(-m // GROUP) * GROUP
    laid = torch.zeros(rows, padded)
    flat = torch.zeros(rows * m)
    flat[:residual.numel()] = residual
    laid[:, :m] = flat.view(rows, m)
    e = ErrorState.encode(laid.reshape(-1), storage, GROUP)
    return {"uses": 3, "dtype": e.dtype, "group_size": GROUP, "data": e.data,
            "scales": e.scales, "streak": 1}


def _residual(entry: dict, rows: int, numel: int) -> torch.Tensor:
    e = ErrorState(entry["dtype"], entry["data"], entry["scales"], entry["group_size"])
    m = -(-numel // rows)
    return e.decode().view(rows, -1)[:, :m].reshape(-1)[:numel]


def _saved(world: int, numel: int, storage: str = "fp32") -> tuple[list[dict], torch.Tensor]:
    """Every rank's state dict for one all-reduce of ``numel`` elements at ``world`` ranks (plus
    keys that cannot move), and the group's summed residual."""
    g = torch.Generator().manual_seed(world)
    call = f"0|all_reduce|float32|{numel}|0"
    m = -(-numel // world)
    total = torch.zeros(numel)
    saved = []
    for r in range(world):
        x = torch.randn(numel, generator=g)
        total += x
        states = {f"0|reduce_scatter|float32|{numel}|0|rs": _entry(x, world, m, storage),
                  "0|my-key|gather": _entry(x, world, m, storage)}
        if world == 2:
            states[f"{call}|gather"] = _entry(x, 2, m, storage)
        else:
            states[f"{call}|rs"] = _entry(x, world, m, storage)
            shard = torch.randn(m, generator=g)
            valid = max(0, min(m, numel - r * m))
            total[r * m:r * m + valid] += shard[:valid]
            states[f"{call}|ag"] = _entry(shard, 1, m, storage)
        saved.append({"version": 2, "rank": r, "states": states})
    return saved, total


@pytest.mark.parametrize("old,new", [(2, 1), (2, 3), (4, 2), (3, 5), (2, 2)])
def test_reshard_keeps_the_groups_summed_residual(old, new, caplog):
    numel = 1000  # no multiple of any world size or group: padding everywhere
    saved, total = _saved(old, numel)
    call = f"0|all_reduce|float32|{numel}|0"
    with caplog.at_level(logging.WARNING, logger="lowbitcc.checkpoint"):
        mine = [reshard(saved, new, r) for r in range(new)]
    if old == new:
        assert all(m["states"] is saved[r]["states"] and m["rank"] == r
                   for r, m in enumerate(mine))
        return
    assert "starts anew" in caplog.text
    if new == 1:
        assert mine[0]["states"] == {}
        return
    stage = "gather" if new == 2 else "rs"
    assert all(set(m["states"]) == {f"{call}|{stage}"} for m in mine)
    moved = sum(_residual(m["states"][f"{call}|{stage}"], new, numel) for m in mine)
    torch.testing.assert_close(moved, total, rtol=0, atol=1e-5)
    for m in mine:  # loadable as it is
        entry = m["states"][f"{call}|{stage}"]
        m = -(-numel // new)
        padded = -(-m // GROUP) * GROUP
        assert entry["data"].numel() == new * padded and entry["uses"] == 0


def test_reshard_in_int8_storage_stays_within_its_quantization():
    saved, total = _saved(2, 4096, "int8")
    mine = [reshard(saved, 3, r) for r in range(3)]
    call = "0|all_reduce|float32|4096|0|rs"
    moved = sum(_residual(m["states"][call], 3, 4096) for m in mine)
    assert float((moved - total).norm() / total.norm()) < 0.02


def test_reshard_refuses_what_is_not_every_ranks_state():
    with pytest.raises(ValueError, match="every old rank"):
        reshard([], 2, 0)
    with pytest.raises(ValueError, match="every old rank"):
        reshard([{"version": 2}], 2, 0)
    with pytest.raises(ValueError, match="bytes"):
        lowbitcc.FeedbackState().load_state_dict({"feedback": 3})


# -- real ranks: DCP save on N, load on M ------------------------------------------------------


def _wrap(kind: str, model: nn.Module) -> nn.Module:
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model)
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def _summed(world: int) -> dict[str, torch.Tensor]:
    """The group's residual of each all-reduce: every rank's input residual and its reduced
    row's, unpadded and summed."""
    mine = lowbitcc.state_dict()["states"]
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    sums: dict[str, torch.Tensor] = {}
    for r, states in enumerate(everyone):
        for key, entry in states.items():
            call, _, stage = key.rpartition("|")
            if "all_reduce" not in call:
                continue
            numel = int(call.split("|")[3])
            m = -(-numel // world)
            total = sums.setdefault(call, torch.zeros(world * m))
            if stage in ("gather", "rs"):
                total[:numel] += _residual(entry, world, numel)
            elif stage == "ag":
                total[r * m:(r + 1) * m] += _residual(entry, 1, m)
    return {call: total[:int(call.split("|")[3])] for call, total in sums.items()}


def _save(rank, world, gloo, kind, path):
    from torch.distributed import checkpoint as dcp

    model = _wrap(kind, mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    regression_steps(model, opt, rank, 3)
    dcp.save({"model": model.state_dict(), "loco": lowbitcc.FeedbackState()},
             checkpoint_id=path)
    return {k: v.cpu() for k, v in _summed(world).items()}, lowbitcc.state_dict()


def _load(rank, world, gloo, kind, path):
    from torch.distributed import checkpoint as dcp

    model = _wrap(kind, mlp())
    state = {"model": model.state_dict(), "loco": lowbitcc.FeedbackState()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    summed = {k: v.cpu() for k, v in _summed(world).items()}
    mine = lowbitcc.state_dict()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss = regression_steps(model, opt, rank, 2)[-1]
    assert_replicas_equal(flat_parameters(model), gloo, "after resuming")
    return summed, mine, loss


ENV = {"LOCO_COST_MODEL": "0", "LOCO_MIN_SIZE": "4096", "LOCO_FEEDBACK": "1"}
DEFAULT_CHANGES = {("ddp", 2, 3), ("fsdp2", 4, 2), ("ddp", 2, 2)}


WORLD_CHANGES = [(kind, old, new) if (kind, old, new) in DEFAULT_CHANGES
                 else pytest.param(kind, old, new, marks=pytest.mark.slow)
                 for old, new in [(2, 1), (2, 3), (4, 2), (2, 2)] for kind in ["ddp", "fsdp2"]]
"""Every model kind and world size change; the default suite takes three (about 30 s), one of
each branch of the test (a larger world, a smaller one, the same), ``-m slow`` the rest."""


@pytest.mark.parametrize("kind,old,new", WORLD_CHANGES)
def test_dcp_checkpoints_resume_on_another_world_size(kind, old, new, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_save, old, kind, path, env=ENV, timeout=240)
    loaded = run_ranks(_load, new, kind, path, env=ENV, timeout=240)
    assert all(loss == loss and loss < 10 for _, _, loss in loaded)
    old_sums, _ = saved[0]
    new_sums, _, _ = loaded[0]
    if kind == "ddp":
        assert old_sums, "the saving run compressed nothing"
    if old == new:  # each rank its own state, as saved (not one rank's for all)
        first, second = (before["states"] for _, before in saved)
        assert first and first.keys() == second.keys()
        assert any(not torch.equal(first[k]["data"], second[k]["data"]) for k in first)
        for (_, before), (_, after, _) in zip(saved, loaded, strict=True):
            assert before["states"].keys() == after["states"].keys()
            for key, entry in before["states"].items():
                assert torch.equal(entry["data"], after["states"][key]["data"])
    elif kind == "ddp" and new > 1:  # the group's residual of each bucket kept
        assert new_sums.keys() == old_sums.keys()
        for call, total in old_sums.items():
            torch.testing.assert_close(new_sums[call], total, rtol=0, atol=1e-4)
    else:  # FSDP2's reduce-scatters and world size 1: start anew
        assert new_sums == {} and all(after["states"] == {} for _, after, _ in loaded)
