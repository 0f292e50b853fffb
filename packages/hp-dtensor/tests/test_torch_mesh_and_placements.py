"""A torch DeviceMesh and torch's Shard / Replicate / Partial wherever ours are taken (2 and 4 ranks).

Values and gradients against plain single-process tensors; a torch-mesh TP MLP
trained against one process.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.tensor as tdt
from hp_core import DeviceMesh
from hp_dtensor import (
    ColwiseParallel,
    DTensor,
    Partial,
    Replicate,
    RowwiseParallel,
    Shard,
    distribute_module,
    distribute_tensor,
    local_map,
    parallelize_module,
)
from hp_testing import record_collectives
from torch import nn
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
from torch.distributed.tensor._ops._embedding_ops import _MaskPartial
from torch.distributed.tensor.placement_types import _StridedShard

TS, TR, TP = tdt.Shard, tdt.Replicate, tdt.Partial


def test_placements_equal_torch_equivalents_both_ways() -> None:
    pairs = [(Shard(0), TS(0)), (Shard(1), TS(1)), (Replicate(), TR())]
    pairs += [(Partial(op), TP(op)) for op in ("sum", "avg", "max", "min")]
    for ours, theirs in pairs:
        assert ours == theirs and theirs == ours
        assert (ours != theirs, theirs != ours) == (False, False)
        assert hash(ours) == hash(theirs)
        assert len({ours, theirs}) == 1 and {ours: 1}[theirs] == 1
    for ours, theirs in [
        (Shard(0), TS(1)),
        (Shard(0), TR()),
        (Replicate(), TP()),
        (Partial("sum"), TP("max")),
    ]:
        assert ours != theirs and theirs != ours
    assert Shard(0) != _StridedShard(0, split_factor=2) and _StridedShard(0, split_factor=2) != Shard(0)
    assert Partial("norm", 2) != TP("sum") and Shard(0) != "S(0)" and Shard(0) != Replicate()
    assert (Shard(0), Replicate()) == (TS(0), TR())  # torchtitan: dtensor.placements == (Shard(0), ...)


@pytest.mark.distributed(world_size=4)
def test_distribute_from_local_redistribute_on_a_torch_mesh(rank: int) -> None:
    theirs = torch_init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh = DeviceMesh.from_torch(theirs)
    torch.manual_seed(0)
    x = torch.randn(6, 8, dtype=torch.float64)
    weight = torch.randn(6, 8, dtype=torch.float64)

    leaf = x.clone().requires_grad_()
    dt = distribute_tensor(leaf, theirs, [TS(0), TS(1)])
    assert isinstance(dt, DTensor) and dt.device_mesh is mesh  # one hp mesh per torch mesh
    assert dt.placements == (Shard(0), Shard(1)) == (TS(0), TS(1)) and dt.placements[0] == TS(0)
    torch.testing.assert_close(dt.full_tensor(), x)
    again = distribute_tensor(x, theirs, [TS(0), TS(1)])
    assert again._layout.token() == dt._layout.token()  # same mesh object: same dispatch-cache key

    moved = dt.redistribute(theirs, [TR(), TS(0)])
    assert moved.placements == (Replicate(), Shard(0))
    torch.testing.assert_close(moved.full_tensor(), x)
    (moved.full_tensor() * weight).sum().backward()
    assert dt.grad is not None and dt.grad.placements == (Shard(0), Shard(1))
    torch.testing.assert_close(dt.grad.full_tensor(), weight)

    coord = mesh.get_coordinate()
    assert coord is not None
    local = x.chunk(2, dim=1)[coord[1]] * (coord[0] + 1) / 3  # dp ranks hold terms summing to x
    summed = DTensor.from_local(local, theirs, [TP("sum"), TS(1)])
    assert summed.placements == (Partial("sum"), Shard(1))
    torch.testing.assert_close(summed.full_tensor(), x)
    highest = DTensor.from_local(x.chunk(2, dim=1)[coord[1]] - coord[0], theirs, [TP("max"), TS(1)])
    torch.testing.assert_close(highest.full_tensor(), x)
    ragged = DTensor.from_local(torch.ones(coord[0] + 1, 2), theirs, [TS(0), TR()], shape=(3, 2))
    assert ragged.shape == (3, 2) and ragged._layout.is_ragged()  # torch's Shard triggers the size gather

    plain = x.clone().requires_grad_()
    DTensor.from_local(plain, theirs, [TR(), TR()]).to_local(grad_placements=[TR(), TR()]).sum().backward()
    torch.testing.assert_close(plain.grad, torch.ones_like(x))

    with pytest.raises(TypeError, match=r"_MaskPartial.*no hp_dtensor equivalent.*Shard\(d\), Replicate\(\)"):
        distribute_tensor(x, theirs, [_MaskPartial(), TR()])
    with pytest.raises(TypeError, match=r"single placement"):
        distribute_tensor(x, theirs, TS(0))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"hp_core\.DeviceMesh or a torch DeviceMesh, got builtins\.str"):
        distribute_tensor(x, "dp", [TR(), TR()])  # type: ignore[arg-type]


@pytest.mark.distributed(world_size=2)
def test_local_map_and_distribute_module_on_a_torch_mesh(rank: int) -> None:
    theirs = torch_init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    x = torch.randn(4, 6, dtype=torch.float64)

    @local_map(out_placements=[TS(0)], in_placements=([TS(0)],), device_mesh=theirs)
    def scaled(a: torch.Tensor) -> torch.Tensor:
        return a * 3

    leaf = x.clone().requires_grad_()
    dt = distribute_tensor(leaf, theirs, [TS(0)])
    out = scaled(dt)
    assert isinstance(out, DTensor) and out.device_mesh is DeviceMesh.from_torch(theirs)
    torch.testing.assert_close(out.full_tensor(), x * 3)
    out.full_tensor().sum().backward()
    assert dt.grad is not None
    torch.testing.assert_close(dt.grad.full_tensor(), torch.full_like(x, 3.0))

    linear = nn.Linear(6, 3, dtype=torch.float64)
    reference = copy.deepcopy(linear)
    seen = []
    distribute_module(linear, theirs, lambda name, sub, mesh: seen.append(mesh))
    assert seen and all(m is DeviceMesh.from_torch(theirs) for m in seen)
    assert isinstance(linear.weight, DTensor) and linear.weight.placements == (TR(),)
    replicated = distribute_tensor(x, theirs, [TR()])
    torch.testing.assert_close(linear(replicated).full_tensor(), reference(x))


@pytest.mark.distributed(world_size=2)
def test_torch_mesh_tp_mlp_trains_like_one_process(rank: int) -> None:
    theirs = torch_init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    reference = nn.Sequential(
        nn.Linear(8, 16, dtype=torch.float64), nn.ReLU(), nn.Linear(16, 8, dtype=torch.float64)
    )
    model = copy.deepcopy(reference)
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel(input_layouts=TS(-1), output_layouts=TR())}
    parallelize_module(model, theirs, plan)
    assert model[0].weight.placements == (TS(0),) and model[2].weight.placements == (TS(1),)
    ours = copy.deepcopy(reference)  # the same plan on the hp mesh moves the same bytes
    parallelize_module(ours, DeviceMesh.from_torch(theirs), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        x = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        with record_collectives() as log:
            loss = model(x).pow(2).sum()
            loss.backward()
        with record_collectives() as ours_log:
            ours(x).pow(2).sum().backward()
        assert log.counts() == ours_log.counts() and log.nbytes() == ours_log.nbytes()
        ref_loss = reference(x).pow(2).sum()
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss)
        for (name, param), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert param.grad is not None, name
            torch.testing.assert_close(param.grad.full_tensor(), ref.grad, msg=name)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(param.full_tensor(), ref)
