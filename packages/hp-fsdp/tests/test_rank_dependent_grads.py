"""Parameters that get a gradient on some ranks and not on others ([Note: gradient flags] in collectives.py).

A conditional expert used only by some ranks' data, a whole unit whose
parameters only some ranks use, and a parameter no rank uses. Every rank
takes the reduced shard as its gradient whenever any rank had one (a rank
without a local gradient used to keep ``.grad`` unset and never train its
shard; a unit without any local gradient skipped its reduction, so the ranks'
collectives paired up wrongly), and ``.grad`` stays unset where no rank had
one, as in the single-process reference (AdamW's weight decay would
otherwise move it). Each case runs AdamW steps against a single-process deep
copy that sees the whole global batch: losses, every gradient (None where
the reference has None), every parameter after the step.
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
from hp_fsdp import fully_shard
from hp_testing import record_collectives
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from hp_fsdp_testlib import full
from test_late_gradients import step_and_compare  # a sibling test module, found through sys.path


class _Gated(nn.Module):
    """``a`` always, ``expert`` only where the sample's rank says so, ``idle`` never."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 5)
        self.expert = nn.Linear(5, 5)
        self.idle = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        h = self.a(x)
        if use:
            h = h + self.expert(h)
        return h.pow(2).mean()


class _Skip(nn.Module):
    """A unit that passes its input through and uses its parameters only when asked."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        return x + self.proj(x) if use else x * 1.0


class _Stack(nn.Module):
    """``a``, then the skippable unit, then ``b``: the skippable unit's marker fires on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 5)
        self.skip = _Skip()
        self.b = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        return self.b(self.skip(self.a(x), use)).pow(2).mean()


def _train(
    model: nn.Module,
    ref: nn.Module,
    uses: Callable[[int, int], bool],
    *,
    rank: int,
    world: int,
    steps: int = 3,
    micro: int = 1,
    before_micro: Callable[[int], None] | None = None,
) -> None:
    """AdamW side by side; micro-batch ``i`` of step ``s`` on rank ``r`` gates iff ``uses(r, s*micro+i)``.

    The reference sums every rank's micro-batch losses (divided by ``world``
    and ``micro``): the mean FSDP's averaging reduction computes.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        xs = torch.randn(world, micro, 3, 4, dtype=torch.float64, generator=g)
        ref_total = torch.zeros((), dtype=torch.float64)
        local_total = torch.zeros((), dtype=torch.float64)
        for i in range(micro):
            index = step * micro + i
            ref_loss = sum(ref(xs[r, i], uses(r, index)) for r in range(world)) / (world * micro)
            assert isinstance(ref_loss, torch.Tensor)
            ref_loss.backward()
            ref_total += ref_loss.detach()
            if before_micro is not None:
                before_micro(i)
            elif micro > 1:
                model.set_requires_gradient_sync(i == micro - 1)  # type: ignore[operator]
            local = model(xs[rank, i], uses(rank, index)) / micro
            local.backward()
            local_total += local.detach()
        mean = hc.all_reduce(local_total.clone(), "avg")
        torch.testing.assert_close(mean, ref_total, rtol=1e-7, atol=1e-9, msg=f"loss step {step}")
        step_and_compare(model, ref, (opt, ref_opt), step)


def _rank0(rank: int, index: int) -> bool:
    return rank == 0


def _alternating(rank: int, index: int) -> bool:
    return rank == index % 2  # each step another rank; at 4 ranks, ranks 2 and 3 never


def _rank0_first_micro(rank: int, index: int) -> bool:
    return rank == 0 and index % 2 == 0  # with 2 micro-batches: rank 0 in the first only, rank 1 never


@pytest.mark.distributed(world_size=2, timeout=120)
@pytest.mark.parametrize("fused", [True, False])
def test_expert_used_by_one_rank(rank: int, world_size: int, fused: bool) -> None:
    """The reviewer's case: rank 1 used to keep ``expert.weight.grad`` None and never update its shard."""
    torch.manual_seed(0)
    ref = _Gated().double()
    model = copy.deepcopy(ref)
    fully_shard(model, comm_fusion=fused)
    _train(model, ref, _rank0, rank=rank, world=world_size)
    assert model.idle.weight.grad is None  # unused on every rank: unset, as in the reference


@pytest.mark.distributed(world_size=2, timeout=120)
def test_expert_used_by_one_rank_replicated(rank: int, world_size: int) -> None:
    """The same through ``replicate_params``' all-reduce, with the expert's bias sharded beside it."""
    torch.manual_seed(0)
    ref = _Gated().double()
    model = copy.deepcopy(ref)
    fully_shard(model, replicate_params=[model.expert.weight, model.idle.weight])
    _train(model, ref, _alternating, rank=rank, world=world_size)


@pytest.mark.distributed(world_size=2, timeout=120)
def test_expert_used_by_one_rank_shard_dim_1(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    ref = _Gated().double()
    model = copy.deepcopy(ref)
    fully_shard(model, shard_placement_fn=lambda p: torch.distributed.tensor.Shard(p.dim() - 1))
    _train(model, ref, _rank0, rank=rank, world=world_size)


@pytest.mark.distributed(world_size=2, timeout=120)
def test_expert_used_by_one_rank_bf16_reduce(rank: int, world_size: int) -> None:
    """Flags survive a low-precision reduction (the gradients only within bf16's error)."""
    from hp_fsdp import MixedPrecisionPolicy

    torch.manual_seed(0)
    ref = _Gated()
    model = copy.deepcopy(ref)
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    model(x, rank == 0).backward()
    assert model.expert.weight.grad is not None and model.expert.bias.grad is not None
    assert model.idle.weight.grad is None
    ref_loss = sum(ref(x, r == 0) for r in range(world_size)) / world_size
    assert isinstance(ref_loss, torch.Tensor)
    ref_loss.backward()
    torch.testing.assert_close(full(model.expert.weight.grad), ref.expert.weight.grad, rtol=2e-2, atol=2e-3)


@pytest.mark.distributed(world_size=2, timeout=120)
def test_accumulated_over_micro_batches(rank: int, world_size: int) -> None:
    """Unsynced micro-batches: rank 0 used the expert in its first micro-batch only, rank 1 never.

    Rank 0's kept (unreduced) gradient counts at the synced micro-batch; rank 1 takes the reduced shard.
    """
    torch.manual_seed(0)
    ref = _Gated().double()
    model = copy.deepcopy(ref)
    fully_shard(model)
    _train(model, ref, _rank0_first_micro, rank=rank, world=world_size, micro=2)


@pytest.mark.distributed(world_size=2, timeout=60)
@pytest.mark.parametrize("fused", [True, False])
def test_unit_without_any_local_gradient(rank: int, world_size: int, fused: bool) -> None:
    """A whole unit gets gradients on rank 0 only; its marker fires everywhere, so every rank reduces it.

    It used to raise "none of these parameters received a gradient" on rank 1
    (or, without that check, skip the reduce-scatter there and leave rank 0
    waiting); now both ranks issue the same collectives and match the reference.
    """
    torch.manual_seed(0)
    ref = _Stack().double()
    model = copy.deepcopy(ref)
    fully_shard(model.skip, comm_fusion=fused)
    fully_shard(model, comm_fusion=fused)
    with record_collectives() as log:
        _train(model, ref, _rank0, rank=rank, world=world_size, steps=2)
    counts = torch.tensor([log.count("reduce_scatter_tensor"), log.count("all_gather_into_tensor")])
    everyone = hc.all_gather_into_tensor(torch.empty(world_size * 2, dtype=counts.dtype), counts)
    assert everyone.view(world_size, 2).eq(counts).all(), everyone  # the same collectives on every rank


@pytest.mark.distributed(world_size=4, timeout=180)
@pytest.mark.parametrize("all_reduce_every_step", [True, False])
def test_hsdp_expert_used_in_one_row(
    rank: int, world_size: int, device_mesh_factory: Any, all_reduce_every_step: bool
) -> None:
    """HSDP 2x2: only rank 0 of row 0 uses the expert, so row 1 has no gradient for it at all.

    The flags travel through the replicate-dim all-reduce (and through the
    partial sums kept when the all-reduce is deferred to the last micro-batch).
    """
    mesh = device_mesh_factory((2, 2), ("replicate", "shard"))
    torch.manual_seed(0)
    ref = _Gated().double()
    model = copy.deepcopy(ref)
    fully_shard(model, mesh=mesh)
    if all_reduce_every_step:
        _train(model, ref, _rank0, rank=rank, world=world_size)
    else:  # two micro-batches: reduce-scatter both, all-reduce with the second only
        defer = model.set_requires_all_reduce  # type: ignore[attr-defined]
        _train(model, ref, _rank0, rank=rank, world=world_size, micro=2, before_micro=lambda i: defer(i == 1))


class _DeadBranch(nn.Module):
    """``expert`` runs on every rank, but its output reaches the loss only where ``use`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.expert = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        h = self.a(x)
        e = self.expert(h)
        if use:
            h = h + e
        return self.b(h).pow(2).mean()


@pytest.mark.distributed(world_size=2, timeout=60)
@pytest.mark.parametrize("reshard", [True, False])
def test_backward_on_some_ranks_only_raises(rank: int, world_size: int, reshard: bool) -> None:
    """The expert unit's backward runs on rank 0 only: every rank raises, naming a unit, instead of hanging.

    Its reduction on rank 0 meets unit ``a``'s on rank 1 (the units are the
    same size, so the data would mix without a word); the unit tag in the
    reduction tells ([Note: one unit's reduction met another's]).
    """
    torch.manual_seed(0)
    model = _DeadBranch().double()
    for sub in (model.a, model.expert, model.b):
        fully_shard(sub, reshard_after_forward=reshard)
    fully_shard(model)
    x = torch.randn(3, 4, dtype=torch.float64)
    unit = "expert" if rank == 0 else "a"
    with pytest.raises(
        RuntimeError, match=rf"reduction of unit '{unit}' met another unit's reduction on some rank"
    ):
        model(x, rank == 0).backward()
