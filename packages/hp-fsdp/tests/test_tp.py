"""FSDP x TP: tensor-parallel DTensor parameters sharded again over the data-parallel dim(s)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hp_dtensor import ColwiseParallel, DTensor, Replicate, RowwiseParallel, Shard, parallelize_module
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from hp_fsdp_testlib import build_tp as _build
from hp_fsdp_testlib import full, parity, ref_copy


def _tp_then_fsdp(model: nn.Module, tp_mesh: Any, dp_mesh: Any) -> nn.Module:
    from hp_fsdp import fully_shard

    for block in model.blocks:  # type: ignore[union-attr]
        parallelize_module(block, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


@pytest.mark.distributed(world_size=4)
def test_fsdp_x_tp_parity_2x2(rank: int, world_size: int, device_mesh_factory: Any, tmp_path: Any) -> None:
    mesh = device_mesh_factory((2, 2), ("dp", "tp"))
    model = _build()
    ref = ref_copy(model)
    _tp_then_fsdp(model, mesh["tp"], mesh["dp"])
    up, down = model.blocks[0].up, model.blocks[0].down
    for p in (up.weight, up.bias, down.weight, down.bias, model.head.weight):
        assert isinstance(p, DTensor)
    # row-wise weight: FSDP on dim 0 over dp, TP on dim 1 over tp -- the plain 2-D layout
    assert down.weight.placements == (Shard(0), Shard(1))
    assert down.weight.device_mesh.mesh_dim_names == ("dp", "tp")
    assert down.bias.placements == (Shard(0), Replicate())
    # column-wise weight: both cut dim 0, TP first, so the mesh is ordered (tp, dp)
    assert up.weight.placements == (Shard(0), Shard(0))
    assert up.weight.device_mesh.mesh_dim_names == ("tp", "dp")
    dp, tp = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    # 10 rows: tp-local 5, then dp chunks 3 / 2 of those
    assert up.weight.to_local().shape[0] == [3, 2][dp]
    assert up.weight.to_local()[0, 0] == ref.blocks[0].up.weight[5 * tp + 3 * dp, 0]
    assert model.head.weight.placements == (Shard(0),)  # plain params: FSDP over dp only
    ref_up = ref.blocks[0].up.weight.detach()
    torch.testing.assert_close(up.weight.full_tensor(), ref_up, rtol=0, atol=0)

    # every parameter and gradient is compared whole (full_tensor) against the single-process copy
    parity(model, ref, dp_rank=dp, dp_world=mesh.size("dp"), steps=6)
    _state_dict_round_trip(model)

    # DCP: save the FSDP x TP state, load it into a fresh model whose parameters hold other values
    import hp_core
    import torch.distributed.checkpoint as dcp

    path = hp_core.broadcast_object(str(tmp_path / "ckpt"), src=0)
    expected = {k: full(v).clone() for k, v in model.state_dict().items()}
    dcp.save(model.state_dict(), checkpoint_id=path)
    other = _tp_then_fsdp(_build(), mesh["tp"], mesh["dp"])
    state = other.state_dict()
    dcp.load(state, checkpoint_id=path)
    other.load_state_dict(state)
    for key, value in other.state_dict().items():
        torch.testing.assert_close(full(value), expected[key], rtol=0, atol=0, msg=key)


@pytest.mark.distributed(world_size=4)
@pytest.mark.parametrize("shape", [(1, 2, 2), (2, 1, 2)])
def test_hsdp_x_tp_parity_3d(rank: int, world_size: int, device_mesh_factory: Any, shape: Any) -> None:
    mesh = device_mesh_factory(shape, ("rep", "shard", "tp"))
    model = _build()
    ref = ref_copy(model)
    _tp_then_fsdp(model, mesh["tp"], mesh["rep", "shard"])
    up, down = model.blocks[1].up, model.blocks[1].down
    assert down.weight.placements == (Replicate(), Shard(0), Shard(1))
    assert down.weight.device_mesh.mesh_dim_names == ("rep", "shard", "tp")
    assert up.weight.placements == (Replicate(), Shard(0), Shard(0))
    assert up.weight.device_mesh.mesh_dim_names == ("rep", "tp", "shard")
    dp = mesh.get_local_rank("rep") * shape[1] + mesh.get_local_rank("shard")
    parity(model, ref, dp_rank=dp, dp_world=shape[0] * shape[1], steps=4)
    _state_dict_round_trip(model)


def _state_dict_round_trip(model: nn.Module) -> None:
    # state_dict round-trip: sharded values load back in place; full tensors cut locally
    state = {k: full(v).clone() for k, v in model.state_dict().items()}
    params_before = {id(p) for p in model.parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().zero_()
    model.load_state_dict(state)  # full tensors
    assert {id(p) for p in model.parameters()} == params_before
    for key, value in model.state_dict().items():
        torch.testing.assert_close(full(value), state[key], rtol=0, atol=0, msg=key)
    sharded = {k: v for k, v in model.state_dict().items()}
    model.load_state_dict(sharded)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(full(value), state[key], rtol=0, atol=0, msg=key)


def _build_uneven(hidden: int) -> nn.Module:
    """The FSDP x TP model with ``hidden`` MLP features: uneven over tp, then again over dp."""
    model = _build()
    torch.manual_seed(1)
    with torch.no_grad():
        for block in model.blocks:  # type: ignore[union-attr]
            dim = block.up.in_features
            block.up = nn.Linear(dim, hidden).double()
            block.down = nn.Linear(hidden, dim).double()
    return model


@pytest.mark.distributed(world_size=4)
def test_fsdp_x_tp_uneven_tp_dim_2x2(rank: int, world_size: int, device_mesh_factory: Any) -> None:
    """Hidden 7 over tp=2 (4 and 3 features), each TP piece cut again over dp=2 (2 / 2 and 2 / 1)."""
    mesh = device_mesh_factory((2, 2), ("dp", "tp"))
    model = _build_uneven(7)
    ref = ref_copy(model)
    _tp_then_fsdp(model, mesh["tp"], mesh["dp"])
    dp, tp = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    up = model.blocks[0].up
    assert up.weight.to_local().shape[0] == [[2, 2], [2, 1]][tp][dp]
    torch.testing.assert_close(up.weight.full_tensor(), ref.blocks[0].up.weight.detach(), rtol=0, atol=0)
    parity(model, ref, dp_rank=dp, dp_world=mesh.size("dp"), steps=4)
    _state_dict_round_trip(model)
