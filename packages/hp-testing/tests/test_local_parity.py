"""hp-fsdp and hp-pipeline in both modes: the same bodies on the process pool and on local ranks.

Each body checks itself against a plain single-process model built from the
same seed, in float64 (values, gradients, parameters after the optimizer
step), and counts its communication, so both modes passing means both give
the reference's numbers with the same collectives.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hp_dtensor import DTensor
from hp_fsdp import fully_shard
from hp_pipeline import PipelineStage, ScheduleGPipe
from hp_testing import DeviceMeshFactory, record_collectives
from torch import nn

WORLD = 4


def _modes() -> list[Any]:
    return [
        pytest.param(mode, marks=pytest.mark.distributed(world_size=WORLD, mode=mode), id=mode)
        for mode in ("process", "local")
    ]


def _blocks(n: int, dim: int = 6) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(dim, dim, dtype=torch.float64), nn.Tanh()) for _ in range(n)]
    )


def _batch(rows: int, dim: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return (
        torch.randn(rows, dim, dtype=torch.float64, generator=gen),
        torch.randn(rows, dim, dtype=torch.float64, generator=gen),
    )


@pytest.mark.parametrize("mode", _modes())
def test_fully_shard_step_same_in_both_modes(
    mode: str, rank: int, device_mesh_factory: DeviceMeshFactory
) -> None:
    model = _blocks(2)
    reference = copy.deepcopy(model)
    mesh = device_mesh_factory((WORLD,), ("dp",))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = _batch(2 * WORLD)
    mine = slice(2 * rank, 2 * rank + 2)
    with record_collectives() as log:
        loss = nn.functional.mse_loss(model(x[mine]), y[mine])
        loss.backward()
    ref_loss = nn.functional.mse_loss(reference(x), y)
    ref_loss.backward()
    # FSDP2's figures: N + 1 all-gathers forward (2 blocks + root, the root's unit empty here: 2),
    # the blocks' again in backward, one reduce-scatter per unit with gradients
    assert log.count("all_gather_into_tensor") == 4, [r.name for r in log]
    assert log.count("reduce_scatter_tensor") == 2, [r.name for r in log]
    for (name, p), r in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert isinstance(p, DTensor) and isinstance(p.grad, DTensor), name
        torch.testing.assert_close(p.grad.full_tensor(), r.grad, msg=name)
    opt.step()
    ref_opt.step()
    for (name, p), r in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert isinstance(p, DTensor), name
        torch.testing.assert_close(p.full_tensor(), r.detach(), msg=name)


@pytest.mark.parametrize("mode", _modes())
def test_pipeline_step_same_in_both_modes(mode: str, rank: int) -> None:
    blocks = _blocks(WORLD)
    reference = copy.deepcopy(blocks)
    stage = PipelineStage(copy.deepcopy(blocks[rank]), rank, WORLD)
    schedule = ScheduleGPipe(stage, 4, nn.functional.mse_loss)
    x, y = _batch(8)
    losses: list[torch.Tensor] = []
    with record_collectives() as log:
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y if rank == WORLD - 1 else None, losses=losses)
    assert [r.name for r in log] == []  # activations, gradients and the failure vote: point to point only
    nn.functional.mse_loss(reference(x), y).backward()
    for got, want in zip(stage.submod.parameters(), reference[rank].parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad)
    if rank == WORLD - 1:
        micro = [nn.functional.mse_loss(reference(x[i : i + 2]), y[i : i + 2]) for i in range(0, 8, 2)]
        torch.testing.assert_close(torch.stack(losses).detach(), torch.stack(micro).detach())
