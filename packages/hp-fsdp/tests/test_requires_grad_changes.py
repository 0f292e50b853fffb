"""``requires_grad`` set on the sharded parameters after ``fully_shard`` is honoured at every step.

The user freezes or unfreezes the parameters they see (the sharded DTensors),
often after wrapping (fine-tuning: wrap, then freeze). Each case trains a
sharded model beside a single-process deep copy that gets the same flag
changes, and compares losses, every gradient (None where the reference has
None) and every parameter after the optimizer step ([Note: requires_grad
follows the user] in ``param.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hp_core.collectives as hc
import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from hp_fsdp_testlib import build, full, global_batch, loss_fn, ref_copy, shard_blocks

FlagChange = Callable[[nn.Module, int], None]


def _set(model: nn.Module, names: list[str], requires_grad: bool) -> None:
    params = dict(model.named_parameters())
    for name in names:
        params[name].requires_grad_(requires_grad)


def _train(
    model: nn.Module,
    ref: nn.Module,
    *,
    dp_rank: int,
    dp_world: int,
    steps: int,
    before_step: FlagChange,
    eval_between: bool = False,
) -> None:
    """SGD side by side; ``before_step(m, step)`` changes flags on both models before each step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(steps):
        tokens, targets = global_batch(step, dp_world)
        local = slice(2 * dp_rank, 2 * dp_rank + 2)
        if eval_between:
            with torch.no_grad():  # leaves the root gathered into the next step
                torch.testing.assert_close(model(tokens[local]), ref(tokens[local]), rtol=1e-7, atol=1e-9)
        before_step(model, step)
        before_step(ref, step)
        ref_loss = loss_fn(ref, tokens, targets)
        ref_loss.backward()
        loss = loss_fn(model, tokens[local], targets[local])
        loss.backward()
        mean = hc.all_reduce(loss.detach().clone(), "avg")
        torch.testing.assert_close(mean, ref_loss.detach(), rtol=1e-7, atol=1e-9, msg=f"loss step {step}")
        ref_named = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            expected = ref_named[name].grad
            assert p.requires_grad == ref_named[name].requires_grad, name
            if expected is None:
                assert p.grad is None, f"step {step}: {name} is frozen but has a gradient"
                continue
            assert p.grad is not None, f"step {step}: no grad for {name}"
            torch.testing.assert_close(
                full(p.grad), expected, rtol=1e-5, atol=1e-6, msg=f"grad {name} {step}"
            )
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for name, p in model.named_parameters():
            torch.testing.assert_close(
                full(p), ref_named[name], rtol=1e-5, atol=1e-6, msg=f"param {name} {step}"
            )


def _block_params(model: nn.Module, prefix: str) -> list[str]:
    return [name for name, _ in model.named_parameters() if name.startswith(prefix)]


def _case(name: str, model: nn.Module) -> tuple[FlagChange, bool]:
    """The flag changes of one case, and whether an evaluation forward runs before each step."""
    some = ["blocks.0.up.weight", "head.weight", "emb.weight"]  # a block's, the root's (gathered after eval)
    if name == "freeze_after_wrap":
        whole_block = _block_params(model, "blocks.1.")  # a unit with no trainable parameter left

        def freeze(m: nn.Module, step: int) -> None:
            if step == 0:
                _set(m, some + whole_block, False)

        return freeze, False
    if name == "freeze_later":

        def freeze_later(m: nn.Module, step: int) -> None:
            if step == 1:
                _set(m, some, False)
            if step == 2:
                _set(m, some[:1], True)

        return freeze_later, False
    if name == "unfreeze_after_eval":

        def toggle(m: nn.Module, step: int) -> None:
            if step == 1:
                _set(m, some, False)
            if step == 2:
                _set(m, some, True)

        return toggle, True
    raise AssertionError(name)


def _run_case(case: str, rank: int, world_size: int, *, seed: int, steps: int, **shard: Any) -> None:
    model = build(seed=seed)
    ref = ref_copy(model)
    shard_blocks(model, **shard)
    change, eval_between = _case(case, model)
    _train(
        model,
        ref,
        dp_rank=rank,
        dp_world=world_size,
        steps=steps,
        before_step=change,
        eval_between=eval_between,
    )


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("case", ["freeze_after_wrap", "freeze_later", "unfreeze_after_eval"])
@pytest.mark.parametrize("fusion", [True, False])
def test_requires_grad_set_after_wrap(rank: int, world_size: int, case: str, fusion: bool) -> None:
    _run_case(case, rank, world_size, seed=4, steps=4, comm_fusion=fusion)


@pytest.mark.distributed(world_size=2)
def test_frozen_at_wrap_then_unfrozen(rank: int, world_size: int) -> None:
    """Frozen before ``fully_shard``, unfrozen after it: the parameter trains from then on."""
    names = ["blocks.0.up.weight", "head.weight", "head.bias"]
    model = build(seed=5)
    _set(model, names, False)
    ref = ref_copy(model)
    shard_blocks(model)

    def unfreeze(m: nn.Module, step: int) -> None:
        if step == 1:
            _set(m, names, True)

    _train(model, ref, dp_rank=rank, dp_world=world_size, steps=3, before_step=unfreeze)


@pytest.mark.distributed(world_size=4)
def test_requires_grad_changes_hsdp_2x2(rank: int, world_size: int, device_mesh_factory: Any) -> None:
    mesh = device_mesh_factory((2, 2), ("replicate", "shard"))
    _run_case("unfreeze_after_eval", rank, world_size, seed=6, steps=3, mesh=mesh)


@pytest.mark.distributed(world_size=2)
def test_frozen_parameter_is_not_changed_by_the_optimizer(rank: int, world_size: int) -> None:
    """The reviewer's case, stated directly: frozen after wrap, no .grad, unchanged by AdamW."""
    model = shard_blocks(build(seed=7))
    frozen = dict(model.named_parameters())["blocks.0.up.weight"]
    frozen.requires_grad_(False)
    before = full(frozen).clone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        tokens, targets = global_batch(step, world_size)
        loss_fn(model, tokens[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2]).backward()
        assert frozen.grad is None
        opt.step()
        opt.zero_grad()
    assert torch.equal(full(frozen), before)
