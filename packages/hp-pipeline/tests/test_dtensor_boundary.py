"""A DTensor returned by one stage reaches the next as a DTensor, on the mesh ``get_mesh`` resolves.

torch's meaning of ``PipelineStage(get_mesh=...)`` ([Note: DTensors across
stages] in ``hp_pipeline.boundary``): the shard travels, the receiving stage
rebuilds the DTensor on a mesh of its own, found through the callback. Checked
against one process on the same data (losses and every gradient), on the
first step (metadata learned) and a later one (direct transfers).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hp_pipeline import PipelineStage, PipelineStepError, Schedule1F1B
from torch import nn

dtensor = pytest.importorskip("torch.distributed.tensor")
device_mesh = pytest.importorskip("torch.distributed.device_mesh")

WIDTH, M = 4, 2


class Sharding(nn.Module):
    """Stage 0: returns its activation as a DTensor sharded over the ``tp`` mesh."""

    def __init__(self, mesh: Any) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.mesh = mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.linear(x))
        return h if self.mesh is None else dtensor.DTensor.from_local(h, self.mesh, [dtensor.Shard(0)])


class Gathering(nn.Module):
    """Stage 1: takes a DTensor (checked), gathers it and applies a plain layer."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, 2)
        self.seen: list[Any] = []

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if isinstance(h, dtensor.DTensor):
            self.seen.append((tuple(h.placements), tuple(h.device_mesh.mesh_dim_names)))
            h = h.redistribute(placements=[dtensor.Replicate()]).to_local()
        return self.linear(h)


@pytest.mark.distributed(world_size=2, timeout=90)
def test_a_dtensor_crosses_a_stage_boundary(rank: int, world_size: int) -> None:
    mesh = device_mesh.init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "tp"))
    calls: list[tuple[str, ...]] = []

    def get_mesh(names: tuple[str, ...], layout: Any) -> Any:
        calls.append(names)
        return mesh[names]

    torch.manual_seed(3)
    plain = [Sharding(None), Gathering()]
    module = copy.deepcopy(plain[rank])
    if rank == 0:
        module.mesh = mesh["tp"]
    stage = PipelineStage(module, rank, 2, group=mesh["pp"], get_mesh=get_mesh if rank == 1 else None)
    schedule = Schedule1F1B(stage, M, nn.functional.mse_loss)
    gen = torch.Generator().manual_seed(4)
    for step in range(2):  # the first step learns the metadata; the second runs the direct transfers
        x, y = torch.randn(6, WIDTH, generator=gen), torch.randn(6, 2, generator=gen)
        stage.submod.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        schedule.step(x) if rank == 0 else schedule.step(target=y, losses=losses)
        reference = copy.deepcopy(plain)
        pieces = list(zip(x.tensor_split(M), y.tensor_split(M), strict=True))
        want = torch.stack([nn.functional.mse_loss(reference[1](reference[0](xi)), yi) for xi, yi in pieces])
        want.mean().backward()
        for got, ref in zip(stage.submod.parameters(), reference[rank].parameters(), strict=True):
            torch.testing.assert_close(got.grad, ref.grad, rtol=1e-5, atol=1e-6, msg=f"step {step} gradient")
        if rank == 1:
            torch.testing.assert_close(torch.stack(losses), want.detach(), rtol=1e-5, atol=1e-6)
    if rank == 1:
        assert module.seen == [((dtensor.Shard(0),), ("tp",))] * (2 * M)
        assert calls == [("tp",)], calls  # resolved once, then cached on the stage


@pytest.mark.distributed(world_size=2, timeout=60)
def test_a_dtensor_without_a_mesh_to_rebuild_it_on_fails_on_every_rank(rank: int, world_size: int) -> None:
    mesh = device_mesh.init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "tp"))
    module = Sharding(mesh["tp"]) if rank == 0 else Gathering()
    stage = PipelineStage(module, rank, 2, group=mesh["pp"])
    schedule = Schedule1F1B(stage, M, nn.functional.mse_loss)
    x, y = torch.randn(4, WIDTH), torch.randn(4, 2)
    with pytest.raises(
        PipelineStepError,
        match=r"stage 1 received a DTensor\[2, 4\] \[Shard\(dim=0\)\] on \('tp',\) over a mesh of shape "
        r"\[1\], and no DTensor of its module lies on such a mesh; pass PipelineStage\(..., get_mesh=",
    ):
        schedule.step(x) if rank == 0 else schedule.step(target=y)
