"""FSDP x TP combined with the other fully_shard options, each against a single-process copy.

dp=2 x tp=2 on 4 ranks; the model is the one of ``test_tp.py`` (column-wise ``up``, row-wise
``down``), so every option meets both TP layouts: the FSDP dim equal to the TP dim (nested
shards, mesh ordered ``(tp, dp)``) and different from it (mesh ``(dp, tp)``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hp_dtensor import ColwiseParallel, DTensor, Replicate, RowwiseParallel, Shard, parallelize_module
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from hp_fsdp_testlib import Tol, TPModel, parity, ref_copy
from hp_fsdp_testlib import build_tp as _build


def _norm_params(module: nn.Module) -> list[nn.Parameter]:
    return [p for m in module.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters(recurse=False)]


def _shard_last_dim(param: nn.Parameter) -> Shard:
    return Shard(param.dim() - 1)


def _bf16() -> Any:
    from hp_fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _offload() -> Any:
    from hp_fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy()


# option name -> fully_shard kwargs for one module (built per call: replicate_params needs the module)
COMBOS: dict[str, Any] = {
    "offload": lambda m: {"offload_policy": _offload()},
    "bf16": lambda m: {"mp_policy": _bf16()},
    "unfused": lambda m: {"comm_fusion": False},
    "replicate_params": lambda m: {"replicate_params": _norm_params(m)},
    "shard_placement_fn": lambda m: {"shard_placement_fn": _shard_last_dim},
    "shard_placement_fn_unfused": lambda m: {"shard_placement_fn": _shard_last_dim, "comm_fusion": False},
    "bf16_offload_unfused": lambda m: {
        "mp_policy": _bf16(),
        "offload_policy": _offload(),
        "comm_fusion": False,
    },
}


def _wrap(model: TPModel, tp_mesh: Any, dp_mesh: Any, combo: str) -> TPModel:
    from hp_fsdp import fully_shard

    for block in model.blocks:
        parallelize_module(block, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=dp_mesh, **COMBOS[combo](block))
    fully_shard(model, mesh=dp_mesh, **COMBOS[combo](model))
    return model


def _check_layouts(model: TPModel, combo: str, ref: TPModel) -> None:
    """The placements each option implies, and that every shard holds exactly the reference's values."""
    up, down, norm = model.blocks[0].up, model.blocks[0].down, model.blocks[0].norm
    if combo.startswith("shard_placement_fn"):
        # up.weight: TP cuts dim 0, FSDP dim 1 -> different dims, mesh (dp, tp)
        assert up.weight.placements == (Shard(1), Shard(0))
        assert up.weight.device_mesh.mesh_dim_names == ("dp", "tp")
        # down.weight: TP and FSDP both cut dim 1 -> nested, TP first
        assert down.weight.placements == (Shard(1), Shard(1))
        assert down.weight.device_mesh.mesh_dim_names == ("tp", "dp")
    else:
        assert up.weight.placements == (Shard(0), Shard(0))
        assert down.weight.placements == (Shard(0), Shard(1))
    if combo == "replicate_params":
        assert norm.weight.placements == (Replicate(),)
        assert norm.weight.to_local().shape == norm.weight.shape
    else:
        assert norm.weight.placements == (Shard(0),)
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        assert p.to_local().device.type == "cpu", name
        if "bf16" in combo:
            assert p.dtype == torch.float32, f"{name}: master shards stay fp32, got {p.dtype}"
    ref_named = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), ref_named[name].detach(), rtol=0, atol=0, msg=name)


@pytest.mark.distributed(world_size=4)
@pytest.mark.parametrize("combo", sorted(COMBOS))
def test_fsdp_x_tp_with_option(rank: int, world_size: int, device_mesh_factory: Any, combo: str) -> None:
    mesh = device_mesh_factory((2, 2), ("dp", "tp"))
    model = _build()
    tol = None
    if "bf16" in combo:
        model = model.float()
        # Same bf16 tolerances as test_parity's mixed-precision test (see the reasoning there).
        tol = Tol(rtol=5e-2, atol=2e-2, loss_rtol=2e-2, loss_atol=2e-2, param_atol=6e-2)
    ref = ref_copy(model)
    seen: list[torch.dtype] = []
    model.blocks[0].up.register_forward_hook(lambda m, i, o: seen.append(m.weight.dtype))
    _wrap(model, mesh["tp"], mesh["dp"], combo)
    _check_layouts(model, combo, ref)
    dp = mesh.get_local_rank("dp")
    parity(model, ref, dp_rank=dp, dp_world=mesh.size("dp"), steps=3, tol=tol)
    # the option really applied: bf16 compute, otherwise the parameters' own dtype
    assert set(seen) == {torch.bfloat16 if "bf16" in combo else torch.float64}, seen
    if "offload" in combo:
        for name, p in model.named_parameters():
            assert p.grad is None or p.grad.to_local().device.type == "cpu", name
