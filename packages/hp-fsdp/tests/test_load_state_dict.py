"""``load_state_dict`` into units left gathered, and with ``assign=True`` (FSDP2's meta-init recipe).

Every loading case then trains beside a single-process deep copy of the
source model (losses, every gradient, every parameter after AdamW), so a
value that did not reach the shards shows as a mismatch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hp_dtensor import DTensor, Replicate, distribute_tensor, local_tensor
from hp_fsdp import CPUOffloadPolicy

sys.path.insert(0, str(Path(__file__).parent))
from hp_fsdp_testlib import build, full, global_batch, parity, ref_copy, shard_blocks


def _full_values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: full(v).clone() for k, v in model.state_dict().items()}


def _assert_holds(model: torch.nn.Module, wanted: dict[str, torch.Tensor]) -> None:
    for key, value in model.state_dict().items():
        torch.testing.assert_close(full(value), wanted[key], rtol=0, atol=0, msg=key)


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("kind", ["full", "sharded"])
@pytest.mark.parametrize("reshard_after_forward", [None, False])
def test_load_after_forward_without_grad(
    rank: int, world_size: int, kind: str, reshard_after_forward: bool | None
) -> None:
    """An evaluation pass leaves the root (with False every unit) gathered; the load must reach the shards."""
    source = build(seed=1)
    ref = ref_copy(source)
    shard_blocks(source)
    state = source.state_dict() if kind == "sharded" else _full_values(source)
    wanted = _full_values(source)
    target = shard_blocks(build(seed=2), reshard_after_forward=reshard_after_forward)
    params_before = {id(p) for p in target.state_dict(keep_vars=True).values()}
    tokens, _ = global_batch(9, world_size)
    with torch.no_grad():
        target(tokens[2 * rank : 2 * rank + 2])
    target.load_state_dict(state)
    _assert_holds(target, wanted)
    assert {id(p) for p in target.parameters()} == params_before  # in place: optimizers stay valid
    parity(target, ref, dp_rank=rank, dp_world=world_size, steps=2)


@pytest.mark.distributed(world_size=2)
def test_load_into_a_submodule_of_a_gathered_unit(rank: int, world_size: int) -> None:
    """``model.head.load_state_dict`` while the root is gathered: the owning module's hook reshards."""
    source = build(seed=1)
    target = shard_blocks(build(seed=2))
    tokens, _ = global_batch(9, world_size)
    with torch.no_grad():
        target(tokens[2 * rank : 2 * rank + 2])
    target.head.load_state_dict(source.head.state_dict())
    for name, value in target.head.state_dict().items():
        torch.testing.assert_close(full(value), getattr(source.head, name), rtol=0, atol=0, msg=name)
    with torch.no_grad():
        source.emb.weight.copy_(full(target.emb.weight))  # the rest of the reference follows the target
        for block, ref_block in zip(target.blocks, source.blocks, strict=True):
            for p, ref_p in zip(block.parameters(), ref_block.parameters(), strict=True):
                ref_p.copy_(full(p))
        source.norm.weight.copy_(full(target.norm.weight))
        source.norm.bias.copy_(full(target.norm.bias))
    parity(target, source, dp_rank=rank, dp_world=world_size, steps=2)


def _sharded_like(model: torch.nn.Module, values: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``values`` (full tensors) distributed like ``model``'s state dict (its meshes and placements)."""
    out: dict[str, Any] = {}
    for key, like in model.state_dict().items():
        if isinstance(like, DTensor):
            out[key] = distribute_tensor(values[key], like.device_mesh, like.placements)
        else:
            out[key] = values[key]
    return out


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("init", ["meta", "real", "meta_offload"])
def test_load_assign_sharded_state_dict(rank: int, world_size: int, init: str) -> None:
    """FSDP2's recipe: ``fully_shard`` (on meta), ``load_state_dict(sharded, assign=True)``, then train."""
    source = build(seed=1)
    ref = ref_copy(source)
    wanted = _full_values(source)
    kwargs: dict[str, Any] = {"offload_policy": CPUOffloadPolicy()} if init == "meta_offload" else {}
    if init == "real":
        target = shard_blocks(build(seed=2), **kwargs)
    else:
        with torch.device("meta"):
            target = shard_blocks(build(seed=2), **kwargs)
    state = _sharded_like(target, wanted)
    target.load_state_dict(state, assign=True)
    registered = target.state_dict(keep_vars=True)
    for key, value in state.items():
        # assigned: the module holds the given shard itself, no copy
        assert local_tensor(registered[key]).data_ptr() == local_tensor(value).data_ptr(), key
        assert isinstance(registered[key], torch.nn.Parameter) and not registered[key].is_meta, key
    _assert_holds(target, wanted)
    parity(target, ref, dp_rank=rank, dp_world=world_size, steps=2)


@pytest.mark.distributed(world_size=2)
def test_load_assign_after_forward_without_grad(rank: int, world_size: int) -> None:
    """assign=True into a model whose root is gathered: the new shards are gathered at the next forward."""
    source = build(seed=1)
    ref = ref_copy(source)
    target = shard_blocks(build(seed=2))
    tokens, _ = global_batch(9, world_size)
    with torch.no_grad():
        target(tokens[2 * rank : 2 * rank + 2])
    target.load_state_dict(_sharded_like(target, _full_values(source)), assign=True)
    parity(target, ref, dp_rank=rank, dp_world=world_size, steps=2)


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("bad", ["full", "replicated"])
def test_load_assign_refuses_values_that_are_not_the_shard(rank: int, world_size: int, bad: str) -> None:
    """A full tensor or a DTensor of another sharding cannot be assigned: raise, change nothing."""
    source = build(seed=1)
    target = shard_blocks(build(seed=2))
    before = {k: (v, full(v).clone()) for k, v in target.state_dict(keep_vars=True).items()}
    state = _sharded_like(target, _full_values(source))
    if bad == "full":
        state["blocks.1.up.weight"] = full(state["blocks.1.up.weight"])
        match = r"'blocks.1.up.weight' is a plain Tensor of shape \(13, 6\), not a DTensor with placements"
    else:
        value = state["head.weight"]
        state["head.weight"] = value.redistribute(placements=[Replicate()])
        match = r"'head.weight' is a DTensor with placements \(Replicate\(\),\) on .*, the parameter's are"
    with pytest.raises(RuntimeError, match=match) as info:
        target.load_state_dict(state, assign=True)
    assert "Nothing was loaded" in str(info.value) and "without assign=True" in str(info.value)
    for key, value in target.state_dict(keep_vars=True).items():
        assert value is before[key][0], key
        torch.testing.assert_close(full(value), before[key][1], rtol=0, atol=0, msg=key)
