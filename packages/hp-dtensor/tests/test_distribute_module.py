"""distribute_module: partition_fn, leftover parameters and buffers replicated, input/output hooks."""

from __future__ import annotations

import copy

import pytest
import torch
from hp_dtensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.out = nn.Linear(8, 3)
        self.register_buffer("scale", torch.tensor([1.0, 2.0, 3.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.fc(x))) * self.scale


@pytest.mark.distributed(world_size=4)
def test_distribute_module_trains_like_one_process(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    mesh = device_mesh_factory((4,))
    torch.manual_seed(0)
    ref = Net()
    calls: list[str] = []

    def partition(name: str, module: nn.Module, device_mesh) -> None:  # type: ignore[no-untyped-def]
        calls.append(name)
        if name == "fc":  # column-wise: output features cut, like ColwiseParallel
            for key in ("weight", "bias"):
                param = getattr(module, key)
                module.register_parameter(
                    key, nn.Parameter(distribute_tensor(param.data, device_mesh, [Shard(0)]))
                )

    def input_fn(module: nn.Module, inputs, device_mesh):  # type: ignore[no-untyped-def]
        return tuple(distribute_tensor(x, device_mesh, [Replicate()]) for x in inputs)

    def output_fn(module: nn.Module, output, device_mesh):  # type: ignore[no-untyped-def]
        assert isinstance(output, DTensor)
        return output.full_tensor()

    model = distribute_module(copy.deepcopy(ref), mesh, partition, input_fn, output_fn)
    assert calls == ["", "fc", "out"]  # every submodule, root first
    assert model.fc.weight.placements == (Shard(0),) and model.fc.bias.placements == (Shard(0),)
    assert model.out.weight.placements == (Replicate(),)  # untouched by partition_fn: replicated
    assert isinstance(model.scale, DTensor) and model.scale.placements == (Replicate(),)
    assert model.fc.weight.to_local().shape == (2, 6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        torch.manual_seed(step)
        x = torch.randn(5, 6)
        out = model(x)
        assert not isinstance(out, DTensor)
        ref_out = ref(x)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
        out.pow(2).sum().backward()
        ref_out.pow(2).sum().backward()
        for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad.full_tensor(), r.grad, rtol=1e-5, atol=1e-6, msg=name)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    with pytest.raises(TypeError, match=r"hp_core\.DeviceMesh or a torch DeviceMesh, got builtins\.str"):
        distribute_module(Net(), "mesh")  # type: ignore[arg-type]
