"""Bad input: a clear error naming the parameter and the fix, and the model left untouched."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hp_dtensor import DTensor, Shard, distribute_tensor
from hp_fsdp import CPUOffloadPolicy, HSDPModule, MixedPrecisionPolicy, fully_shard
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from hp_fsdp_testlib import build


def _untouched(model: nn.Module, before: dict[str, Any]) -> None:
    assert not isinstance(model, HSDPModule)
    for name, p in model.named_parameters():
        assert not isinstance(p, DTensor), name
        assert p is before[name], name
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks


@pytest.mark.distributed(world_size=2)
def test_fully_shard_twice(rank: int, world_size: int) -> None:
    model = build()
    fully_shard(model)
    with pytest.raises(ValueError, match=r"already passed to fully_shard.*once per module"):
        fully_shard(model)


@pytest.mark.distributed(world_size=2)
def test_overlapping_units(rank: int, world_size: int) -> None:
    model = build()
    before = dict(model.named_parameters())
    with pytest.raises(ValueError, match=r"inside module\[0\].*must not overlap"):
        fully_shard([model, model.blocks[0]])
    _untouched(model, before)


@pytest.mark.distributed(world_size=4)
def test_mesh_with_three_dims(rank: int, world_size: int, device_mesh_factory: Any) -> None:
    mesh = device_mesh_factory((1, 2, 2), ("a", "b", "c"))
    model = build()
    before = dict(model.named_parameters())
    with pytest.raises(ValueError, match=r"3 dims \(1, 2, 2\).*1-D mesh \(FSDP\) or a 2-D"):
        fully_shard(model, mesh=mesh)
    _untouched(model, before)


@pytest.mark.distributed(world_size=2)
def test_mixed_devices(rank: int, world_size: int) -> None:
    model = build()
    model.blocks[1].up.weight = nn.Parameter(torch.empty(13, 6, device="meta"))
    before = dict(model.named_parameters())
    with pytest.raises(ValueError, match=r"'blocks.1.up.weight' on meta"):
        fully_shard(model)
    _untouched(model, before)


@pytest.mark.distributed(world_size=2)
def test_shard_dim_out_of_range(rank: int, world_size: int) -> None:
    model = build()
    before = dict(model.named_parameters())
    with pytest.raises(ValueError, match=r"Shard\(2\) for 'emb.weight' of shape \(13, 6\)"):
        fully_shard(model, shard_placement_fn=lambda p: Shard(2))
    _untouched(model, before)


def test_offload_needs_cpu_params() -> None:
    """No accelerator here, so a stand-in reports a non-CPU device to the validator fully_shard runs first."""
    from hp_fsdp.param import ParamInfo
    from hp_fsdp.plan import ParamPlan, _check_params

    class OnAccelerator:
        is_meta = False
        device = torch.device("xpu", 0) if hasattr(torch, "xpu") else torch.device("meta")
        shape = (4, 4)

        def dim(self) -> int:
            return 2

    owner = nn.Linear(4, 4)
    plan = ParamPlan(OnAccelerator(), [ParamInfo(owner, "weight", "layer.weight")], 0, False)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"CPUOffloadPolicy needs parameters on CPU.*'layer.weight' is on xpu:0"
    ):
        _check_params([plan], None, offload=True)
    _check_params([plan], None, offload=False)  # without offload the same parameter is fine


@pytest.mark.distributed(world_size=2)
def test_scalar_parameter_needs_replicate(rank: int, world_size: int) -> None:
    model = build()
    model.scale = nn.Parameter(torch.tensor(1.0, dtype=torch.float64))
    before = dict(model.named_parameters())
    with pytest.raises(ValueError, match=r"'scale' is a 0-dim scalar.*replicate_params"):
        fully_shard(model)
    _untouched(model, before)
    fully_shard(model, replicate_params=[model.scale])  # the suggested fix works
    assert isinstance(model.scale, DTensor)


@pytest.mark.distributed(world_size=2)
def test_tensor_parallel_param_on_the_data_parallel_mesh(
    rank: int, world_size: int, device_mesh_factory: Any
) -> None:
    mesh = device_mesh_factory((2,))
    model = nn.Linear(4, 4)
    model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(0)]))
    before = dict(model.named_parameters())
    with pytest.raises(ValueError, match=r"'weight' is a DTensor over mesh .* not another dim"):
        fully_shard(model)  # the default mesh is the same dim the weight is already sharded on
    assert not isinstance(model, HSDPModule)
    assert dict(model.named_parameters()) == before  # the same Parameter objects: nothing changed
    assert not isinstance(model, HSDPModule)


@pytest.mark.distributed(world_size=2)
def test_bad_setter_values(rank: int, world_size: int) -> None:
    model = fully_shard(build())
    with pytest.raises(ValueError, match=r"pass 'avg'.* or 'sum'"):
        model.set_reduce_op_type("mean")
    with pytest.raises(ValueError, match="positive"):
        model.set_gradient_divide_factor(0)
    with pytest.raises(ValueError, match="not passed to fully_shard"):
        model.set_modules_to_forward_prefetch([nn.Linear(1, 1)])


def test_policies_are_frozen() -> None:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    with pytest.raises(AttributeError):
        policy.param_dtype = torch.float16  # type: ignore[misc]
    assert CPUOffloadPolicy().pin_memory is True


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("value", [3, "yes", 1.0])
def test_reshard_after_forward_values(rank: int, world_size: int, value: Any) -> None:
    """More int cases (group sizes) in test_reshard_groups.py."""
    model = build()
    before = dict(model.named_parameters())
    kind = ValueError if isinstance(value, int) else TypeError
    fix = r"Pass one of \[1, 2\]" if isinstance(value, int) else "pass True, False, None"
    with pytest.raises(kind, match=rf"reshard_after_forward={re.escape(repr(value))}.*{fix}"):
        fully_shard(model, reshard_after_forward=value)
    _untouched(model, before)
    fully_shard(model)
    with pytest.raises(kind, match=r"set_reshard_after_forward: reshard_after_forward"):
        model.set_reshard_after_forward(value)  # type: ignore[attr-defined]
    assert model.reshard_after_forward is None  # type: ignore[attr-defined]


class _StaleReference(nn.Module):
    """Keeps references to its layer's parameters from before ``fully_shard`` and computes with them."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)
        self.kept = [self.fc.weight, self.fc.bias]  # a plain list: fully_shard cannot see it

    def forward(self, x: torch.Tensor, stale: bool) -> torch.Tensor:
        if stale:
            return nn.functional.linear(x, self.kept[0], self.kept[1])
        return self.fc(x)  # self.unused stays unused: a legitimate partial use


@pytest.mark.distributed(world_size=2)
def test_backward_that_reaches_no_parameter_is_an_error(rank: int, world_size: int) -> None:
    """[Note: no silent gradient loss]: every rank raises, names the parameters, assigns nothing."""
    from hp_testing import record_collectives

    torch.manual_seed(0)
    model = _StaleReference()
    fully_shard(model)
    x = torch.randn(3, 4)
    with record_collectives() as log:
        with pytest.raises(
            RuntimeError, match=r"fc\.weight, fc\.bias, unused\.weight, unused\.bias.*ran backward"
        ):
            model(x, stale=True).sum().backward()
    # Every rank reduces (whether gradients arrived is read from the reduction's flags, the same on every
    # rank: [Note: gradient flags] in collectives.py), nothing is assigned, and the error comes after the
    # root's final callback, so the model is left resharded and ready for the next step.
    assert log.count("reduce_scatter_tensor") == 1
    assert all(isinstance(p, DTensor) and p.grad is None for p in model.parameters())
    # The usual forward is fine, with a parameter left unused as FSDP2 allows: no error, and the
    # unused parameters simply get no gradient.
    model(x, stale=False).sum().backward()
    assert model.fc.weight.grad is not None and model.unused.weight.grad is None
