"""hp_fsdp's load_state_dict check against two things torch's FSDP2 (and torchtitan) rely on."""

import pytest
import torch
from torch import nn


class SplitOnSave(nn.Module):
    """Saves its fused weight as two keys and merges them back on load, as torchtitan's FusedQKVLinear."""

    def __init__(self) -> None:
        super().__init__()
        self.wab = nn.Linear(4, 8, bias=False)
        self.register_state_dict_post_hook(self._split)
        self.register_load_state_dict_pre_hook(self._merge)

    @staticmethod
    def _split(module, state_dict, prefix, local_metadata):
        w = state_dict.pop(f"{prefix}wab.weight")
        state_dict[f"{prefix}wa.weight"], state_dict[f"{prefix}wb.weight"] = w[:4], w[4:]

    @staticmethod
    def _merge(module, state_dict, prefix, *args):
        wa, wb = state_dict.pop(f"{prefix}wa.weight"), state_dict.pop(f"{prefix}wb.weight")
        state_dict[f"{prefix}wab.weight"] = torch.cat([wa, wb])


def _sharded(kind: str, mesh) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(SplitOnSave(), nn.Linear(8, 4))
    if kind == "hp":
        from hp_fsdp import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard

        mesh = mesh.to_torch()
    fully_shard(model[1], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(sd):
    return {k: v.full_tensor() for k, v in sd.items()}


@pytest.mark.parametrize("kind", ["torch", "hp"])
@pytest.mark.distributed(world_size=2)
def test_strict_false_ignores_keys_of_other_objects(rank, device_mesh_factory, kind) -> None:
    model = _sharded(kind, device_mesh_factory((2,), ("dp",)))
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    result = model.load_state_dict({**sd, "optimizer.state.x": torch.zeros(1)}, strict=False)
    assert result.unexpected_keys == ["optimizer.state.x"]


@pytest.mark.parametrize("kind", ["torch", "hp"])
@pytest.mark.distributed(world_size=2)
def test_a_submodules_load_pre_hook_renames_before_the_check(rank, device_mesh_factory, kind) -> None:
    model = _sharded(kind, device_mesh_factory((2,), ("dp",)))
    sd = model.state_dict()
    assert "0.wa.weight" in sd and "0.wab.weight" not in sd
    expected = {k: v.detach() + 1 for k, v in sd.items()}
    model.load_state_dict(expected)
    torch.testing.assert_close(_full(model.state_dict()), _full(expected))
