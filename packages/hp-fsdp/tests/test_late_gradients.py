"""Parameters whose gradient arrives after their unit's post-backward marker fired.

[Note: gradients that arrive after the post-backward] in ``param_group.py``:
a block applied twice whose first call's inputs need no gradient, and a tied
embedding / head held by one unit (``fully_shard([emb, head])``, what the
tied-weight error recommends). Each runs a few AdamW steps against a
single-process deep copy on the same global batch: losses, every gradient,
every parameter after the step. Before the fix both raised "ran backward ...
but none of these parameters received a gradient" at the first marker.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hp_core.collectives as hc
import pytest
import torch
from hp_dtensor import DTensor
from hp_fsdp import fully_shard
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from hp_fsdp_testlib import Transformer, build, full, global_batch, loss_fn


def compare(model: nn.Module, ref: nn.Module, what: str, step: int) -> None:
    """Every gradient (None on both sides, or equal) or every parameter of ``model`` against ``ref``."""
    ref_named = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        got, want = (p.grad, ref_named[name].grad) if what == "grad" else (p, ref_named[name])
        if want is None:
            assert got is None, f"step {step} {what} {name}: set here, None in the reference"
            continue
        assert got is not None, f"step {step} {what} {name}: None here, set in the reference"
        torch.testing.assert_close(
            full(got).detach(), want.detach(), rtol=1e-6, atol=1e-8, msg=f"step {step} {what} {name}"
        )


def step_and_compare(
    model: nn.Module, ref: nn.Module, opts: tuple[torch.optim.Optimizer, torch.optim.Optimizer], step: int
) -> None:
    """Compare the gradients, step both optimizers, compare the parameters."""
    compare(model, ref, "grad", step)
    for opt in opts:
        opt.step()
        opt.zero_grad()
    compare(model, ref, "param", step)


def _train(
    model: nn.Module,
    ref: nn.Module,
    batch: Callable[[int], tuple[Any, Any]],
    loss: Callable[[nn.Module, Any], torch.Tensor],
    *,
    rank: int,
    world: int,
    steps: int = 3,
) -> None:
    """AdamW side by side: each rank takes its slice of the global batch, the reference takes all of it."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        whole = batch(step)
        ref_loss = loss(ref, whole)
        ref_loss.backward()
        mine = tuple(t.chunk(world)[rank] for t in whole)
        local = loss(model, mine)
        local.backward()
        mean = hc.all_reduce(local.detach().clone(), "avg")
        torch.testing.assert_close(mean, ref_loss.detach(), rtol=1e-7, atol=1e-9, msg=f"loss step {step}")
        step_and_compare(model, ref, (opt, ref_opt), step)


class _Twice(nn.Module):
    """``blk(tanh(blk(x)))`` with ``x`` plain data: the first call places no post-backward marker."""

    def __init__(self) -> None:
        super().__init__()
        self.blk = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.blk(torch.tanh(self.blk(x)))))


def _twice_batch(step: int) -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randn(4, 4, dtype=torch.float64, generator=g),)


def _twice_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return model(batch[0]).pow(2).mean()


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("reshard", [True, False])
def test_block_applied_twice_first_call_without_grad_input(rank: int, world_size: int, reshard: bool) -> None:
    torch.manual_seed(0)
    ref = _Twice().double()
    model = copy.deepcopy(ref)
    fully_shard(model.blk, reshard_after_forward=reshard)
    fully_shard(model)
    _train(model, ref, _twice_batch, _twice_loss, rank=rank, world=world_size)


@pytest.mark.distributed(world_size=2)
def test_block_applied_twice_unfused(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    ref = _Twice().double()
    model = copy.deepcopy(ref)
    fully_shard(model.blk, comm_fusion=False)
    fully_shard(model, comm_fusion=False)
    _train(model, ref, _twice_batch, _twice_loss, rank=rank, world=world_size)


def _tied_model(tied: bool) -> Transformer:
    model = build()
    model.head.bias = None  # a tied head is weight-only; keep both variants alike
    if tied:
        model.head.weight = model.emb.weight
    return model


def _lm_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return global_batch(step, 2)


def _lm_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return loss_fn(model, batch[0], batch[1])


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("tied", [True, False])
def test_embedding_and_head_in_one_unit(rank: int, world_size: int, tied: bool) -> None:
    """``fully_shard([emb, head])``: a tied weight's gradient is complete after the embedding's backward."""
    ref = _tied_model(tied)
    model = copy.deepcopy(ref)
    fully_shard([model.emb, model.head])
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    if tied:
        assert model.head.weight is model.emb.weight  # one Parameter, sharded once
    _train(model, ref, _lm_batch, _lm_loss, rank=rank, world=world_size)


class _Stale(nn.Module):
    """A block that computes with references to its parameters taken before ``fully_shard``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.kept = [self.fc.weight, self.fc.bias]  # a plain list: fully_shard cannot see it
        self.stale = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stale:
            return nn.functional.linear(x, self.kept[0], self.kept[1])
        return self.fc(x)


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.block = _Stale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.inp(x))


@pytest.mark.distributed(world_size=2)
def test_lost_gradients_of_a_nested_unit_still_raise(rank: int, world_size: int) -> None:
    """The genuine case is still an error, decided at the end of the backward, on every rank.

    The nested unit reduces at its marker (no gradient anywhere yet, which is
    not decided there: a later one could still arrive); after the root's
    final callback every rank raises, and the model is left ready for the
    next step.
    """
    torch.manual_seed(0)
    model = _Outer().double()
    fully_shard(model.block)
    fully_shard(model)
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"holding \[fc\.weight, fc\.bias\].*on any rank"):
        model(x).sum().backward()
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert model.block.fc.weight.grad is None and model.inp.weight.grad is not None
    model.zero_grad()
    model.block.stale = False
    model(x).sum().backward()  # the next step trains normally
    assert model.block.fc.weight.grad is not None


@pytest.mark.distributed(world_size=2)
def test_lost_gradients_found_by_reduce_grad(rank: int, world_size: int) -> None:
    """Outside backward (``reduce_grad`` after unsynced backwards) the error is raised at once."""
    torch.manual_seed(0)
    model = _Outer().double()
    fully_shard(model.block)
    fully_shard(model)
    model.set_requires_gradient_sync(False)
    model(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    with pytest.raises(RuntimeError, match=r"holding \[fc\.weight, fc\.bias\].*on any rank"):
        model.reduce_grad()
