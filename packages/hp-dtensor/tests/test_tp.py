"""Tensor parallelism: an MLP and an attention block trained 5 AdamW steps vs a single-process copy."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hp_dtensor import ColwiseParallel, DTensor, RowwiseParallel, parallelize_module
from torch import nn


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Attention(nn.Module):
    def __init__(self, dim: int = 16, head_dim: int = 4) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.q = nn.Linear(dim, dim)
        # No key bias: softmax ignores it, so its gradient is rounding noise that Adam would amplify.
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (proj(x).view(b, s, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


def _train(model: nn.Module, ref: nn.Module, dim: int, foreach: bool) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=foreach)
    for step in range(5):
        torch.manual_seed(100 + step)
        x = torch.randn(2, 4, dim)
        loss = model(x).pow(2).mean()
        ref_loss = ref(x).pow(2).mean()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        loss.backward()
        ref_loss.backward()
        for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert isinstance(p, DTensor), name
            torch.testing.assert_close(p.grad.full_tensor(), r.grad, rtol=1e-5, atol=1e-6, msg=name)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for p, r in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(
                p.full_tensor(), r, rtol=1e-5, atol=1e-6, msg=f"step {step}: {p.placements}"
            )


@pytest.mark.distributed(world_size=4)
def test_mlp_and_attention_tp2_tp4(rank, device_mesh_factory) -> None:  # type: ignore[no-untyped-def]
    meshes = {4: device_mesh_factory((4,), ("tp",)), 2: device_mesh_factory((2, 2), ("dp", "tp"))["tp"]}
    for tp, mesh in meshes.items():
        torch.manual_seed(0)
        ref = MLP()
        model = parallelize_module(
            copy.deepcopy(ref), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()}
        )
        assert model.up.weight.placements[0].is_shard(0)
        _train(model, ref, 8, foreach=tp == 4)
        torch.manual_seed(0)
        ref_attn = Attention()
        plan = {
            "q": ColwiseParallel(),
            "k": ColwiseParallel(),
            "v": ColwiseParallel(),
            "o": RowwiseParallel(),
        }
        attn = parallelize_module(copy.deepcopy(ref_attn), mesh, plan)
        _train(attn, ref_attn, 16, foreach=tp == 2)
