"""State dicts hold shards (no communication), load full or sharded values, and meta-device init works."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hp_dtensor import DTensor, Shard

sys.path.insert(0, str(Path(__file__).parent))
from hp_fsdp_testlib import (
    build,
    count_collectives,
    full,
    global_batch,
    loss_fn,
    parity,
    shard_blocks,
)


@pytest.mark.distributed(world_size=2)
def test_state_dict_is_sharded_and_free(rank: int, world_size: int) -> None:
    model = build()
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    shard_blocks(model)
    tokens, _ = global_batch(0, world_size)
    model(tokens[:2])  # leaves the root gathered: state_dict must still give shards
    with count_collectives() as counter:
        sd = model.state_dict()
    assert counter.calls == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    assert sd.keys() == reference.keys()
    for key, value in sd.items():
        assert isinstance(value, DTensor), key
        assert value.placements == (Shard(0),)
        torch.testing.assert_close(value.full_tensor(), reference[key], rtol=0, atol=0)


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_load_state_dict(rank: int, world_size: int, kind: str) -> None:
    source = build(seed=1)
    target = build(seed=2)
    wanted = {k: v.clone() for k, v in source.state_dict().items()}
    shard_blocks(target)
    if kind == "sharded":
        shard_blocks(source)
        state = source.state_dict()
    else:
        state = wanted
    params_before = {id(p) for p in target.parameters()}
    target.load_state_dict(state)
    assert {id(p) for p in target.parameters()} == params_before  # loaded in place: optimizers stay valid
    for key, value in target.state_dict().items():
        assert isinstance(value, DTensor)
        torch.testing.assert_close(value.full_tensor(), wanted[key], rtol=0, atol=0)


@pytest.mark.distributed(world_size=2)
def test_meta_device_init_then_train(rank: int, world_size: int) -> None:
    real = build(seed=3)
    wanted = {k: v.clone() for k, v in real.state_dict().items()}
    with torch.device("meta"):
        model = build(seed=3)
    shard_blocks(model)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and not p.is_meta and p.to_local().device.type == "cpu", name
    model.load_state_dict(wanted)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(full(value), wanted[key], rtol=0, atol=0)
    parity(model, real, dp_rank=rank, dp_world=world_size, steps=2)
    tokens, targets = global_batch(0, world_size)
    loss_fn(model, tokens[:2], targets[:2])


def _one_step_4way(rank: int, world_size: int, tmp_path: Any) -> tuple[str, Any, Any, Any, Any]:
    """A checkpoint path shared by all ranks, and a 4-way sharded model after one AdamW step."""
    import hp_core

    # one directory for all ranks, also under plain torchrun where each process has its own tmp_path
    path = hp_core.broadcast_object(str(tmp_path / "ckpt"), src=0)
    source = shard_blocks(build(seed=1))
    opt = torch.optim.AdamW(source.parameters(), lr=1e-2)
    tokens, targets = global_batch(0, world_size)
    loss_fn(source, tokens[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2]).backward()
    opt.step()
    return path, source, opt, tokens, targets


@pytest.mark.distributed(world_size=4)
def test_dcp_save_4way_load_hsdp_2x2(
    rank: int, world_size: int, device_mesh_factory: Any, tmp_path: Any
) -> None:
    """Model and optimizer state through torch.distributed.checkpoint, loaded under another sharding."""
    import torch.distributed.checkpoint as dcp

    path, source, opt, tokens, targets = _one_step_4way(rank, world_size, tmp_path)
    expected_model = {k: full(v) for k, v in source.state_dict().items()}
    expected_avg = {k: full(v["exp_avg"]) for k, v in opt.state_dict()["state"].items()}
    dcp.save({"model": source.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)

    mesh = device_mesh_factory((2, 2), ("replicate", "shard"))  # shards of 2, not of 4
    target = shard_blocks(build(seed=2), mesh=mesh)
    target_opt = torch.optim.AdamW(target.parameters(), lr=1e-2)
    loss_fn(target, tokens[:2], targets[:2]).backward()
    target_opt.step()  # creates the optimizer state to load into
    state = {"model": target.state_dict(), "optim": target_opt.state_dict()}
    dcp.load(state, checkpoint_id=path)
    target.load_state_dict(state["model"])
    target_opt.load_state_dict(state["optim"])
    for key, value in target.state_dict().items():
        torch.testing.assert_close(full(value), expected_model[key], rtol=0, atol=0, msg=key)
    for key, value in target_opt.state_dict()["state"].items():
        torch.testing.assert_close(full(value["exp_avg"]), expected_avg[key], rtol=0, atol=0)


@pytest.mark.distributed(world_size=4)
def test_dcp_state_dict_helpers_4way_to_hsdp_2x2(
    rank: int, world_size: int, device_mesh_factory: Any, tmp_path: Any
) -> None:
    """``get_state_dict`` / ``set_state_dict`` with hp-fsdp modules, saved 4-way, loaded 2x2."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path, source, opt, tokens, targets = _one_step_4way(rank, world_size, tmp_path)
    model_sd, optim_sd = get_state_dict(source, opt)
    assert all(isinstance(v, DTensor) for v in model_sd.values())
    assert set(optim_sd["state"]) == set(model_sd)  # keyed by parameter name, not index
    expected_model = {k: full(v) for k, v in model_sd.items()}
    expected_avg = {k: full(v["exp_avg"]) for k, v in optim_sd["state"].items()}
    expected_sq = {k: full(v["exp_avg_sq"]) for k, v in optim_sd["state"].items()}
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

    mesh = device_mesh_factory((2, 2), ("replicate", "shard"))
    target = shard_blocks(build(seed=2), mesh=mesh)
    target_opt = torch.optim.AdamW(target.parameters(), lr=1e-2)
    model_sd, optim_sd = get_state_dict(target, target_opt)  # initialises the optimizer state
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(target, target_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    model_sd, optim_sd = get_state_dict(target, target_opt)
    for key, value in model_sd.items():
        torch.testing.assert_close(full(value), expected_model[key], rtol=0, atol=0, msg=key)
    for key, value in optim_sd["state"].items():
        torch.testing.assert_close(full(value["exp_avg"]), expected_avg[key], rtol=0, atol=0, msg=key)
        torch.testing.assert_close(full(value["exp_avg_sq"]), expected_sq[key], rtol=0, atol=0, msg=key)
    # and training continues from the loaded state on the new sharding: one more step runs
    loss_fn(target, tokens[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2]).backward()
    target_opt.step()
