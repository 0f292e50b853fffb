"""What a downstream repository writes to test its own ``fully_shard`` model with hp-testing.

Copy this file into your tests (``pip install hp-testing``) and run ``pytest``.
The marker runs the test body on 2 ranks whose process group is already up,
here under NCCL emulation (gloo underneath, NCCL's rules checked on every
collective), so a bug that would hang or crash on GPUs fails here on a CPU.
The fixtures: ``rank``, ``world_size`` and ``device_mesh_factory`` (an
``hp_core.DeviceMesh`` over the test's ranks).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hp_dtensor import DTensor
from hp_fsdp import fully_shard
from torch import nn


class MyModel(nn.Module):
    """Stands for your model: two MLP blocks and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)) for _ in range(2)
        )
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


@pytest.mark.distributed(world_size=2, backend="nccl-emu")
def test_fully_shard_matches_one_process(rank: int, world_size: int, device_mesh_factory: Callable) -> None:
    mesh = device_mesh_factory((world_size,), ("dp",))
    torch.manual_seed(0)  # the same weights on every rank
    model = MyModel()
    reference = copy.deepcopy(model)  # trained on the whole batch in this process
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)

    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 1, generator=gen)
        mine = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
        F.mse_loss(model(x[mine]), y[mine]).backward()  # FSDP averages the gradients over the ranks
        opt.step()
        opt.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()

    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert isinstance(p, DTensor), f"{name} is not sharded"
        # fp32 and SGD: float rounding only (the design's fp32 tolerance)
        torch.testing.assert_close(
            p.full_tensor(), q, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.distributed(world_size=2, backend="nccl-emu")
def test_each_rank_holds_half_of_each_parameter(rank: int, device_mesh_factory: Callable) -> None:
    model = MyModel()
    fully_shard(model, mesh=device_mesh_factory((2,), ("dp",)))
    weight = model.blocks[0][0].weight
    assert weight.to_local().shape == (16, 8)  # dim 0 split over the 2 ranks
    assert weight.shape == (32, 8)
