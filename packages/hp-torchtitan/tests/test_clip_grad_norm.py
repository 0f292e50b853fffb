"""torchtitan's own ``clip_grad_norm_`` on hp's FSDP x TP parameters (2x2), against one process.

[Note: torchtitan's clip_grad_norm_ with hp DTensors]
``torchtitan.distributed.utils.clip_grad_norm_`` computes the total norm with
``torch.nn.utils.get_total_norm`` and calls ``.full_tensor()`` on it only if it
is a *torch* DTensor. On hp parameters (a column-wise weight on the
``("tp", "fsdp")`` mesh, a row-wise one on ``("fsdp", "tp")``) the total norm
is an hp DTensor holding per-rank partial norms, so that branch is skipped
without harm: ``clip_grads_with_norm_`` then computes
``max_norm / (total_norm + 1e-6)``, and hp_dtensor reduces the partial norm
(an all-reduce) before that non-linear step, so every gradient is scaled by the
true global coefficient. The driver therefore calls torchtitan's function
unchanged, and the returned norm is read with ``.full_tensor()``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 6))


@pytest.mark.distributed(world_size=4)
def test_clip_grad_norm_of_hp_params(rank: int, device_mesh_factory: Any) -> None:
    import hp_torchtitan  # noqa: F401  (the triton stand-in, before torchtitan's model code)
    from hp_dtensor import ColwiseParallel, DTensor, RowwiseParallel, parallelize_module
    from hp_fsdp import fully_shard
    from torchtitan.distributed.utils import clip_grad_norm_

    mesh = device_mesh_factory((2, 2), ("fsdp", "tp"))
    model, ref = _mlp(), _mlp()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["fsdp"])
    model.set_gradient_divide_factor(1.0)  # as torchtitan: the loss below is a sum over all rows
    torch.manual_seed(1)
    data = torch.randn(2, 3, 8)  # one row per fsdp rank; the tp ranks of a row see the same one
    dp = mesh.get_local_rank("fsdp")

    model(data[dp]).square().sum().backward()
    norm = clip_grad_norm_(list(model.parameters()), max_norm=0.5, foreach=True)

    ref(data.flatten(0, 1)).square().sum().backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.5, foreach=True)
    assert ref_norm > 0.5 * 4, ref_norm  # the clip really scales
    assert isinstance(norm, DTensor)  # hp's: torchtitan's torch-DTensor branch did not touch it
    torch.testing.assert_close(norm.full_tensor(), ref_norm, rtol=1e-5, atol=1e-6)
    for (name, param), ref_param in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert isinstance(param.grad, DTensor) and param.grad.device_mesh.ndim == 2, name
        torch.testing.assert_close(param.grad.full_tensor(), ref_param.grad, rtol=1e-5, atol=1e-6, msg=name)
