"""torch's ``torch.distributed.checkpoint.state_dict`` helpers on an hp_fsdp model.

torch's getters gather only ``torch.distributed.tensor.DTensor`` values, so
asked for a full state dict they used to hand back each rank's local shard
of hp_fsdp's ``hp_dtensor.DTensor`` parameters as if it were the full
tensor. They now raise on every rank ([Note: torch's full state dict
helpers] in ``state.py``); the sharded getters and the full setters work.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from hp_dtensor import DTensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
)

sys.path.insert(0, str(Path(__file__).parent))
from hp_fsdp_testlib import build, full, global_batch, loss_fn, parity, ref_copy, shard_blocks


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("cpu_offload", [True, False])
def test_get_full_model_state_dict_raises_on_every_rank(
    rank: int, world_size: int, cpu_offload: bool
) -> None:
    model = shard_blocks(build(seed=1))
    expected = {k: full(v).clone() for k, v in model.state_dict().items()}
    options = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
    with pytest.raises(NotImplementedError, match=r"get_model_state_dict.*full_state_dict=True") as info:
        get_model_state_dict(model, options=options)
    message = str(info.value)
    assert "local shard" in message and "full_tensor()" in message and "full_state_dict=False" in message
    for key, value in model.state_dict().items():  # nothing changed; the model is usable
        torch.testing.assert_close(full(value), expected[key], rtol=0, atol=0)
    tokens, targets = global_batch(0, world_size)
    loss_fn(model, tokens[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2]).backward()


@pytest.mark.distributed(world_size=2)
def test_get_full_state_dict_with_optimizer_raises(rank: int, world_size: int) -> None:
    model = shard_blocks(build(seed=1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(NotImplementedError, match=r"get_state_dict.*full_state_dict=True"):
        get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))


@pytest.mark.distributed(world_size=2)
def test_sharded_getter_and_named_full_recipe(rank: int, world_size: int) -> None:
    """The sharded getter still works, and the gather the error message names gives the full tensors."""
    source = build(seed=1)
    wanted = {k: v.detach().clone() for k, v in source.state_dict().items()}
    model = shard_blocks(source)
    tokens, _ = global_batch(0, world_size)
    with torch.no_grad():
        model(tokens[:2])  # the root stays gathered: both must still give the shards' values
    sharded = get_model_state_dict(model, options=StateDictOptions(cpu_offload=True))
    assert sharded.keys() == wanted.keys()
    gathered = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    for key, value in sharded.items():
        assert isinstance(value, DTensor), key
        torch.testing.assert_close(value.full_tensor(), wanted[key], rtol=0, atol=0, msg=key)
        assert not isinstance(gathered[key], DTensor), key
        torch.testing.assert_close(gathered[key], wanted[key], rtol=0, atol=0, msg=key)


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("broadcast", [True, False])
def test_set_full_model_state_dict_then_train(rank: int, world_size: int, broadcast: bool) -> None:
    """Full tensors through torch's setter (from rank 0 only, or on every rank) load into the shards."""
    source = build(seed=1)
    ref = ref_copy(source)
    full_sd = {k: v.detach().clone() for k, v in source.state_dict().items()}
    model = shard_blocks(build(seed=2))
    given = full_sd if (rank == 0 or not broadcast) else {}
    set_model_state_dict(
        model, given, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
    )
    for key, value in model.state_dict().items():
        assert isinstance(value, DTensor), key
        torch.testing.assert_close(value.full_tensor(), full_sd[key], rtol=0, atol=0, msg=key)
    parity(model, ref, dp_rank=rank, dp_world=world_size, steps=2)
