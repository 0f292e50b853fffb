"""torch's own distributed helpers in local mode give what they give on gloo processes.

Each body runs in both modes, so the multi-process run is the reference the
local run must match: the helpers here read process-group properties that
the in-memory backend has to report as a gloo group does.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

BOTH_MODES = [
    pytest.param("process", marks=pytest.mark.distributed(world_size=2, mode="process"), id="process"),
    pytest.param("local", marks=pytest.mark.distributed(world_size=2, mode="local"), id="local"),
]


def _trained(seed: int) -> tuple[nn.Linear, torch.optim.Optimizer]:
    """A small model after one AdamW step: weights and optimizer state that depend on ``seed``."""
    torch.manual_seed(seed)
    model = nn.Linear(4, 3, dtype=torch.float64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4, dtype=torch.float64)).square().sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("mode", BOTH_MODES)
def test_groups_report_the_cpu_device_type_for_object_collectives(mode: str, rank: int) -> None:
    # torch picks the device of its object collectives and state-dict broadcasts from this list
    # (a gloo group lists cuda too: gloo's registration names both devices; hplocal's names cpu)
    pair = dist.new_group([0, 1])
    assert torch.device("cpu") in dist.group.WORLD._device_types
    assert torch.device("cpu") in pair._device_types
    assert dist.distributed_c10d._get_object_coll_device(pair) == "cpu"
    with warnings.catch_warnings():  # deprecated by torch, still read by its checkpoint code
        warnings.simplefilter("ignore")
        assert dist.distributed_c10d._get_pg_default_device(pair) == torch.device("cpu")
    objects: list[object] = [{"step": 3}, "rank 0's"] if rank == 0 else [None, None]
    dist.broadcast_object_list(objects, group=pair, group_src=0)
    assert objects == [{"step": 3}, "rank 0's"]
    received: list[object] = [None]
    dist.scatter_object_list(received, [("to", 0), ("to", 1)] if rank == 0 else None, group=pair, group_src=0)
    assert received == [("to", rank)]


@pytest.mark.parametrize("mode", BOTH_MODES)
def test_set_state_dicts_broadcast_from_rank0(mode: str, rank: int) -> None:
    # Rank 0 holds the full state dicts (as after loading a checkpoint); every other rank starts
    # from different weights and optimizer state, and gets rank 0's through torch's broadcast.
    reference, reference_opt = _trained(seed=0)
    model, optimizer = _trained(seed=rank + 1)
    full = StateDictOptions(full_state_dict=True)
    # copies, as a checkpoint gives: the optimizer keeps the tensors it loads, shared with the reference
    model_sd = copy.deepcopy(reference.state_dict()) if rank == 0 else {}
    optim_sd = (
        copy.deepcopy(get_optimizer_state_dict(reference, reference_opt, options=full)) if rank == 0 else {}
    )
    broadcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, model_sd, options=broadcast)
    set_optimizer_state_dict(model, optimizer, optim_sd, options=broadcast)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0)
    for param, ref_param in zip(model.parameters(), reference.parameters(), strict=True):
        mine, theirs = optimizer.state[param], reference_opt.state[ref_param]
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=0)
    # the loaded state trains on as rank 0's does: the same gradients and the same next step
    batch = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    for net, opt in ((model, optimizer), (reference, reference_opt)):
        opt.zero_grad()
        net(batch).square().sum().backward()
    for param, ref_param in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param.grad, ref_param.grad, rtol=0, atol=0)
    optimizer.step()
    reference_opt.step()
    for param, ref_param in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param, ref_param, rtol=0, atol=0)
